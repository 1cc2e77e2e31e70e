// expect: a dim takes at most one padding
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ShardOn<0, Dim<Shard<"tp">, Padded<16>>>> t{"w", {8, 8}, DType::f32};
#else
Tensor<ShardOn<0, Dim<Shard<"tp">, Padded<16>, RoundUp<64>>>> t{"w", {8, 8}, DType::f32};
#endif
