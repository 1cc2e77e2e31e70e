// expect: the shard spec cuts a dim beyond the tensor's rank
// context: int dim = 1; int rank = 1
#include "reshard/layout/static_layout.hpp"

using namespace reshard::st;
using reshard::DType;

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ColumnParallel<"tp">, Shape<64>> bias{"bias", {}, DType::f32};
#else
Tensor<RowParallel<"tp">, Shape<64>> bias{"bias", {}, DType::f32};
#endif
