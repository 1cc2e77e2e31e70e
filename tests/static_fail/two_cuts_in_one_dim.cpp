// expect: Dim<...> takes at most one cut: Replicate or Shard<axes...>
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ShardOn<0, Dim<Shard<"tp">, Chunk>>> t{"w", {8, 8}, DType::f32};
#else
Tensor<ShardOn<0, Dim<Shard<"tp">, Shard<"dp">>>> t{"w", {8, 8}, DType::f32};
#endif
