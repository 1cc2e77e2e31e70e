// expect: reshard: tensor_spec() takes each dim as a DimSpec of axis indices
// context: reshard::LayoutBuilder
#include "reshard/layout/layout.hpp"

using reshard::DType;

#ifdef RESHARD_STATIC_FAIL_CONTROL
reshard::TensorSpec f() { return reshard::tensor_spec("w", {4, 4}, DType::f32, {reshard::DimSpec{{reshard::AxisRef{0}}}, {}}); }
#else
reshard::TensorSpec f() { return reshard::tensor_spec("w", {4, 4}, DType::f32, {"tp", {}}); }
#endif
