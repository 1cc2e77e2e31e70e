// expect: a tensor's stage axis may not also cut one of its dims
// context: axis = reshard::st::axis_name{"pp"}
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
auto t = Tensor<ColumnParallel<"tp">>("w", {8, 8}, DType::f32).stage<"pp">(0);
#else
auto t = Tensor<ColumnParallel<"pp">>("w", {8, 8}, DType::f32).stage<"pp">(0);
#endif
