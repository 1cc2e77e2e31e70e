// expect: a static extent is >= 1, or reshard::st::dynamic
// context: int dim = 1; long int extent = 0
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<Replicated, Shape<8, dynamic>> t{"w", {4}, DType::f32};
#else
Tensor<Replicated, Shape<8, 0>> t{"w", {}, DType::f32};
#endif
