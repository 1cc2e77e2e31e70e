// expect: a sub-axis needs stride >= 1 and size >= 1
// context: axis_ref{reshard::st::axis_name{"tp"}, 0, 2}
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ColumnParallel<sub_axis("tp", 1, 2)>> t{"w", {8, 8}, DType::f32};
#else
Tensor<ColumnParallel<sub_axis("tp", 0, 2)>> t{"w", {8, 8}, DType::f32};
#endif
