// expect: Tensor<Spec, Shape> takes Shape<extents...> or AnyShape
#include "reshard/layout/static_layout.hpp"

using namespace reshard::st;
using reshard::DType;

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<Replicated, Shape<8>> t{"w", {}, DType::f32};
#else
Tensor<Replicated, int> t{"w", {}, DType::f32};
#endif
