// expect: a tensor has 1 to 8 dims
// context: int rank = 9
#include "prelude.hpp"

using R = Replicate;

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ShardSpec<R, R, R, R, R, R, R, R>> t{"w", {1, 1, 1, 1, 1, 1, 1, 1}, DType::f32};
#else
Tensor<ShardSpec<R, R, R, R, R, R, R, R, R>> t{"w", {1, 1, 1, 1, 1, 1, 1, 1, 1}, DType::f32};
#endif
