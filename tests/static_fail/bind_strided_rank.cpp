// expect: a strided view bound to a tensor has one extent and one stride per dim of the tensor
// context: tensor_dims = 2; long unsigned int view_dims = 3
#include "reshard/exec/binding.hpp"
#include "prelude.hpp"

using M = MeshOf<Axis<"tp", 2>>;

void f(LayoutOf<M>& L, std::map<std::string, reshard::BufferView>& side) {
  static float memory[32];
  auto w = L.add<float>(Tensor<ColumnParallel<"tp">, Shape<8, 8>>("w", {}, DType::f32));
#ifdef RESHARD_STATIC_FAIL_CONTROL
  reshard::bind_tensor(side, w, memory, std::array<std::int64_t, 2>{4, 8}, std::array<std::int64_t, 2>{8, 1});
#else
  reshard::bind_tensor(side, w, memory, std::array<std::int64_t, 3>{4, 2, 4}, std::array<std::int64_t, 3>{8, 4, 1});
#endif
}
