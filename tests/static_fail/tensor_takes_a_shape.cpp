// expect: Tensor<Spec, Shape> takes Shape<extents...> or AnyShape
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
Tensor<Replicated, Shape<8>> t{"w", {}, DType::f32};
#else
Tensor<Replicated, int> t{"w", {}, DType::f32};
#endif
