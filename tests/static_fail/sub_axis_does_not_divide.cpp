// expect: a sub-axis's stride * size must divide its axis size
// context: axis_ref{reshard::st::axis_name{"tp"}, 3, -1}; long int axis_size = 4
#include "prelude.hpp"

using M = MeshOf<Axis<"dp">, Axis<"tp", 4>>;

#ifdef RESHARD_STATIC_FAIL_CONTROL
void f(LayoutOf<M>& L) { L.add(Tensor<ColumnParallel<sub_axis("tp", 2)>>("w", {8, 8}, DType::f32)); }
#else
void f(LayoutOf<M>& L) { L.add(Tensor<ColumnParallel<sub_axis("tp", 3)>>("w", {8, 8}, DType::f32)); }
#endif
