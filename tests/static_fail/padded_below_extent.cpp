// expect: Padded<P> must be at least the dim's extent
// context: int dim = 0; long int padded = 8; long int extent = 10
#include "prelude.hpp"

using M = MeshOf<Axis<"tp", 4>>;

#ifdef RESHARD_STATIC_FAIL_CONTROL
void f(LayoutOf<M>& L) { L.add(Tensor<ShardOn<0, Dim<Shard<"tp">, Padded<12>>>, Shape<10>>("w", {}, DType::f32)); }
#else
void f(LayoutOf<M>& L) { L.add(Tensor<ShardOn<0, Dim<Shard<"tp">, Padded<8>>>, Shape<10>>("w", {}, DType::f32)); }
#endif
