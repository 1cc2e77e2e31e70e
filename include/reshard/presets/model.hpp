#pragma once
// Model manifests: a HuggingFace config.json -> every tensor of the model's
// checkpoint, with its HF name, shape and dtype, tagged with the role it
// plays (so the layout presets can say how each role is cut).
//
// Architectures (HF class names in "architectures"):
//   LlamaForCausalLM       embed, per layer q/k/v/o + gate/up/down + 2 norms, norm, lm_head
//   Qwen3ForCausalLM       Llama + per-layer q_norm/k_norm [head_dim]
//   Qwen3MoeForCausalLM    Qwen3 with MoE layers: mlp.gate.weight [E, H] (router) and
//                          mlp.experts.{e}.{gate,up,down}_proj; a layer is MoE when it is
//                          not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0
//   DeepseekV3ForCausalLM  MLA attention (q_a_proj, q_a_layernorm, q_b_proj or q_proj when
//                          q_lora_rank is null, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
//                          o_proj); layers >= first_k_dense_replace (and % moe_layer_freq == 0)
//                          are MoE: router mlp.gate.weight + mlp.gate.e_score_correction_bias,
//                          routed experts, mlp.shared_experts.*; MTP layers
//                          model.layers.{L + i} (i < num_nextn_predict_layers) hold enorm,
//                          hnorm, eh_proj, embed_tokens, shared_head.{norm,head} and a full
//                          (MoE) decoder layer.
// With tie_word_embeddings the checkpoint has no lm_head.weight.
// Weights take the config's torch_dtype; e_score_correction_bias is f32 as in
// the released DeepSeek-V3 checkpoints. Biases (attention_bias, mlp_bias) and
// quantized checkpoints are not modelled: such configs are rejected.
#include <array>
#include <cstdint>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../base/dtype.hpp"
#include "../base/error.hpp"
#include "../base/json_text.hpp"

namespace reshard::presets {

enum class Architecture : std::uint8_t { llama, qwen3, qwen3_moe, deepseek_v3 };

inline std::string_view to_string(Architecture a) {
  switch (a) {
    case Architecture::llama: return "LlamaForCausalLM";
    case Architecture::qwen3: return "Qwen3ForCausalLM";
    case Architecture::qwen3_moe: return "Qwen3MoeForCausalLM";
    case Architecture::deepseek_v3: return "DeepseekV3ForCausalLM";
  }
  return "?";
}

/// The fields of a config.json the manifests and presets need.
struct ModelConfig {
  std::string origin = "<memory>";  ///< the config file, for messages
  Architecture arch = Architecture::llama;
  DType dtype = DType::bf16;
  std::int64_t hidden = 0, intermediate = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, vocab = 0;
  bool tied = false;
  bool qk_norm = false;  ///< Qwen3: per-head q_norm / k_norm
  // MoE
  std::int64_t experts = 0, moe_intermediate = 0, shared_experts = 0;
  std::int64_t first_dense = 0, moe_freq = 1, sparse_step = 1;
  std::vector<std::int64_t> mlp_only_layers;
  // MLA
  bool mla = false;
  std::int64_t q_lora_rank = 0;  ///< 0: no q compression (q_proj)
  std::int64_t kv_lora_rank = 0, qk_nope_dim = 0, qk_rope_dim = 0, v_head_dim = 0;
  std::int64_t mtp_layers = 0;
  /// quantization_config (quant_method fp8): weight_block_size; empty for BF16 checkpoints.
  std::vector<std::int64_t> fp8_block;

  bool is_moe_layer(std::int64_t l) const {
    if (experts == 0) return false;
    if (l >= layers) return true;  // DeepSeek MTP layers are MoE layers
    if (arch == Architecture::deepseek_v3) return l >= first_dense && l % moe_freq == 0;
    for (auto m : mlp_only_layers)
      if (m == l) return false;
    return (l + 1) % sparse_step == 0;
  }
  std::int64_t qk_head_dim() const { return qk_nope_dim + qk_rope_dim; }
  std::int64_t shared_intermediate() const { return moe_intermediate * shared_experts; }
  /// Decoder layers plus MTP layers (they share the layer numbering).
  std::int64_t total_layers() const { return layers + mtp_layers; }
};

/// What a checkpoint tensor is, for the presets.
enum class Role : std::uint8_t {
  embedding, final_norm, lm_head,
  input_norm, post_attn_norm,
  q, k, v, o, q_norm, k_norm,                 // attention (q, o also serve MLA without q_lora)
  q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b,  // MLA
  gate, up, down,                             // dense MLP
  router, router_bias,
  expert_gate, expert_up, expert_down,
  shared_gate, shared_up, shared_down,
  mtp_enorm, mtp_hnorm, mtp_eh_proj, mtp_embedding, mtp_head_norm, mtp_head,
  count_
};
inline constexpr int kRoles = static_cast<int>(Role::count_);

/// One tensor of a manifest: a checkpoint tensor, or (grouped manifests) the
/// stack of one layer's routed experts' checkpoint tensors along a new dim 0.
/// A stack's name spells its members: "model.layers.3.mlp.experts.{0..255}.gate_proj.weight"
/// stacks model.layers.3.mlp.experts.0.gate_proj.weight ... .255.gate_proj.weight
/// in that order (checkpoint_names()).
struct TensorInfo {
  std::string name;
  std::vector<std::int64_t> shape;
  DType dtype = DType::bf16;
  Role role = Role::embedding;
  std::int64_t layer = -1;   ///< decoder or MTP layer, -1 for model-wide tensors
  std::int64_t expert = -1;  ///< routed expert id, -1 otherwise (and for stacks)
  std::int64_t stacked = 0;  ///< > 0: a stack of this many experts (dim 0)
  std::int64_t elements() const {
    std::int64_t n = 1;
    for (auto e : shape) n *= e;
    return n;
  }
  std::int64_t bytes() const { return elements() * element_bytes(dtype); }
};

/// The checkpoint tensors a manifest tensor stands for: itself, or the members
/// of a stack ("a.{0..N-1}.b" -> a.0.b ... a.N-1.b), in dim-0 order.
inline std::vector<std::string> checkpoint_names(const TensorInfo& t) {
  if (t.stacked == 0) return {t.name};
  const auto open = t.name.find('{'), close = t.name.find('}');
  std::vector<std::string> out;
  for (std::int64_t e = 0; e < t.stacked; ++e)
    out.push_back(t.name.substr(0, open) + std::to_string(e) + t.name.substr(close + 1));
  return out;
}

/// Every checkpoint tensor of a model, in checkpoint order, with lookups.
/// In a grouped manifest each layer's routed experts are one stack per role
/// (expert_gate [E, I, H], expert_up [E, I, H], expert_down [E, H, I]).
struct Manifest {
  ModelConfig config;
  std::vector<TensorInfo> tensors;

  std::int64_t parameters() const {
    std::int64_t n = 0;
    for (const auto& t : tensors) n += t.elements();
    return n;
  }
  std::int64_t bytes() const {
    std::int64_t n = 0;
    for (const auto& t : tensors) n += t.bytes();
    return n;
  }
  /// Tensor id of a model-wide role (-1 if absent, e.g. a tied lm_head).
  int global(Role r) const { return global_[static_cast<std::size_t>(r)]; }
  /// Tensor id of a layer's role (-1 if the layer has none).
  int at(std::int64_t layer, Role r) const {
    return layers_[static_cast<std::size_t>(layer)].role[static_cast<std::size_t>(r)];
  }
  bool grouped = false;  ///< routed experts stacked per layer and role

  /// Routed expert tensors of a layer, by expert id (one stack when grouped;
  /// empty for dense layers).
  const std::vector<int>& experts(std::int64_t layer, Role r) const {
    const auto& li = layers_[static_cast<std::size_t>(layer)];
    return r == Role::expert_gate ? li.gate : r == Role::expert_up ? li.up : li.down;
  }

  void add(std::string name, std::vector<std::int64_t> shape, Role role, std::int64_t layer = -1,
           std::int64_t expert = -1, std::optional<DType> dtype = std::nullopt, std::int64_t stacked = 0) {
    const int id = static_cast<int>(tensors.size());
    tensors.push_back(
        TensorInfo{std::move(name), std::move(shape), dtype.value_or(config.dtype), role, layer, expert, stacked});
    if (layer < 0) {
      global_[static_cast<std::size_t>(role)] = id;
      return;
    }
    if (static_cast<std::size_t>(layer) >= layers_.size()) layers_.resize(static_cast<std::size_t>(layer) + 1);
    auto& li = layers_[static_cast<std::size_t>(layer)];
    if (role == Role::expert_gate) li.gate.push_back(id);
    else if (role == Role::expert_up) li.up.push_back(id);
    else if (role == Role::expert_down) li.down.push_back(id);
    else li.role[static_cast<std::size_t>(role)] = id;
  }

 private:
  struct LayerIndex {
    LayerIndex() { role.fill(-1); }
    std::array<int, kRoles> role;
    std::vector<int> gate, up, down;
  };
  std::array<int, kRoles> global_ = [] {
    std::array<int, kRoles> a{};
    a.fill(-1);
    return a;
  }();
  std::vector<LayerIndex> layers_;
};

namespace detail {
using nlohmann::json;

inline std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open the model config", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// Reads config fields with messages that name the file and the field.
struct ConfigReader {
  const json& j;
  const std::string& origin;

  const json* find(const char* key) const {
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  }
  [[noreturn]] void bad(const char* key, const std::string& what) const {
    throw LayoutError(ErrorContext{origin, "", key}, what);
  }
  std::int64_t integer(const char* key, const json* v) const {
    if (!v->is_number_integer()) bad(key, fmt::format("expected an integer, got {}", v->dump()));
    const auto x = v->get<std::int64_t>();
    if (x < 0) bad(key, fmt::format("{} is negative", x));
    return x;
  }
  std::int64_t required(const char* key, bool positive = true) const {
    const json* v = find(key);
    if (!v) bad(key, "missing (this architecture needs it)");
    const auto x = integer(key, v);
    if (positive && x == 0) bad(key, "must be positive");
    return x;
  }
  std::int64_t optional(const char* key, std::int64_t fallback) const {
    const json* v = find(key);
    return v ? integer(key, v) : fallback;
  }
  bool flag(const char* key, bool fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_boolean()) bad(key, fmt::format("expected true or false, got {}", v->dump()));
    return v->get<bool>();
  }
};
}  // namespace detail

/// Reads the fields of a parsed config.json; `origin` names it in messages.
inline ModelConfig parse_model_config(const nlohmann::json& j, const std::string& origin) {
  if (!j.is_object()) throw LayoutError(ErrorContext{origin, "", ""}, "a config.json must be a JSON object");
  detail::ConfigReader r{j, origin};
  ModelConfig c;
  c.origin = origin;
  const auto* archs = r.find("architectures");
  if (!archs) r.bad("architectures", "missing (expected e.g. [\"LlamaForCausalLM\"])");
  if (!archs->is_array() || archs->empty() || !(*archs)[0].is_string())
    r.bad("architectures", fmt::format("expected a list of class names, got {}", archs->dump()));
  const auto name = (*archs)[0].get<std::string>();
  if (name == "LlamaForCausalLM") c.arch = Architecture::llama;
  else if (name == "Qwen3ForCausalLM") c.arch = Architecture::qwen3;
  else if (name == "Qwen3MoeForCausalLM") c.arch = Architecture::qwen3_moe;
  else if (name == "DeepseekV3ForCausalLM") c.arch = Architecture::deepseek_v3;
  else
    r.bad("architectures", fmt::format("unknown architecture '{}' (known: LlamaForCausalLM, Qwen3ForCausalLM, "
                                       "Qwen3MoeForCausalLM, DeepseekV3ForCausalLM)",
                                       name));
  // dtype: "torch_dtype" (older transformers) or "dtype".
  const char* dkey = r.find("torch_dtype") ? "torch_dtype" : "dtype";
  const auto* dt = r.find(dkey);
  if (!dt) r.bad("torch_dtype", "missing (expected \"bfloat16\", \"float16\" or \"float32\")");
  if (!dt->is_string()) r.bad(dkey, fmt::format("expected a string, got {}", dt->dump()));
  const auto ds = dt->get<std::string>();
  if (ds == "bfloat16") c.dtype = DType::bf16;
  else if (ds == "float16") c.dtype = DType::f16;
  else if (ds == "float32") c.dtype = DType::f32;
  else r.bad(dkey, fmt::format("unsupported dtype '{}' (expected bfloat16, float16 or float32)", ds));
  // An FP8 checkpoint's config (DeepSeek-V3, Kimi-K2, Qwen3-FP8): the
  // inference side serves block FP8; training keeps torch_dtype (docs/fp8.md).
  if (const auto* q = r.find("quantization_config")) {
    auto qbad = [&](const char* key, const std::string& what) {
      throw LayoutError(ErrorContext{origin, "", fmt::format("quantization_config.{}", key)}, what);
    };
    if (!q->is_object()) r.bad("quantization_config", fmt::format("expected an object, got {}", q->dump()));
    const auto m = q->find("quant_method");
    if (m == q->end() || !m->is_string() || m->get<std::string>() != "fp8")
      qbad("quant_method", fmt::format("only \"fp8\" is modelled, got {}", m == q->end() ? "nothing" : m->dump()));
    if (const auto f = q->find("fmt"); f != q->end() && (!f->is_string() || f->get<std::string>() != "e4m3"))
      qbad("fmt", fmt::format("only \"e4m3\" is modelled, got {}", f->dump()));
    const auto b = q->find("weight_block_size");
    if (b == q->end() || !b->is_array() || b->size() != 2 || !(*b)[0].is_number_integer() || !(*b)[1].is_number_integer() ||
        (*b)[0].get<std::int64_t>() < 1 || (*b)[1].get<std::int64_t>() < 1)
      qbad("weight_block_size", fmt::format("expected two positive integers like [128, 128] (per-tensor FP8 is not modelled), got {}",
                                            b == q->end() ? "nothing" : b->dump()));
    c.fp8_block = {(*b)[0].get<std::int64_t>(), (*b)[1].get<std::int64_t>()};
  }

  c.hidden = r.required("hidden_size");
  c.layers = r.required("num_hidden_layers");
  c.heads = r.required("num_attention_heads");
  c.vocab = r.required("vocab_size");
  c.tied = r.flag("tie_word_embeddings", false);
  if (r.flag("attention_bias", false)) r.bad("attention_bias", "attention biases are not modelled");
  if (r.flag("mlp_bias", false)) r.bad("mlp_bias", "MLP biases are not modelled");

  if (c.arch == Architecture::deepseek_v3) {
    c.mla = true;
    c.intermediate = r.required("intermediate_size");
    c.kv_heads = r.optional("num_key_value_heads", c.heads);
    c.q_lora_rank = r.optional("q_lora_rank", 0);  // null: no q compression
    c.kv_lora_rank = r.required("kv_lora_rank");
    c.qk_nope_dim = r.required("qk_nope_head_dim");
    c.qk_rope_dim = r.required("qk_rope_head_dim");
    c.v_head_dim = r.required("v_head_dim");
    c.experts = r.optional("n_routed_experts", 0);
    if (c.experts > 0) {
      c.moe_intermediate = r.required("moe_intermediate_size");
      c.shared_experts = r.optional("n_shared_experts", 0);
      c.first_dense = r.optional("first_k_dense_replace", 0);
      c.moe_freq = r.optional("moe_layer_freq", 1);
      if (c.moe_freq == 0) r.bad("moe_layer_freq", "must be positive");
    }
    c.mtp_layers = r.optional("num_nextn_predict_layers", 0);
    if (c.mtp_layers > 0 && c.experts == 0)
      r.bad("num_nextn_predict_layers", "MTP layers are modelled for MoE configs only");
    return c;
  }
  c.intermediate = r.required("intermediate_size");
  c.kv_heads = r.optional("num_key_value_heads", c.heads);
  if (c.kv_heads == 0) r.bad("num_key_value_heads", "must be positive");
  if (c.heads % c.kv_heads != 0)
    r.bad("num_key_value_heads",
          fmt::format("{} does not divide num_attention_heads = {}", c.kv_heads, c.heads));
  if (c.hidden % c.heads != 0 && !r.find("head_dim"))
    r.bad("head_dim", fmt::format("missing, and hidden_size {} is not a multiple of num_attention_heads {}",
                                  c.hidden, c.heads));
  c.head_dim = r.optional("head_dim", c.hidden / c.heads);
  if (c.head_dim == 0) r.bad("head_dim", "must be positive");
  c.qk_norm = c.arch != Architecture::llama;
  if (c.arch == Architecture::qwen3_moe) {
    // transformers 5 saves Qwen3-MoE configs with num_local_experts in place of num_experts.
    c.experts = r.find("num_experts") || !r.find("num_local_experts") ? r.required("num_experts")
                                                                       : r.required("num_local_experts");
    c.moe_intermediate = r.required("moe_intermediate_size");
    c.sparse_step = r.optional("decoder_sparse_step", 1);
    if (c.sparse_step == 0) r.bad("decoder_sparse_step", "must be positive");
    if (const auto* m = r.find("mlp_only_layers")) {
      if (!m->is_array()) r.bad("mlp_only_layers", fmt::format("expected a list of layers, got {}", m->dump()));
      for (const auto& x : *m) {
        if (!x.is_number_integer() || x.get<std::int64_t>() < 0)
          r.bad("mlp_only_layers", fmt::format("expected layer numbers, got {}", x.dump()));
        c.mlp_only_layers.push_back(x.get<std::int64_t>());
      }
    }
  }
  return c;
}

/// Reads a config.json file.
inline ModelConfig read_model_config(const std::string& path) {
  return parse_model_config(parse_json_text(detail::read_text_file(path), path), path);
}

/// Every checkpoint tensor of the model; with `group_experts`, each MoE
/// layer's routed experts become three stacks (gate, up, down) instead of
/// 3*E tensors: the same elements, 256x fewer tensors for DeepSeek-V3, which
/// is what keeps whole-model planning fast.
inline Manifest model_manifest(const ModelConfig& c, bool group_experts = false) {
  Manifest m;
  m.config = c;
  m.grouped = group_experts;
  const std::int64_t H = c.hidden;
  m.add("model.embed_tokens.weight", {c.vocab, H}, Role::embedding);
  auto add_attention = [&](const std::string& p, std::int64_t l) {
    m.add(p + "input_layernorm.weight", {H}, Role::input_norm, l);
    if (c.mla) {
      const std::int64_t qk = c.qk_head_dim();
      if (c.q_lora_rank > 0) {
        m.add(p + "self_attn.q_a_proj.weight", {c.q_lora_rank, H}, Role::q_a, l);
        m.add(p + "self_attn.q_a_layernorm.weight", {c.q_lora_rank}, Role::q_a_norm, l);
        m.add(p + "self_attn.q_b_proj.weight", {c.heads * qk, c.q_lora_rank}, Role::q_b, l);
      } else {
        m.add(p + "self_attn.q_proj.weight", {c.heads * qk, H}, Role::q, l);
      }
      m.add(p + "self_attn.kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_dim, H}, Role::kv_a, l);
      m.add(p + "self_attn.kv_a_layernorm.weight", {c.kv_lora_rank}, Role::kv_a_norm, l);
      m.add(p + "self_attn.kv_b_proj.weight", {c.heads * (c.qk_nope_dim + c.v_head_dim), c.kv_lora_rank},
            Role::kv_b, l);
      m.add(p + "self_attn.o_proj.weight", {H, c.heads * c.v_head_dim}, Role::o, l);
    } else {
      m.add(p + "self_attn.q_proj.weight", {c.heads * c.head_dim, H}, Role::q, l);
      m.add(p + "self_attn.k_proj.weight", {c.kv_heads * c.head_dim, H}, Role::k, l);
      m.add(p + "self_attn.v_proj.weight", {c.kv_heads * c.head_dim, H}, Role::v, l);
      m.add(p + "self_attn.o_proj.weight", {H, c.heads * c.head_dim}, Role::o, l);
      if (c.qk_norm) {
        m.add(p + "self_attn.q_norm.weight", {c.head_dim}, Role::q_norm, l);
        m.add(p + "self_attn.k_norm.weight", {c.head_dim}, Role::k_norm, l);
      }
    }
    m.add(p + "post_attention_layernorm.weight", {H}, Role::post_attn_norm, l);
  };
  auto add_mlp = [&](const std::string& p, std::int64_t l) {
    if (!c.is_moe_layer(l)) {
      m.add(p + "mlp.gate_proj.weight", {c.intermediate, H}, Role::gate, l);
      m.add(p + "mlp.up_proj.weight", {c.intermediate, H}, Role::up, l);
      m.add(p + "mlp.down_proj.weight", {H, c.intermediate}, Role::down, l);
      return;
    }
    m.add(p + "mlp.gate.weight", {c.experts, H}, Role::router, l);
    if (c.arch == Architecture::deepseek_v3)
      m.add(p + "mlp.gate.e_score_correction_bias", {c.experts}, Role::router_bias, l, -1, DType::f32);
    const std::int64_t I = c.moe_intermediate;
    if (group_experts) {
      const std::string q = fmt::format("{}mlp.experts.{{0..{}}}.", p, c.experts - 1);
      m.add(q + "gate_proj.weight", {c.experts, I, H}, Role::expert_gate, l, -1, std::nullopt, c.experts);
      m.add(q + "up_proj.weight", {c.experts, I, H}, Role::expert_up, l, -1, std::nullopt, c.experts);
      m.add(q + "down_proj.weight", {c.experts, H, I}, Role::expert_down, l, -1, std::nullopt, c.experts);
    }
    for (std::int64_t e = 0; e < c.experts && !group_experts; ++e) {
      const std::string q = fmt::format("{}mlp.experts.{}.", p, e);
      m.add(q + "gate_proj.weight", {I, H}, Role::expert_gate, l, e);
      m.add(q + "up_proj.weight", {I, H}, Role::expert_up, l, e);
      m.add(q + "down_proj.weight", {H, I}, Role::expert_down, l, e);
    }
    if (c.shared_experts > 0) {
      const std::int64_t S = c.shared_intermediate();
      m.add(p + "mlp.shared_experts.gate_proj.weight", {S, H}, Role::shared_gate, l);
      m.add(p + "mlp.shared_experts.up_proj.weight", {S, H}, Role::shared_up, l);
      m.add(p + "mlp.shared_experts.down_proj.weight", {H, S}, Role::shared_down, l);
    }
  };
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    add_attention(p, l);
    add_mlp(p, l);
  }
  m.add("model.norm.weight", {H}, Role::final_norm);
  if (!c.tied) m.add("lm_head.weight", {c.vocab, H}, Role::lm_head);
  for (std::int64_t i = 0; i < c.mtp_layers; ++i) {
    const std::int64_t l = c.layers + i;
    const std::string p = fmt::format("model.layers.{}.", l);
    m.add(p + "embed_tokens.weight", {c.vocab, H}, Role::mtp_embedding, l);
    m.add(p + "enorm.weight", {H}, Role::mtp_enorm, l);
    m.add(p + "hnorm.weight", {H}, Role::mtp_hnorm, l);
    m.add(p + "eh_proj.weight", {H, 2 * H}, Role::mtp_eh_proj, l);
    add_attention(p, l);
    add_mlp(p, l);
    m.add(p + "shared_head.norm.weight", {H}, Role::mtp_head_norm, l);
    m.add(p + "shared_head.head.weight", {c.vocab, H}, Role::mtp_head, l);
  }
  return m;
}

inline Manifest model_manifest(const std::string& config_path, bool group_experts = false) {
  return model_manifest(read_model_config(config_path), group_experts);
}

}  // namespace reshard::presets
