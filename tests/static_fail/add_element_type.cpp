// expect: LayoutOf::add<E> takes the tensor's element type
// context: E = short unsigned int
#include "prelude.hpp"

using M = MeshOf<Axis<"tp", 2>>;

#ifdef RESHARD_STATIC_FAIL_CONTROL
void f(LayoutOf<M>& L) { L.add<reshard::bf16_t>(Tensor<ColumnParallel<"tp">>("w", {8, 8}, DType::bf16)); }
#else
void f(LayoutOf<M>& L) { L.add<std::uint16_t>(Tensor<ColumnParallel<"tp">>("w", {8, 8}, DType::bf16)); }
#endif
