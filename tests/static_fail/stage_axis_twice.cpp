// expect: a tensor names one stage axis twice
// context: axis = reshard::st::axis_name{"pp"}
#include "prelude.hpp"

#ifdef RESHARD_STATIC_FAIL_CONTROL
auto t = Tensor<Replicated>("w", {8}, DType::f32).stage<"pp">(0).stage<"dp">(1);
#else
auto t = Tensor<Replicated>("w", {8}, DType::f32).stage<"pp">(0).stage<"pp">(1);
#endif
