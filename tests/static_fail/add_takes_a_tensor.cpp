// expect: LayoutOf::add takes a Tensor<Spec, ...>
#include "prelude.hpp"

using M = MeshOf<Axis<"tp", 2>>;

#ifdef RESHARD_STATIC_FAIL_CONTROL
void f(LayoutOf<M>& L) { L.add(Tensor<Replicated>("w", {8}, DType::f32)); }
#else
void f(LayoutOf<M>& L) { L.add(42); }
#endif
