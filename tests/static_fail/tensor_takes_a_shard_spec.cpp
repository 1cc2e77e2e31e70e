// expect: Tensor<Spec, ...> takes a shard spec
// context: tensor_takes_a_shard_spec() [with T = {reshard::st::Shard<
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ColumnParallel<"tp">> t{"w", {8, 8}, DType::f32};
#else
Tensor<Shard<"tp">> t{"w", {8, 8}, DType::f32};
#endif
