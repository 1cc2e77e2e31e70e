// expect: ShardDims<...> takes On<dim, spec> entries
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ShardDims<On<1, Shard<"tp">>>> t{"w", {8, 8}, DType::f32};
#else
Tensor<ShardDims<Shard<"tp">>> t{"w", {8, 8}, DType::f32};
#endif
