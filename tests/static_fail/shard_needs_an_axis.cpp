// expect: Shard<...> needs at least one mesh axis; write Replicate for a dim that is not cut
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ShardSpec<Replicate, Shard<"tp">>> t{"w", {8, 8}, DType::f32};
#else
Tensor<ShardSpec<Shard<>, Shard<"tp">>> t{"w", {8, 8}, DType::f32};
#endif
