// expect: two On<dim, ...> entries name the same dim
// context: int dim = 0
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ShardDims<On<0, Shard<"ep">>, On<1, Shard<"tp">>>> t{"w", {8, 8}, DType::f32};
#else
Tensor<ShardDims<On<0, Shard<"ep">>, On<0, Shard<"tp">>>> t{"w", {8, 8}, DType::f32};
#endif
