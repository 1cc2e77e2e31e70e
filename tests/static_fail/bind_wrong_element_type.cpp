// expect: the memory bound to a tensor must be of its element type
// context: Tensor = float; Given = reshard::bf16_t
#include "reshard/exec/binding.hpp"
#include "prelude.hpp"

using M = MeshOf<Axis<"tp", 2>>;

void f(LayoutOf<M>& L, std::map<std::string, reshard::BufferView>& side) {
  auto w = L.add<float>(Tensor<ColumnParallel<"tp">>("w", {8, 8}, DType::f32));
#ifdef RESHARD_STATIC_FAIL_CONTROL
  static float memory[32];
  reshard::bind_tensor(side, w, std::span<float>(memory));
#else
  static reshard::bf16_t memory[32];
  reshard::bind_tensor(side, w, std::span<reshard::bf16_t>(memory));
#endif
}
