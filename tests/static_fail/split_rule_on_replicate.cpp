// expect: a split rule only applies to a dim cut by Shard<axes...>; a Replicate dim is not split
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ShardOn<0, Dim<Replicate, Padded<16>>>> t{"w", {8, 8}, DType::f32};
#else
Tensor<ShardOn<0, Dim<Replicate, Chunk>>> t{"w", {8, 8}, DType::f32};
#endif
