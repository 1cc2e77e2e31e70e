// expect: a flat buffer holds a contiguous range: Cyclic is not allowed
#include "prelude.hpp"

using M = MeshOf<Axis<"dp", 2>, Axis<"tp", 2>>;

#ifdef RESHARD_STATIC_FAIL_CONTROL
void f(LayoutOf<M>& L) { auto a = L.add(Tensor<ColumnParallel<"tp">>("a", {8, 8}, DType::f32)); L.flat<Dim<Shard<"dp">, Chunk>>("bucket", a); }
#else
void f(LayoutOf<M>& L) { auto a = L.add(Tensor<ColumnParallel<"tp">>("a", {8, 8}, DType::f32)); L.flat<Dim<Shard<"dp">, Cyclic<1>>>("bucket", a); }
#endif
