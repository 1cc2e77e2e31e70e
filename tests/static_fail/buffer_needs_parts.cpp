// expect: a buffer's parts are the handles LayoutOf::add returned, at least one
#include "prelude.hpp"

using M = MeshOf<Axis<"tp", 2>>;

#ifdef RESHARD_STATIC_FAIL_CONTROL
void f(LayoutOf<M>& L) { auto a = L.add(Tensor<Replicated>("a", {8}, DType::f32)); L.concat("a_alone", a); }
#else
void f(LayoutOf<M>& L) { L.concat("nothing"); }
#endif
