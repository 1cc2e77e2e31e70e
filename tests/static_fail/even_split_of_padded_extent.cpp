// expect: an even split must divide the dim's extent; use Chunk or Balanced for uneven dims, or pad it
// context: long int extent = 10; long int parts = 8
#include "prelude.hpp"

using M = MeshOf<Axis<"ep", 2>, Axis<"tp", 4>>;

#ifdef RESHARD_STATIC_FAIL_CONTROL
void f(LayoutOf<M>& L) { L.add(Tensor<ShardOn<0, Dim<Shard<"ep", "tp">, Padded<16>>>>("w", {9, 4}, DType::f32)); }
#else
void f(LayoutOf<M>& L) { L.add(Tensor<ShardOn<0, Dim<Shard<"ep", "tp">, Padded<10>>>>("w", {9, 4}, DType::f32)); }
#endif
