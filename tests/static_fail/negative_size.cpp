// expect: Sizes<...> lists at least one part size, all >= 0
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ShardOn<0, Dim<Shard<"tp">, Sizes<1, 0>>>> t{"w", {1}, DType::f32};
#else
Tensor<ShardOn<0, Dim<Shard<"tp">, Sizes<2, -1>>>> t{"w", {1}, DType::f32};
#endif
