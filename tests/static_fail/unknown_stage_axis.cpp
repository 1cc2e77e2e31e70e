// expect: the stage names an axis that is not in the mesh
// context: axis = reshard::st::axis_name{"pp"}
#include "prelude.hpp"

using M = MeshOf<Axis<"dp">, Axis<"tp", 4>>;

#ifdef RESHARD_STATIC_FAIL_CONTROL
void f(LayoutOf<M>& L) { L.add(Tensor<ColumnParallel<"tp">>("w", {8, 8}, DType::f32).stage<"dp">(0)); }
#else
void f(LayoutOf<M>& L) { L.add(Tensor<ColumnParallel<"tp">>("w", {8, 8}, DType::f32).stage<"pp">(0)); }
#endif
