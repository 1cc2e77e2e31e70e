// expect: a dim index is >= 0
// context: int dim = -1
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ShardOn<0, Shard<"tp">>> t{"w", {8, 8}, DType::f32};
#else
Tensor<ShardOn<-1, Shard<"tp">>> t{"w", {8, 8}, DType::f32};
#endif
