// expect: the concat dim is beyond the rank of a part
// context: int dim = 2; int rank = 2
#include "prelude.hpp"

using M = MeshOf<Axis<"tp", 2>>;
using W = Tensor<ShardSpec<Shard<"tp">, Replicate>>;

#ifdef RESHARD_STATIC_FAIL_CONTROL
void f(LayoutOf<M>& L) { auto a = L.add(W("a", {8, 8}, DType::f32)); auto b = L.add(W("b", {8, 8}, DType::f32)); L.concat<1>("ab", a, b); }
#else
void f(LayoutOf<M>& L) { auto a = L.add(W("a", {8, 8}, DType::f32)); auto b = L.add(W("b", {8, 8}, DType::f32)); L.concat<2>("ab", a, b); }
#endif
