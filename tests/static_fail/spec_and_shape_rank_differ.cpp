// expect: the shard spec and the shape have different numbers of dims
// context: int spec_dims = 2; int shape_dims = 3
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ShardSpec<Shard<"tp">, Replicate>, Shape<4, 4>> t{"w", {}, DType::f32};
#else
Tensor<ShardSpec<Shard<"tp">, Replicate>, Shape<4, 4, 4>> t{"w", {}, DType::f32};
#endif
