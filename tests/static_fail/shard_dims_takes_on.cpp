// expect: ShardDims<...> takes On<dim, spec> entries
#include "reshard/layout/static_layout.hpp"

using namespace reshard::st;
using reshard::DType;

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<ShardDims<On<1, Shard<"tp">>>> t{"w", {8, 8}, DType::f32};
#else
Tensor<ShardDims<Shard<"tp">>> t{"w", {8, 8}, DType::f32};
#endif
