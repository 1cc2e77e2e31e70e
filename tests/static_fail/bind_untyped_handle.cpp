// expect: reshard::bind_tensor takes the handle st::LayoutOf::add<E>(...) returned
#include "reshard/exec/binding.hpp"
#include "prelude.hpp"

using M = MeshOf<Axis<"tp", 2>>;

void f(LayoutOf<M>& L, std::map<std::string, reshard::BufferView>& side) {
  static float memory[32];
#ifdef RESHARD_STATIC_FAIL_CONTROL
  auto w = L.add<float>(Tensor<ColumnParallel<"tp">>("w", {8, 8}, DType::f32));
#else
  auto w = L.add(Tensor<ColumnParallel<"tp">>("w", {8, 8}, DType::f32));
#endif
  reshard::bind_tensor(side, w, std::span<float>(memory));
}
