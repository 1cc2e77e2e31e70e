// expect: a Shard<...> names one mesh axis twice (or two overlapping sub-axes of it)
// context: axis = reshard::st::axis_name{"tp"}
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ColumnParallel<"dp", "tp">> t{"w", {8, 8}, DType::f32};
#else
Tensor<ColumnParallel<"tp", "tp">> t{"w", {8, 8}, DType::f32};
#endif
