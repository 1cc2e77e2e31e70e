// expect: ShardSpec<...> takes one dim spec per tensor dim: Replicate, Shard<axes...> or Dim<...>
// context: int dim = 1
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ShardSpec<Shard<"tp">, Replicate>> t{"w", {8, 8}, DType::f32};
#else
Tensor<ShardSpec<Shard<"tp">, Replicated>> t{"w", {8, 8}, DType::f32};
#endif
