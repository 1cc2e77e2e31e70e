// expect: Sizes<...> lists one size per part (the product of the dim's axis sizes)
// context: long int sizes = 2; long int parts = 4
#include "prelude.hpp"

using M = MeshOf<Axis<"tp", 4>>;

#ifdef RESHARD_STATIC_FAIL_CONTROL
void f(LayoutOf<M>& L) { L.add(Tensor<ShardOn<0, Dim<Shard<"tp">, Sizes<5, 5, 0, 0>>>>("w", {10}, DType::f32)); }
#else
void f(LayoutOf<M>& L) { L.add(Tensor<ShardOn<0, Dim<Shard<"tp">, Sizes<5, 5>>>>("w", {10}, DType::f32)); }
#endif
