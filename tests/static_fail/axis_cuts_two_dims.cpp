// expect: this mesh axis cuts two dims of one tensor; each mesh axis may cut at most one dim
// context: axis = reshard::st::axis_name{"tp"}; int first_dim = 0; int second_dim = 1
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ShardSpec<Shard<"tp">, Shard<"dp">>> t{"w", {8, 8}, DType::f32};
#else
Tensor<ShardSpec<Shard<"tp">, Shard<"dp", "tp">>> t{"w", {8, 8}, DType::f32};
#endif
