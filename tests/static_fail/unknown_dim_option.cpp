// expect: Dim<...> takes a cut (Replicate or Shard<axes...>), one split rule (Even, Chunk, Balanced, Sizes<...> or Cyclic<B>) and one padding (Padded<P>, RoundUp<M> or RoundUpPerPart<M>); this argument is none of them
// context: dim_takes_cut_split_rule_and_padding() [with T = {int}]
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ShardOn<0, Dim<Shard<"tp">, Balanced>>> t{"w", {8, 8}, DType::f32};
#else
Tensor<ShardOn<0, Dim<Shard<"tp">, int>>> t{"w", {8, 8}, DType::f32};
#endif
