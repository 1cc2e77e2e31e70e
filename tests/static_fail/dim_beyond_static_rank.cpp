// expect: the shard spec cuts a dim beyond the tensor's rank
// context: int dim = 1; int rank = 1
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ColumnParallel<"tp">, Shape<64>> bias{"bias", {}, DType::f32};
#else
Tensor<RowParallel<"tp">, Shape<64>> bias{"bias", {}, DType::f32};
#endif
