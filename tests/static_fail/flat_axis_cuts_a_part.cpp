// expect: a flat buffer's axes may not cut or stage its parts
// context: axis = reshard::st::axis_name{"tp"}
#include "prelude.hpp"

using M = MeshOf<Axis<"dp", 2>, Axis<"tp", 2>>;

#ifdef RESHARD_STATIC_FAIL_CONTROL
void f(LayoutOf<M>& L) { auto a = L.add(Tensor<ColumnParallel<"tp">>("a", {8, 8}, DType::f32)); L.flat<Shard<"dp">>("bucket", a); }
#else
void f(LayoutOf<M>& L) { auto a = L.add(Tensor<ColumnParallel<"tp">>("a", {8, 8}, DType::f32)); L.flat<Shard<"tp">>("bucket", a); }
#endif
