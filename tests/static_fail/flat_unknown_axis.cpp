// expect: the shard spec names an axis that is not in the mesh
// context: axis = reshard::st::axis_name{"zp"}
#include "prelude.hpp"

using M = MeshOf<Axis<"dp", 2>, Axis<"tp", 2>>;

#ifdef RESHARD_STATIC_FAIL_CONTROL
void f(LayoutOf<M>& L) { auto a = L.add(Tensor<Replicated>("a", {8}, DType::f32)); L.flat<Shard<"dp">>("bucket", a); }
#else
void f(LayoutOf<M>& L) { auto a = L.add(Tensor<Replicated>("a", {8}, DType::f32)); L.flat<Shard<"zp">>("bucket", a); }
#endif
