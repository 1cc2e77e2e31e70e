// expect: an even split must divide the dim's extent; use Chunk or Balanced for uneven dims, or pad it
// context: int dim = 0; long int extent = 10; long int parts = 4
#include "prelude.hpp"

using M = MeshOf<Axis<"dp">, Axis<"tp", 4>>;

#ifdef RESHARD_STATIC_FAIL_CONTROL
void f(LayoutOf<M>& L) { L.add(Tensor<ColumnParallel<"tp">, Shape<12, 4>>("w", {}, DType::f32)); }
#else
void f(LayoutOf<M>& L) { L.add(Tensor<ColumnParallel<"tp">, Shape<10, 4>>("w", {}, DType::f32)); }
#endif
