// expect: a dim takes one split rule: Even, Chunk, Balanced, Sizes<...> or Cyclic<B>
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ShardOn<0, Dim<Shard<"tp">, Chunk>>> t{"w", {8, 8}, DType::f32};
#else
Tensor<ShardOn<0, Dim<Shard<"tp">, Chunk, Balanced>>> t{"w", {8, 8}, DType::f32};
#endif
