// expect: Cyclic<B> needs a block size B >= 1
// context: long int block = 0
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ShardOn<0, Dim<Shard<"ep">, Cyclic<1>>>> t{"w", {8, 8}, DType::f32};
#else
Tensor<ShardOn<0, Dim<Shard<"ep">, Cyclic<0>>>> t{"w", {8, 8}, DType::f32};
#endif
