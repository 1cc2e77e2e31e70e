// expect: this mesh axis cuts two dims of one tensor; each mesh axis may cut at most one dim
// context: axis = reshard::st::axis_name{"tp"}
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ShardSpec<Shard<sub_axis("tp", 1, 2)>, Shard<sub_axis("tp", 2)>>> t{"w", {8, 8}, DType::f32};
#else
Tensor<ShardSpec<Shard<sub_axis("tp", 1, 4)>, Shard<sub_axis("tp", 2)>>> t{"w", {8, 8}, DType::f32};
#endif
