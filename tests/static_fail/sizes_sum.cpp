// expect: Sizes<...> must sum to the dim's extent (its padded extent when padded)
// context: long int sum = 11; long int extent = 10
#include "prelude.hpp"

using M = MeshOf<Axis<"tp", 4>>;

#ifdef RESHARD_STATIC_FAIL_CONTROL
void f(LayoutOf<M>& L) { L.add(Tensor<ShardOn<0, Dim<Shard<"tp">, Sizes<1, 2, 3, 4>>>, Shape<10>>("w", {}, DType::f32)); }
#else
void f(LayoutOf<M>& L) { L.add(Tensor<ShardOn<0, Dim<Shard<"tp">, Sizes<1, 2, 3, 5>>>, Shape<10>>("w", {}, DType::f32)); }
#endif
