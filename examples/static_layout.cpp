// A refit plan between two layouts whose structure is spelled as types:
// a Megatron-like training side (pp x dp x tp, per-group fused qkv, vocabulary
// padded to 128 * tp) and a vLLM-like inference side (tp, [q; k; v]). Sizes
// that come from a config (dp, hidden size) stay runtime values. Prints the
// inference layout as the JSON the file contract describes, and the plan.
#include "reshard/layout/static_layout.hpp"

#include <cstdio>
#include <string>

#include "reshard/json_io.hpp"
#include "reshard/plan/plan.hpp"

namespace st = reshard::st;
using reshard::DType;

// The structure: axis names, which dim each axis cuts, and how.
using TrainMesh = st::MeshOf<st::Axis<"pp", 2>, st::Axis<"dp">, st::Axis<"tp", 2>>;
using InferMesh = st::MeshOf<st::Axis<"tp", 4>>;
using Col = st::ColumnParallel<"tp">;  // q, k, v, gate, up: dim 0 cut by tp
using Row = st::RowParallel<"tp">;     // o, down: dim 1 cut by tp
// Megatron pads the vocabulary to a multiple of 128 * tp, vLLM to a multiple of 64.
using TrainVocab = st::ShardOn<0, st::Dim<st::Shard<"tp">, st::RoundUpPerPart<128>>>;
using InferVocab = st::ShardOn<0, st::Dim<st::Shard<"tp">, st::RoundUp<64>>>;

struct Config {
  std::int64_t hidden = 256, q = 256, kv = 64, ffn = 512, vocab = 1000, layers = 4;
  std::int64_t groups = 4;  // query groups (kv heads)
};

template <class L, class Stage>
void add_layer(L& layout, const Config& c, int layer, std::int64_t qkv_rounds, const char* qkv_name,
               const char* fc1_name, Stage on_stage) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  layout.add(on_stage(st::Tensor<st::Replicated>(p + "input_layernorm.weight", {c.hidden}, DType::bf16)));
  auto q = layout.add(on_stage(st::Tensor<Col>(p + "self_attn.q_proj.weight", {c.q, c.hidden}, DType::bf16)));
  auto k =
      layout.add(on_stage(st::Tensor<Col>(p + "self_attn.k_proj.weight", {c.kv, c.hidden}, DType::bf16)));
  auto v =
      layout.add(on_stage(st::Tensor<Col>(p + "self_attn.v_proj.weight", {c.kv, c.hidden}, DType::bf16)));
  layout.concat(p + qkv_name, st::Interleave{qkv_rounds}, q, k, v);
  layout.add(on_stage(st::Tensor<Row>(p + "self_attn.o_proj.weight", {c.hidden, c.q}, DType::bf16)));
  auto gate =
      layout.add(on_stage(st::Tensor<Col>(p + "mlp.gate_proj.weight", {c.ffn, c.hidden}, DType::bf16)));
  auto up = layout.add(on_stage(st::Tensor<Col>(p + "mlp.up_proj.weight", {c.ffn, c.hidden}, DType::bf16)));
  layout.concat(p + fc1_name, gate, up);
  layout.add(on_stage(st::Tensor<Row>(p + "mlp.down_proj.weight", {c.hidden, c.ffn}, DType::bf16)));
}

int main() {
  const Config c;
  const std::int64_t dp = 2;  // from the job's launch config
  st::LayoutOf<TrainMesh> train{TrainMesh(dp), "train"};
  const std::int64_t tp_train = train.mesh.size<"tp">();  // Int<2>: known at compile time
  const std::int64_t per_stage = c.layers / 2;
  train.add(
      st::Tensor<TrainVocab>("model.embed_tokens.weight", {c.vocab, c.hidden}, DType::bf16).stage<"pp">(0));
  for (int l = 0; l < c.layers; ++l)
    add_layer(train, c, l, c.groups / tp_train, "self_attention.linear_qkv.weight", "mlp.linear_fc1.weight",
              [&](auto t) { return t.template stage<"pp">(l / per_stage); });
  train.add(st::Tensor<st::Replicated>("model.norm.weight", {c.hidden}, DType::bf16).stage<"pp">(1));
  train.add(st::Tensor<TrainVocab>("lm_head.weight", {c.vocab, c.hidden}, DType::bf16).stage<"pp">(1));

  InferMesh infer_mesh;
  infer_mesh.first_rank = train.mesh.size();  // disaggregated: after the training ranks
  st::LayoutOf<InferMesh> infer{infer_mesh, "infer"};
  infer.add(st::Tensor<InferVocab>("model.embed_tokens.weight", {c.vocab, c.hidden}, DType::bf16));
  for (int l = 0; l < c.layers; ++l)
    add_layer(infer, c, l, 1, "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight",
              [](auto t) { return t; });
  infer.add(st::Tensor<st::Replicated>("model.norm.weight", {c.hidden}, DType::bf16));
  infer.add(st::Tensor<InferVocab>("lm_head.weight", {c.vocab, c.hidden}, DType::bf16));

  try {
    const reshard::Layout src = train.lower(), dst = infer.lower();
    const auto j = reshard::layout_to_json(dst);  // the CONTRACT.md file form of the lowered layout
    std::printf("inference mesh: %s\nfirst tensor: %s\n", j["mesh"].dump().c_str(),
                j["tensors"][0].dump().c_str());
    const reshard::Schedule s = reshard::plan(src, dst);
    std::printf(
        "plan: %zu tensors, %lld copies, %lld bytes over the network, %lld bytes local, "
        "max send %lld B, max recv %lld B\n",
        dst.tensors.size(), static_cast<long long>(s.stats.copies), static_cast<long long>(s.stats.bytes),
        static_cast<long long>(s.stats.local_bytes), static_cast<long long>(s.stats.max_send_bytes),
        static_cast<long long>(s.stats.max_recv_bytes));
    std::int64_t model_bytes = 0;
    for (const auto& t : dst.tensors) model_bytes += t.elements() * reshard::element_bytes(t.dtype);
    std::printf("model %lld B (replicated tensors land on every inference rank)\n",
                static_cast<long long>(model_bytes));
    return s.copies.empty() ? 1 : 0;
  } catch (const reshard::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
