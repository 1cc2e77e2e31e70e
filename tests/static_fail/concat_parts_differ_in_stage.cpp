// expect: all parts of a buffer must live on the same stage axes
#include "prelude.hpp"

using M = MeshOf<Axis<"pp", 2>, Axis<"tp", 2>>;
using W = Tensor<ColumnParallel<"tp">>;

#ifdef RESHARD_STATIC_FAIL_CONTROL
void f(LayoutOf<M>& L) { auto a = L.add(W("a", {8, 8}, DType::f32).stage<"pp">(0)); auto b = L.add(W("b", {8, 8}, DType::f32).stage<"pp">(0)); L.concat("ab", a, b); }
#else
void f(LayoutOf<M>& L) { auto a = L.add(W("a", {8, 8}, DType::f32).stage<"pp">(0)); auto b = L.add(W("b", {8, 8}, DType::f32)); L.concat("ab", a, b); }
#endif
