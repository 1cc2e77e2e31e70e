// Whole-model presets: manifests from config.json, Megatron training layouts
// and vLLM inference layouts. The layouts' semantics are checked against
// formulas written here from the frameworks' rules (not from the preset
// code), through the oracle's slot view of local memory (tests/oracle.hpp,
// which does not use the library's storage code); tiny models are then
// planned end to end and every schedule is checked by the oracle.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "oracle.hpp"
#include "reshard/plan/plan.hpp"
#include "reshard/presets/presets.hpp"

using namespace reshard;
using namespace reshard::presets;

namespace {

std::string model(const std::string& name) { return std::string(RESHARD_TEST_MODELS) + "/" + name + ".json"; }

ParallelSpec spec(const std::string& s) { return parse_parallel_spec(s, "test spec"); }

Layout train_layout(const std::string& name, const std::string& s, bool grouped = true) {
  return megatron_layout(model_manifest(model(name), grouped), spec(s));
}
Layout infer_layout(const std::string& name, const std::string& s, bool grouped = true, std::int64_t first = 0,
                    ExpertPlacement placement = ExpertPlacement::linear) {
  VllmOptions o;
  o.placement = placement;
  return vllm_layout(model_manifest(model(name), grouped), spec(s), first, o);
}

/// The message of the reshard::Error `f` throws ("" if none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// One rank's local memory as the oracle sees it.
struct RankMemory {
  const Layout& L;
  oracle::RankSlots slots;
  RankMemory(const Layout& l, std::int64_t global_rank)
      : L(l), slots(oracle::local_slots(l, global_rank - l.mesh.first_rank)) {}

  bool has(const std::string& buffer) const {
    const int b = L.find_buffer(buffer);
    REQUIRE_MESSAGE(b >= 0, "no buffer ", buffer);
    return slots.present[static_cast<std::size_t>(b)];
  }
  std::int64_t size(const std::string& buffer) const {
    const int b = L.find_buffer(buffer);
    REQUIRE(b >= 0);
    return static_cast<std::int64_t>(slots.buffers[static_cast<std::size_t>(b)].size());
  }
  /// What slot `i` of a buffer holds: the tensor's name and global index
  /// tuple, or "<padding>".
  std::pair<std::string, std::vector<std::int64_t>> at(const std::string& buffer, std::int64_t i) const {
    const int b = L.find_buffer(buffer);
    REQUIRE(b >= 0);
    const auto& v = slots.buffers[static_cast<std::size_t>(b)];
    REQUIRE(i < static_cast<std::int64_t>(v.size()));
    const auto& s = v[static_cast<std::size_t>(i)];
    if (s.padding()) return {"<padding>", {}};
    const auto& ts = L.tensors[static_cast<std::size_t>(s.tensor)];
    return {ts.name, oracle::unravel(ts, s.index)};
  }
  /// Checks that local row `l` of a 2-D buffer with rows of `cols` elements
  /// holds row `row` of tensor `name` (first and last column).
  void expect_row(const std::string& buffer, std::int64_t l, std::int64_t cols, const std::string& name,
                  std::int64_t row) const {
    const auto first = at(buffer, l * cols), last = at(buffer, l * cols + cols - 1);
    INFO("buffer ", buffer, " local row ", l);
    REQUIRE(first.first == name);
    REQUIRE(first.second == std::vector<std::int64_t>{row, 0});
    REQUIRE(last.first == name);
    REQUIRE(last.second == std::vector<std::int64_t>{row, cols - 1});
  }
};

/// Plans src -> dst and checks the schedule with the oracle; also checks a
/// few single-rank plans against the oracle's one-rank check.
void plan_and_check(const Layout& src, const Layout& dst, std::vector<std::int64_t> ranks = {}) {
  const Schedule s = plan(src, dst);
  const auto r = oracle::check_schedule(src, dst, s);
  INFO("fault: ", r.fault);
  REQUIRE(r.ok);
  CHECK(r.dst_elements > 0);
  for (auto rank : ranks) {
    PlanOptions po;
    po.only_rank = rank;
    const Schedule one = plan(src, dst, po);
    oracle::CheckOptions co;
    co.only_rank = rank;
    const auto r1 = oracle::check_schedule(src, dst, one, co);
    INFO("rank ", rank, " fault: ", r1.fault);
    REQUIRE(r1.ok);
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Parallel specs

TEST_CASE("parallel specs parse and reject bad input clearly") {
  const auto s = spec("tp=2,pp=4,dp=2,ep=8,etp=1,cp=1");
  CHECK(s.tp == 2);
  CHECK(s.pp == 4);
  CHECK(s.dp == 2);
  CHECK(s.ep == 8);
  CHECK(s.etp == 1);
  CHECK(s.cp == 1);
  CHECK(!s.pp_first);
  const auto t = spec(" tp = 8 , dp=16 ");
  CHECK(t.tp == 8);
  CHECK(t.dp == 16);
  CHECK(t.pp == 1);
  CHECK(!t.etp);
  CHECK(spec("pp=4,pp_first=14,pp_last=15").pp_first == 14);

  CHECK(contains(error_of([] { spec("tp=2,foo=1"); }), "unknown key 'foo'"));
  CHECK(contains(error_of([] { spec("tp=0"); }), "tp=0 is not positive"));
  CHECK(contains(error_of([] { spec("tp=-2"); }), "not positive"));
  CHECK(contains(error_of([] { spec("tp=2,tp=4"); }), "key 'tp' is given twice"));
  CHECK(contains(error_of([] { spec("tp"); }), "is not key=value"));
  CHECK(contains(error_of([] { spec("tp=2,"); }), "empty item"));
  CHECK(contains(error_of([] { spec("tp=two"); }), "not a positive integer"));
  CHECK(contains(error_of([] { spec("tp=99999999999"); }), "tp"));
  CHECK(contains(error_of([] { spec(""); }), "empty"));
  CHECK(contains(error_of([] { parse_parallel_spec("dp=0", "infer spec"); }), "infer spec 'dp=0'"));
}

// ---------------------------------------------------------------------------
// Manifests

namespace {
struct Count {
  std::size_t tensors;
  std::int64_t params;
};
Count count(const std::string& name, bool grouped = false) {
  const auto m = model_manifest(model(name), grouped);
  return {m.tensors.size(), m.parameters()};
}
}  // namespace

TEST_CASE("manifests of the real configs match hand-computed counts") {
  // Llama-3.1-8B: V=128256, H=4096, L=32, 32 heads / 8 kv heads of 128, I=14336.
  {
    const std::int64_t V = 128256, H = 4096, L = 32, I = 14336, q = 32 * 128, kv = 8 * 128;
    const std::int64_t layer = H * q + 2 * H * kv + q * H + 3 * H * I + 2 * H;
    const std::int64_t total = 2 * V * H + H + L * layer;
    CHECK(total == 8030261248);  // the published 8.03B
    const auto c = count("llama-3.1-8b");
    CHECK(c.params == total);
    CHECK(c.tensors == 3 + 32 * 9);
  }
  // Qwen3-32B: V=151936, H=5120, L=64, 64 heads / 8 kv of 128, I=25600, q/k norms.
  {
    const std::int64_t V = 151936, H = 5120, L = 64, I = 25600, q = 64 * 128, kv = 8 * 128;
    const std::int64_t layer = H * q + 2 * H * kv + q * H + 2 * 128 + 3 * H * I + 2 * H;
    const std::int64_t total = 2 * V * H + H + L * layer;
    CHECK(total == 32762123264);
    const auto c = count("qwen3-32b");
    CHECK(c.params == total);
    CHECK(c.tensors == 3 + 64 * 11);
  }
  // Qwen3-30B-A3B: 48 MoE layers of 128 experts (I=768), router [128, 2048].
  {
    const std::int64_t V = 151936, H = 2048, L = 48, E = 128, I = 768, q = 32 * 128, kv = 4 * 128;
    const std::int64_t layer = H * q + 2 * H * kv + q * H + 2 * 128 + E * H + E * 3 * H * I + 2 * H;
    const std::int64_t total = 2 * V * H + H + L * layer;
    CHECK(total == 30532122624);
    const auto c = count("qwen3-30b-a3b");
    CHECK(c.params == total);
    CHECK(c.tensors == 3 + 48 * (8 + 1 + 3 * 128));
    const auto g = count("qwen3-30b-a3b", true);
    CHECK(g.params == total);
    CHECK(g.tensors == 3 + 48 * (8 + 1 + 3));
  }
  // DeepSeek-V3: MLA, 3 dense + 58 MoE layers (256 routed + 1 shared expert),
  // one MTP layer: 671.0B in the main model, 684.5B with MTP.
  {
    const std::int64_t V = 129280, H = 7168, nh = 128, ql = 1536, kl = 512, nope = 128, rope = 64, vd = 128;
    const std::int64_t attn = ql * H + ql + nh * (nope + rope) * ql + (kl + rope) * H + kl + nh * (nope + vd) * kl +
                              H * nh * vd + 2 * H;
    const std::int64_t dense = 3 * H * 18432;
    const std::int64_t moe = 256 * H + 256 + 256 * 3 * H * 2048 + 3 * H * 2048;
    const std::int64_t main = 2 * V * H + H + 3 * (attn + dense) + 58 * (attn + moe);
    CHECK(main == 671026419200);
    const std::int64_t mtp = (attn + moe) + 2 * H + H * 2 * H + H + 2 * V * H;
    const auto c = count("deepseek-v3");
    CHECK(c.params == main + mtp);
    CHECK(c.tensors == 3 + 3 * 12 + 58 * (9 + 2 + 768 + 3) + (9 + 2 + 768 + 3 + 6));
    const auto m = model_manifest(model("deepseek-v3"));
    auto find = [&](const std::string& n) -> const TensorInfo& {
      auto it = std::find_if(m.tensors.begin(), m.tensors.end(), [&](const TensorInfo& t) { return t.name == n; });
      REQUIRE_MESSAGE(it != m.tensors.end(), n);
      return *it;
    };
    CHECK(find("model.layers.0.self_attn.q_b_proj.weight").shape == std::vector<std::int64_t>{24576, 1536});
    CHECK(find("model.layers.0.self_attn.kv_a_proj_with_mqa.weight").shape == std::vector<std::int64_t>{576, 7168});
    CHECK(find("model.layers.0.self_attn.kv_b_proj.weight").shape == std::vector<std::int64_t>{32768, 512});
    CHECK(find("model.layers.0.self_attn.o_proj.weight").shape == std::vector<std::int64_t>{7168, 16384});
    CHECK(find("model.layers.2.mlp.gate_proj.weight").shape == std::vector<std::int64_t>{18432, 7168});
    CHECK(find("model.layers.3.mlp.gate.weight").shape == std::vector<std::int64_t>{256, 7168});
    CHECK(find("model.layers.3.mlp.gate.e_score_correction_bias").dtype == DType::f32);
    CHECK(find("model.layers.60.mlp.experts.255.down_proj.weight").shape == std::vector<std::int64_t>{7168, 2048});
    CHECK(find("model.layers.3.mlp.shared_experts.up_proj.weight").shape == std::vector<std::int64_t>{2048, 7168});
    CHECK(find("model.layers.61.eh_proj.weight").shape == std::vector<std::int64_t>{7168, 14336});
    CHECK(find("model.layers.61.shared_head.head.weight").shape == std::vector<std::int64_t>{129280, 7168});
    CHECK(find("lm_head.weight").dtype == DType::bf16);
    const auto g = model_manifest(model("deepseek-v3"), true);
    CHECK(g.parameters() == main + mtp);
    CHECK(g.tensors.size() == c.tensors - 59 * 765);
    const auto& stack = g.tensors[static_cast<std::size_t>(g.experts(3, Role::expert_gate)[0])];
    CHECK(stack.name == "model.layers.3.mlp.experts.{0..255}.gate_proj.weight");
    CHECK(stack.shape == std::vector<std::int64_t>{256, 2048, 7168});
    const auto names = checkpoint_names(stack);
    REQUIRE(names.size() == 256);
    CHECK(names[0] == "model.layers.3.mlp.experts.0.gate_proj.weight");
    CHECK(names[255] == "model.layers.3.mlp.experts.255.gate_proj.weight");
    CHECK(find(names[17]).shape == std::vector<std::int64_t>{2048, 7168});
  }
}

TEST_CASE("manifests of the tiny configs: tied embeddings, sparse steps, MTP without q_lora") {
  const auto q = model_manifest(model("tiny-qwen3"));
  CHECK(q.config.tied);
  CHECK(q.global(Role::lm_head) == -1);
  CHECK(q.tensors.size() == 2 + 3 * 11);
  CHECK(q.tensors[static_cast<std::size_t>(q.at(0, Role::q))].shape == std::vector<std::int64_t>{4 * 48, 128});
  CHECK(q.tensors[static_cast<std::size_t>(q.at(0, Role::q_norm))].shape == std::vector<std::int64_t>{48});

  // decoder_sparse_step 2 with mlp_only_layers [3]: only layer 1 is MoE.
  const auto m = model_manifest(model("tiny-qwen3-moe"));
  CHECK(!m.config.is_moe_layer(0));
  CHECK(m.config.is_moe_layer(1));
  CHECK(!m.config.is_moe_layer(2));
  CHECK(!m.config.is_moe_layer(3));
  CHECK(m.at(1, Role::router) >= 0);
  CHECK(m.at(1, Role::router_bias) == -1);  // Qwen3-MoE has no score bias
  CHECK(m.experts(1, Role::expert_down).size() == 8);
  CHECK(m.at(3, Role::gate) >= 0);

  const auto d = model_manifest(model("tiny-mla-mtp"));
  CHECK(d.at(0, Role::q) >= 0);  // q_lora_rank null: q_proj
  CHECK(d.at(0, Role::q_a) == -1);
  CHECK(d.tensors[static_cast<std::size_t>(d.at(0, Role::q))].shape == std::vector<std::int64_t>{4 * 24, 128});
  CHECK(d.at(3, Role::mtp_eh_proj) >= 0);
  CHECK(d.tensors[static_cast<std::size_t>(d.at(3, Role::mtp_embedding))].name == "model.layers.3.embed_tokens.weight");
  CHECK(d.tensors[static_cast<std::size_t>(d.at(3, Role::shared_down))].shape == std::vector<std::int64_t>{128, 64});
}

TEST_CASE("a Qwen3-MoE config saved by transformers 5 names its experts num_local_experts") {
  nlohmann::json j = nlohmann::json::parse(reshard::presets::detail::read_text_file(model("tiny-qwen3-moe")));
  const std::int64_t experts = j.at("num_experts").get<std::int64_t>();
  j.erase("num_experts");
  j["num_local_experts"] = experts;
  CHECK(parse_model_config(j, "cfg/tf5.json").experts == experts);
  j.erase("num_local_experts");
  CHECK(contains(error_of([&] { parse_model_config(j, "cfg/tf5.json"); }), "num_experts: missing"));
}

TEST_CASE("bad configs name the file and the field") {
  const nlohmann::json base = nlohmann::json::parse(reshard::presets::detail::read_text_file(model("tiny-llama")));
  auto with = [&](auto&& edit) {
    nlohmann::json j = base;
    edit(j);
    return error_of([&] { parse_model_config(j, "cfg/bad.json"); });
  };
  auto e = with([](nlohmann::json& j) { j["architectures"] = {"GPT2LMHeadModel"}; });
  CHECK(contains(e, "cfg/bad.json"));
  CHECK(contains(e, "architectures"));
  CHECK(contains(e, "unknown architecture 'GPT2LMHeadModel'"));
  e = with([](nlohmann::json& j) { j.erase("hidden_size"); });
  CHECK(contains(e, "cfg/bad.json: hidden_size: missing"));
  e = with([](nlohmann::json& j) { j["num_attention_heads"] = "8"; });
  CHECK(contains(e, "num_attention_heads: expected an integer"));
  e = with([](nlohmann::json& j) { j["num_key_value_heads"] = 3; });
  CHECK(contains(e, "num_key_value_heads: 3 does not divide"));
  e = with([](nlohmann::json& j) { j.erase("torch_dtype"); });
  CHECK(contains(e, "torch_dtype: missing"));
  e = with([](nlohmann::json& j) { j["attention_bias"] = true; });
  CHECK(contains(e, "attention_bias"));
  CHECK(contains(error_of([] { read_model_config("/nonexistent/config.json"); }), "/nonexistent/config.json"));
}

// ---------------------------------------------------------------------------
// Megatron-Core training layouts

TEST_CASE("megatron linear_qkv rows follow the per-query-group formula") {
  // tiny-llama: 8 heads, 2 kv heads (query groups), head_dim 32, H 256.
  const std::int64_t nh = 8, ng = 2, hd = 32, H = 256;
  const std::int64_t Qg = nh / ng * hd, group = Qg + 2 * hd, rows = (nh + 2 * ng) * hd;
  for (std::int64_t tp : {1, 2, 4, 8}) {  // ng % tp == 0 for 1, 2; tp % ng == 0 for 4, 8
    const auto L = train_layout("tiny-llama", fmt::format("tp={}", tp));
    for (std::int64_t t = 0; t < tp; ++t) {
      RankMemory mem(L, t);
      const std::string buf = "decoder.layers.1.self_attention.linear_qkv.weight";
      REQUIRE(mem.size(buf) == rows / tp * H);
      for (std::int64_t l = 0; l < rows / tp; ++l) {
        // Row f of the fused weight: group f / group, then [q heads ; k ; v].
        const std::int64_t f = t * (rows / tp) + l, g = f / group, w = f % group;
        INFO("tp=", tp, " rank ", t);
        if (w < Qg) mem.expect_row(buf, l, H, "model.layers.1.self_attn.q_proj.weight", g * Qg + w);
        else if (w < Qg + hd) mem.expect_row(buf, l, H, "model.layers.1.self_attn.k_proj.weight", g * hd + w - Qg);
        else mem.expect_row(buf, l, H, "model.layers.1.self_attn.v_proj.weight", g * hd + w - Qg - hd);
      }
    }
  }
}

TEST_CASE("megatron ranks are ordered pp, dp, cp, tp with fc1 = [gate_t ; up_t] and row-parallel o/down, named as GPTModel") {
  const std::int64_t H = 256, I = 704;
  const auto L = train_layout("tiny-llama", "tp=2,pp=2,dp=2,cp=2");
  CHECK(L.mesh.size() == 16);
  CHECK(L.mesh.axes[0].name == "pp");
  CHECK(L.mesh.axes[3].name == "tp");
  for (std::int64_t r = 0; r < 16; ++r) {
    const std::int64_t pp = r / 8, tp = r % 2;  // dp = (r / 4) % 2, cp = (r / 2) % 2: replicas
    RankMemory mem(L, r);
    // GPTModel numbers layers per stage: every stage has decoder.layers.0 and .1.
    CHECK(L.find_buffer("decoder.layers.2.mlp.linear_fc1.weight") < 0);
    for (std::int64_t layer = 0; layer < 4; ++layer) {
      const bool mine = layer / 2 == pp;  // 4 layers over 2 stages: 2 each
      if (!mine) continue;
      const std::string p = fmt::format("decoder.layers.{}.", layer % 2);
      const std::string fc1 = p + "mlp.linear_fc1.weight";
      REQUIRE(mem.has(fc1));
      const std::int64_t It = I / 2;
      for (std::int64_t l : {std::int64_t{0}, It - 1, It, 2 * It - 1}) {
        if (l < It) mem.expect_row(fc1, l, H, fmt::format("model.layers.{}.mlp.gate_proj.weight", layer), tp * It + l);
        else mem.expect_row(fc1, l, H, fmt::format("model.layers.{}.mlp.up_proj.weight", layer), tp * It + l - It);
      }
      // Row-parallel: o_proj holds columns [tp*128, tp*128 + 128) of every row.
      const std::string o = p + "self_attention.linear_proj.weight";
      REQUIRE(mem.size(o) == H * 128);
      CHECK(mem.at(o, 0).first == fmt::format("model.layers.{}.self_attn.o_proj.weight", layer));
      CHECK(mem.at(o, 0).second == std::vector<std::int64_t>{0, tp * 128});
      CHECK(mem.at(o, 128 * 3 + 5).second == std::vector<std::int64_t>{3, tp * 128 + 5});
      const std::string down = p + "mlp.linear_fc2.weight";
      CHECK(mem.at(down, 352 + 1).first == fmt::format("model.layers.{}.mlp.down_proj.weight", layer));
      CHECK(mem.at(down, 352 + 1).second == std::vector<std::int64_t>{1, tp * 352 + 1});
      CHECK(mem.size(p + "input_layernorm.weight") == H);  // replicated
      CHECK(mem.at(p + "pre_mlp_layernorm.weight", 7).first ==
            fmt::format("model.layers.{}.post_attention_layernorm.weight", layer));
    }
    CHECK(mem.has("embedding.word_embeddings.weight") == (pp == 0));
    CHECK(mem.has("output_layer.weight") == (pp == 1));
    CHECK(mem.has("decoder.final_layernorm.weight") == (pp == 1));
    CHECK(L.find_buffer("model.embed_tokens.weight") < 0);
  }
}

TEST_CASE("megatron vocabulary is padded to 128*tp and the padding sits on the last ranks") {
  CHECK(megatron_padded_vocab(151936, 2) == 152064);
  CHECK(megatron_padded_vocab(151936, 16) == 153600);
  CHECK(megatron_padded_vocab(129280, 1) == 129280);
  // tiny-llama: V = 1000 -> 1024 at tp=2 (multiple of 256), 512 rows per rank.
  const auto L = train_layout("tiny-llama", "tp=2");
  RankMemory r0(L, 0), r1(L, 1);
  const std::string e = "embedding.word_embeddings.weight", t = "model.embed_tokens.weight";
  REQUIRE(r1.size(e) == 512 * 256);
  r0.expect_row(e, 511, 256, t, 511);
  r1.expect_row(e, 0, 256, t, 512);
  r1.expect_row(e, 487, 256, t, 999);
  CHECK(r1.at(e, 488 * 256).first == "<padding>");
  CHECK(r1.at(e, 512 * 256 - 1).first == "<padding>");
  RankMemory h1(L, 1);
  CHECK(h1.at("output_layer.weight", 500 * 256).first == "<padding>");
}

TEST_CASE("megatron pipeline splits: even, Megatron's explicit first/last, and the uneven default") {
  CHECK(megatron_stage_layers(64, 4) == std::vector<std::int64_t>{16, 16, 16, 16});
  CHECK(megatron_stage_layers(61, 4) == std::vector<std::int64_t>{14, 16, 16, 15});
  CHECK(megatron_stage_layers(61, 8) == std::vector<std::int64_t>{6, 8, 8, 8, 8, 8, 8, 7});
  CHECK(megatron_stage_layers(61, 2) == std::vector<std::int64_t>{30, 31});
  CHECK(megatron_stage_layers(5, 4) == std::vector<std::int64_t>{1, 1, 1, 2});
  CHECK(megatron_stage_layers(61, 4, 13, std::nullopt) == std::vector<std::int64_t>{13, 16, 16, 16});
  CHECK(megatron_stage_layers(61, 8, 12, 1) == std::vector<std::int64_t>{12, 8, 8, 8, 8, 8, 8, 1});
  CHECK(megatron_stage_layers(61, 2, 20, 41) == std::vector<std::int64_t>{20, 41});
  CHECK(contains(error_of([] { megatron_stage_layers(61, 4, 14, std::nullopt); }), "do not divide evenly"));
  CHECK(contains(error_of([] { megatron_stage_layers(3, 4); }), "cannot fill"));
  for (std::int64_t pp : {3, 4, 5, 6, 7, 8, 16})
    for (std::int64_t layers : {61, 62, 17, 35}) {
      if (layers < pp) continue;
      const auto c = megatron_stage_layers(layers, pp);
      std::int64_t sum = 0;
      for (auto x : c) sum += x;
      CHECK(sum == layers);
      for (std::size_t s = 1; s + 1 < c.size(); ++s) CHECK(c[s] == c[1]);  // Megatron: middle stages even
      CHECK(c.front() >= 1);
    }
}

namespace {
/// A config with L layers and tiny dims, to place 61 layers on stages.
std::string deep_config(std::int64_t layers) {
  nlohmann::json j = nlohmann::json::parse(reshard::presets::detail::read_text_file(model("tiny-llama")));
  j["num_hidden_layers"] = layers;
  j["hidden_size"] = 16;
  j["intermediate_size"] = 32;
  j["num_attention_heads"] = 2;
  j["num_key_value_heads"] = 1;
  j["head_dim"] = 8;
  j["vocab_size"] = 100;
  return j.dump();
}
Manifest deep_manifest(std::int64_t layers) {
  return model_manifest(parse_model_config(nlohmann::json::parse(deep_config(layers)), "deep.json"));
}
std::int64_t stage_of(const Layout& L, const std::string& tensor) {
  const int t = L.find_tensor(tensor);
  REQUIRE(t >= 0);
  const auto& st = L.tensors[static_cast<std::size_t>(t)].stage;
  REQUIRE(st.size() == 1);
  REQUIRE(L.mesh.axes[static_cast<std::size_t>(st[0].axis)].name == "pp");
  return st[0].coord;
}
}  // namespace

TEST_CASE("61 layers over 4 and 8 stages: every layer on its stage, on both sides") {
  const auto m = deep_manifest(61);
  for (std::int64_t pp : {4, 8}) {
    const auto T = megatron_layout(m, spec(fmt::format("pp={}", pp)));
    const auto V = vllm_layout(m, spec(fmt::format("pp={}", pp)), 0);
    // Expected stages, counted here: Megatron ends lighter, vLLM's remainder before the last stage.
    const std::vector<std::int64_t> mc = pp == 4 ? std::vector<std::int64_t>{14, 16, 16, 15}
                                                 : std::vector<std::int64_t>{6, 8, 8, 8, 8, 8, 8, 7};
    const std::vector<std::int64_t> vc = pp == 4 ? std::vector<std::int64_t>{15, 15, 16, 15}
                                                 : std::vector<std::int64_t>{7, 7, 8, 8, 8, 8, 8, 7};
    CHECK(vllm_stage_layers(61, pp) == vc);
    std::int64_t ms = 0, mleft = mc[0], vs = 0, vleft = vc[0];
    for (std::int64_t l = 0; l < 61; ++l) {
      while (mleft == 0) mleft = mc[static_cast<std::size_t>(++ms)];
      while (vleft == 0) vleft = vc[static_cast<std::size_t>(++vs)];
      for (const char* t : {"self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"}) {
        CHECK(stage_of(T, fmt::format("model.layers.{}.{}", l, t)) == ms);
        CHECK(stage_of(V, fmt::format("model.layers.{}.{}", l, t)) == vs);
      }
      --mleft;
      --vleft;
    }
    for (const auto* L : {&T, &V}) {
      CHECK(stage_of(*L, "model.embed_tokens.weight") == 0);
      CHECK(stage_of(*L, "model.norm.weight") == pp - 1);
      CHECK(stage_of(*L, "lm_head.weight") == pp - 1);
    }
  }
  // Refit 61 layers from 4 training stages to 8 inference stages (and the other way).
  const auto T4 = megatron_layout(m, spec("pp=4,dp=2"));
  const auto V8 = vllm_layout(m, spec("pp=8"), T4.mesh.size());
  plan_and_check(T4, V8, {0, 7, 8, 15});
  const auto T8 = megatron_layout(m, spec("pp=8,pp_first=12,pp_last=1,tp=2"));
  const auto V4 = vllm_layout(m, spec("pp=4,tp=2"), 0);
  plan_and_check(T8, V4, {0, 3, 15});
}

TEST_CASE("megatron experts: contiguous ranges over ep, etp cut, ep*etp*edp = tp*cp*dp as sub-axes") {
  // tiny-moe: 16 experts, moe_intermediate 128, H 256; layers 1..3 are MoE.
  const std::int64_t E = 16, I = 128, H = 256;
  struct Case {
    const char* spec;
    std::int64_t tp, cp, dp, ep, etp;
  };
  for (const Case& c : {Case{"tp=2,dp=4,ep=4,etp=2", 2, 1, 4, 4, 2}, Case{"tp=2,dp=4,ep=8,etp=1", 2, 1, 4, 8, 1},
                        Case{"tp=1,dp=8,ep=4", 1, 1, 8, 4, 1}, Case{"tp=2,cp=2,dp=2,ep=2,etp=1", 2, 2, 2, 2, 1},
                        Case{"tp=4,dp=2,ep=2", 4, 1, 2, 2, 4}}) {
    for (bool grouped : {true, false}) {
      const auto L = train_layout("tiny-moe", c.spec, grouped);
      const std::int64_t world = c.tp * c.cp * c.dp, per = E / c.ep, It = I / c.etp;
      for (std::int64_t r = 0; r < world; ++r) {
        // Megatron's expert ranks: etp fastest, then ep, then edp, over the
        // stage's ranks numbered (dp, cp, tp) with tp fastest.
        const std::int64_t etp_rank = r % c.etp, ep_rank = (r / c.etp) % c.ep;
        INFO(c.spec, grouped ? " grouped" : " per expert", " rank ", r);
        RankMemory mem(L, r);
        if (grouped) {
          const std::string fc1 = "decoder.layers.2.mlp.experts.linear_fc1.weight";
          REQUIRE(mem.size(fc1) == per * 2 * It * H);
          for (std::int64_t i = 0; i < per; ++i)
            for (std::int64_t j : {std::int64_t{0}, It - 1, It, 2 * It - 1}) {
              const auto got = mem.at(fc1, (i * 2 * It + j) * H + 3);
              const std::int64_t e = ep_rank * per + i;
              if (j < It) {
                CHECK(got.first == "model.layers.2.mlp.experts.{0..15}.gate_proj.weight");
                CHECK(got.second == std::vector<std::int64_t>{e, etp_rank * It + j, 3});
              } else {
                CHECK(got.first == "model.layers.2.mlp.experts.{0..15}.up_proj.weight");
                CHECK(got.second == std::vector<std::int64_t>{e, etp_rank * It + j - It, 3});
              }
            }
          const std::string fc2 = "decoder.layers.2.mlp.experts.linear_fc2.weight";
          REQUIRE(mem.size(fc2) == per * H * It);
          CHECK(mem.at(fc2, (1 * H + 7) * It + 2).second ==
                std::vector<std::int64_t>{ep_rank * per + 1, 7, etp_rank * It + 2});
        } else {
          // SequentialMLP: local_experts.{i} is expert ep_rank * per + i (local indices).
          CHECK(L.find_buffer(fmt::format("decoder.layers.2.mlp.experts.local_experts.{}.linear_fc1.weight", per)) < 0);
          for (std::int64_t i = 0; i < per; ++i) {
            const std::int64_t e = ep_rank * per + i;
            const std::string x = fmt::format("decoder.layers.2.mlp.experts.local_experts.{}.", i);
            REQUIRE(mem.size(x + "linear_fc1.weight") == 2 * It * H);
            mem.expect_row(x + "linear_fc1.weight", 0, H, fmt::format("model.layers.2.mlp.experts.{}.gate_proj.weight", e), etp_rank * It);
            mem.expect_row(x + "linear_fc1.weight", It, H, fmt::format("model.layers.2.mlp.experts.{}.up_proj.weight", e), etp_rank * It);
            const auto down = mem.at(x + "linear_fc2.weight", It + 1);
            CHECK(down.first == fmt::format("model.layers.2.mlp.experts.{}.down_proj.weight", e));
            CHECK(down.second == std::vector<std::int64_t>{1, etp_rank * It + 1});
          }
        }
        // The router and its bias are replicated; shared experts follow the dense tp.
        CHECK(mem.size("decoder.layers.2.mlp.router.weight") == E * H);
        CHECK(mem.size("decoder.layers.2.mlp.router.expert_bias") == E);
        mem.expect_row("decoder.layers.2.mlp.shared_experts.linear_fc1.weight", 0, H,
                       "model.layers.2.mlp.shared_experts.gate_proj.weight", (r % c.tp) * (I / c.tp));
      }
    }
  }
}

TEST_CASE("megatron MLA: down projections replicated, up projections column-parallel") {
  // tiny-moe: 8 heads, q_lora 96, kv_lora 64, nope 32, rope 16, v 32.
  const auto L = train_layout("tiny-moe", "tp=4,dp=2,ep=2");
  for (std::int64_t r : {0, 3, 6}) {
    RankMemory mem(L, r);
    const std::int64_t t = r % 4;
    const std::string p = "decoder.layers.0.self_attention.";
    CHECK(mem.size(p + "linear_q_down_proj.weight") == 96 * 256);
    CHECK(mem.size(p + "linear_kv_down_proj.weight") == 80 * 256);
    CHECK(mem.size(p + "q_layernorm.weight") == 96);
    CHECK(mem.size(p + "kv_layernorm.weight") == 64);
    mem.expect_row(p + "linear_q_up_proj.weight", 5, 96, "model.layers.0.self_attn.q_b_proj.weight", t * (8 * 48 / 4) + 5);
    mem.expect_row(p + "linear_kv_up_proj.weight", 5, 64, "model.layers.0.self_attn.kv_b_proj.weight", t * (8 * 64 / 4) + 5);
    CHECK(mem.at(p + "linear_proj.weight", 0).second == std::vector<std::int64_t>{0, t * 64});
  }
}

// ---------------------------------------------------------------------------
// vLLM inference layouts

TEST_CASE("vllm qkv_proj rows: [q_r ; k_r ; v_r] with kv heads replicated when tp > n_kv") {
  const std::int64_t nh = 8, ng = 2, hd = 32, H = 256;
  for (std::int64_t tp : {1, 2, 4, 8}) {
    const auto L = infer_layout("tiny-llama", fmt::format("tp={}", tp), true, 100);
    CHECK(L.mesh.first_rank == 100);
    const std::int64_t qr = nh / tp * hd;
    const std::int64_t kv_heads = std::max<std::int64_t>(1, ng / tp);   // kv heads per rank
    const std::int64_t replicas = std::max<std::int64_t>(1, tp / ng);   // ranks per kv head
    for (std::int64_t t = 0; t < tp; ++t) {
      RankMemory mem(L, 100 + t);
      const std::string buf = "model.layers.2.self_attn.qkv_proj.weight";
      const std::int64_t kr = kv_heads * hd, shard = t / replicas;
      REQUIRE(mem.size(buf) == (qr + 2 * kr) * H);
      INFO("tp=", tp, " rank ", t);
      for (std::int64_t l = 0; l < qr + 2 * kr; ++l) {
        if (l < qr) mem.expect_row(buf, l, H, "model.layers.2.self_attn.q_proj.weight", t * qr + l);
        else if (l < qr + kr) mem.expect_row(buf, l, H, "model.layers.2.self_attn.k_proj.weight", shard * kr + l - qr);
        else mem.expect_row(buf, l, H, "model.layers.2.self_attn.v_proj.weight", shard * kr + l - qr - kr);
      }
    }
  }
}

TEST_CASE("vllm ranks are ordered dp, pp, tp; gate_up_proj; vocabulary padded to 64 then cut evenly") {
  CHECK(vllm_padded_vocab(151936) == 151936);
  CHECK(vllm_padded_vocab(129280) == 129280);
  CHECK(vllm_padded_vocab(1000) == 1024);
  const std::int64_t H = 256, I = 704;
  const auto L = infer_layout("tiny-llama", "tp=2,pp=2,dp=2", true, 16);
  CHECK(L.mesh.axes[0].name == "dp");
  CHECK(L.mesh.axes[1].name == "pp");
  for (std::int64_t r = 0; r < 8; ++r) {
    const std::int64_t pp = (r / 2) % 2, tp = r % 2;
    RankMemory mem(L, 16 + r);
    for (std::int64_t layer = 0; layer < 4; ++layer) {
      const std::string gu = fmt::format("model.layers.{}.mlp.gate_up_proj.weight", layer);
      REQUIRE(mem.has(gu) == (layer / 2 == pp));
      if (layer / 2 != pp) continue;
      mem.expect_row(gu, 3, H, fmt::format("model.layers.{}.mlp.gate_proj.weight", layer), tp * I / 2 + 3);
      mem.expect_row(gu, I / 2 + 3, H, fmt::format("model.layers.{}.mlp.up_proj.weight", layer), tp * I / 2 + 3);
    }
    CHECK(mem.has("model.embed_tokens.weight") == (pp == 0));
    CHECK(mem.has("lm_head.weight") == (pp == 1));
  }
  // tp=8: 1024 padded rows, 128 per rank; rows >= 1000 are padding on the last rank only.
  const auto V8 = infer_layout("tiny-llama", "tp=8");
  RankMemory last(V8, 7), other(V8, 6);
  last.expect_row("lm_head.weight", 103, H, "lm_head.weight", 999);
  CHECK(last.at("lm_head.weight", 104 * H).first == "<padding>");
  other.expect_row("lm_head.weight", 127, H, "lm_head.weight", 895);
}

TEST_CASE("vllm FusedMoE w13/w2: experts cut over dp*tp without ep, placed whole with ep = dp*tp") {
  const std::int64_t E = 16, I = 128, H = 256;
  // Without ep: each expert's intermediate dim is cut over the flattened dp x tp ranks.
  for (bool grouped : {true, false}) {
    const auto L = infer_layout("tiny-moe", "tp=2,dp=2", grouped);
    for (std::int64_t r = 0; r < 4; ++r) {
      const std::int64_t flat = r, Ir = I / 4;  // rank = dp*2 + tp, flattened moe tp rank the same
      RankMemory mem(L, r);
      const std::string w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight";
      REQUIRE(mem.size(w13) == E * 2 * Ir * H);
      for (std::int64_t e : {std::int64_t{0}, std::int64_t{9}, E - 1})
        for (std::int64_t j : {std::int64_t{0}, Ir - 1, Ir, 2 * Ir - 1}) {
          const auto got = mem.at(w13, (e * 2 * Ir + j) * H);
          const bool gate = j < Ir;
          const std::int64_t row = flat * Ir + (gate ? j : j - Ir);
          INFO(grouped, " rank ", r, " expert ", e, " row ", j);
          if (grouped) {
            CHECK(got.first == fmt::format("model.layers.1.mlp.experts.{{0..15}}.{}_proj.weight", gate ? "gate" : "up"));
            CHECK(got.second == std::vector<std::int64_t>{e, row, 0});
          } else {
            CHECK(got.first == fmt::format("model.layers.1.mlp.experts.{}.{}_proj.weight", e, gate ? "gate" : "up"));
            CHECK(got.second == std::vector<std::int64_t>{row, 0});
          }
        }
      const auto down = mem.at("model.layers.1.mlp.experts.routed_experts.w2_weight", (5 * H + 2) * Ir + 1);  // [E, H, I_r]
      CHECK(down.second == (grouped ? std::vector<std::int64_t>{5, 2, flat * Ir + 1}
                                    : std::vector<std::int64_t>{2, flat * Ir + 1}));
      // Shared experts follow the attention tp only.
      mem.expect_row("model.layers.1.mlp.shared_experts.gate_up_proj.weight", 0, H,
                     "model.layers.1.mlp.shared_experts.gate_proj.weight", (r % 2) * 64);
    }
  }
  // With ep = dp*tp = 6: 16 experts placed linearly (3,3,3,3,2,2) or round-robin.
  for (auto placement : {ExpertPlacement::linear, ExpertPlacement::round_robin})
    for (bool grouped : {true, false}) {
      const auto L = infer_layout("tiny-moe", "tp=2,dp=3,ep=6", grouped, 0, placement);
      for (std::int64_t r = 0; r < 6; ++r) {
        std::vector<std::int64_t> mine;  // experts of ep rank r, in order
        if (placement == ExpertPlacement::linear) {
          const std::int64_t start = r < 4 ? 3 * r : 12 + 2 * (r - 4), n = r < 4 ? 3 : 2;
          for (std::int64_t i = 0; i < n; ++i) mine.push_back(start + i);
        } else {
          for (std::int64_t e = r; e < E; e += 6) mine.push_back(e);
        }
        for (std::int64_t e = 0; e < E; ++e) {
          const bool is_mine = std::find(mine.begin(), mine.end(), e) != mine.end();
          CHECK((vllm_expert_owner(e, E, 6, placement) == r) == is_mine);
        }
        RankMemory mem(L, r);
        const std::string w13 = "model.layers.3.mlp.experts.routed_experts.w13_weight";
        REQUIRE(mem.size(w13) == static_cast<std::int64_t>(mine.size()) * 2 * I * H);
        for (std::size_t i = 0; i < mine.size(); ++i) {
          const auto gate = mem.at(w13, (static_cast<std::int64_t>(i) * 2 * I + 5) * H);
          const auto up = mem.at(w13, (static_cast<std::int64_t>(i) * 2 * I + I + 5) * H);
          if (grouped) {
            CHECK(gate.second == std::vector<std::int64_t>{mine[i], 5, 0});
            CHECK(up.first == "model.layers.3.mlp.experts.{0..15}.up_proj.weight");
            CHECK(up.second == std::vector<std::int64_t>{mine[i], 5, 0});
          } else {
            CHECK(gate.first == fmt::format("model.layers.3.mlp.experts.{}.gate_proj.weight", mine[i]));
            CHECK(up.first == fmt::format("model.layers.3.mlp.experts.{}.up_proj.weight", mine[i]));
            CHECK(up.second == std::vector<std::int64_t>{5, 0});
          }
        }
      }
    }
}

TEST_CASE("vllm MLA: replicated fused_qkv_a_proj = [q_a ; kv_a], column-parallel q_b/kv_b") {
  const auto L = infer_layout("tiny-moe", "tp=4,dp=2");
  for (std::int64_t r : {0, 5, 7}) {
    RankMemory mem(L, r);
    const std::int64_t t = r % 4;
    const std::string f = "model.layers.2.self_attn.fused_qkv_a_proj.weight";
    REQUIRE(mem.size(f) == (96 + 80) * 256);
    mem.expect_row(f, 0, 256, "model.layers.2.self_attn.q_a_proj.weight", 0);
    mem.expect_row(f, 95, 256, "model.layers.2.self_attn.q_a_proj.weight", 95);
    mem.expect_row(f, 96, 256, "model.layers.2.self_attn.kv_a_proj_with_mqa.weight", 0);
    mem.expect_row(f, 175, 256, "model.layers.2.self_attn.kv_a_proj_with_mqa.weight", 79);
    mem.expect_row("model.layers.2.self_attn.kv_b_proj.weight", 0, 64, "model.layers.2.self_attn.kv_b_proj.weight",
                   t * 128);
  }
  // Without q_lora (tiny-mla-mtp): q_proj column-parallel, kv_a_proj_with_mqa alone, replicated.
  const auto M = infer_layout("tiny-mla-mtp", "tp=2");
  RankMemory mem(M, 1);
  mem.expect_row("model.layers.0.self_attn.q_proj.weight", 0, 128, "model.layers.0.self_attn.q_proj.weight", 48);
  CHECK(mem.size("model.layers.0.self_attn.kv_a_proj_with_mqa.weight") == 40 * 128);
  CHECK(M.find_buffer("model.layers.0.self_attn.fused_qkv_a_proj.weight") < 0);
}

// ---------------------------------------------------------------------------
// Whole-model layouts and their errors

TEST_CASE("model_layouts: both sides validated, inference after training unless colocated, MTP training-only") {
  const auto m = model_layouts(model("tiny-mla-mtp"), "tp=2,pp=3,dp=2,ep=4,etp=1", "tp=4,pp=3", false);
  CHECK(m.train.validated());
  CHECK(m.infer.validated());
  CHECK(m.train_world == 12);
  CHECK(m.infer_world == 12);
  CHECK(m.infer.mesh.first_rank == 12);
  CHECK(m.train_stage_layers == std::vector<std::int64_t>{1, 1, 1});
  // MTP layer 3: its own weights on the last training stage, none in vLLM.
  CHECK(stage_of(m.train, "model.layers.3.eh_proj.weight") == 2);
  CHECK(stage_of(m.train, "model.layers.3.mlp.experts.{0..7}.gate_proj.weight") == 2);
  CHECK(m.train.find_tensor("model.layers.3.embed_tokens.weight") < 0);  // Megatron shares the embedding
  CHECK(m.train.find_buffer("mtp.layers.0.transformer_layer.mlp.experts.linear_fc1.weight") >= 0);  // grouped (C++ default)
  CHECK(m.infer.find_tensor("model.layers.3.eh_proj.weight") < 0);
  CHECK(std::find(m.train_only.begin(), m.train_only.end(), "model.layers.3.enorm.weight") != m.train_only.end());
  CHECK(std::find(m.train_only.begin(), m.train_only.end(), "model.layers.2.input_layernorm.weight") ==
        m.train_only.end());
  const auto c = model_layouts(model("tiny-llama"), "tp=2", "tp=4", true);
  CHECK(c.infer.mesh.first_rank == 0);
}

TEST_CASE("bytes_held: what each rank stores, padding included") {
  // tiny-llama, pp=2 without tp/dp: nothing replicated; the vocabulary pads
  // 1000 -> 1024 rows (multiple of 128) in the embedding and lm_head.
  const auto m = model_manifest(model("tiny-llama"));
  const auto T = megatron_layout(m, spec("pp=2"));
  const auto held = bytes_held(T);
  REQUIRE(held.size() == 2);
  CHECK(held[0] + held[1] == m.bytes() + 2 * 24 * 256 * 2);
  CHECK(held[0] > 0);
  // dp=2 replicates everything: each replica pair holds the same bytes.
  const auto R = bytes_held(megatron_layout(m, spec("pp=2,dp=2")));
  CHECK(R == std::vector<std::int64_t>{held[0], held[0], held[1], held[1]});
}

TEST_CASE("DeepSeek-V3 at NCCL M2N's 128+128 configuration: layouts build, experts on ep = dp % 16") {
  const auto m = model_layouts(model("deepseek-v3"), "tp=1,pp=4,dp=32,ep=16", "tp=8,dp=16", false);
  CHECK(m.train_world == 128);
  CHECK(m.infer_world == 128);
  CHECK(m.infer.mesh.first_rank == 128);
  CHECK(m.train_stage_layers == std::vector<std::int64_t>{14, 16, 16, 15});
  const auto x = megatron_expert_mesh(m.train_spec, "t");
  CHECK(x.edp == 2);
  REQUIRE(x.ep_axes.size() == 1);
  CHECK(x.ep_axes[0] == AxisRef{1, 1, 16});  // the low 16 of the 32 dp ranks
  CHECK(x.etp_axes.empty());
  // Training memory, counted from the manifest: every non-expert tensor on
  // the 32 ranks of its stage, every expert on its ep rank's 2 replicas (no
  // vocabulary padding: 129280 is a multiple of 128). MTP's embed_tokens and
  // shared_head.head are Megatron's shared embedding/output layer: not held twice.
  std::int64_t expected = 0;
  for (const auto& t : m.manifest.tensors) {
    if (t.name == "model.layers.61.embed_tokens.weight" || t.name == "model.layers.61.shared_head.head.weight") continue;
    expected += t.bytes() * (t.name.find(".mlp.experts.") != std::string::npos ? 2 : 32);
  }
  std::int64_t held = 0;
  for (auto b : bytes_held(m.train)) held += b;
  CHECK(held == expected);
}

TEST_CASE("invalid specs give clear errors") {
  auto err = [](const char* name, const char* train, const char* infer) {
    return error_of([&] { model_layouts(model(name), train, infer, false); });
  };
  // tiny-llama: 8 heads, 2 kv heads, intermediate 704; tiny-moe: 16 experts.
  struct Case {
    const char *model, *train, *infer, *phrase;
  };
  const Case cases[] = {
      {"tiny-llama", "tp=3", "tp=1", "tiny-llama.json: train spec 'tp=3': tp=3 does not divide num_attention_heads=8"},
      {"tiny-llama", "tp=1", "tp=16", "infer spec 'tp=16': tp=16 does not divide"},
      {"tiny-llama", "tp=1,ep=2", "tp=1", "ep=2 but the model has no experts"},
      {"tiny-moe", "tp=1,dp=3,ep=3", "tp=1", "ep=3 does not divide the 16 experts"},
      {"tiny-moe", "tp=1,dp=2,ep=4", "tp=1", "does not divide the 2 ranks of a stage"},
      {"tiny-moe", "tp=2,dp=3,ep=3,etp=1", "tp=1", "do not line up"},
      {"tiny-moe", "tp=1", "tp=2,dp=2,ep=2", "ep=2: vLLM's expert parallelism spans the dp*tp = 4"},
      {"tiny-moe", "tp=1", "tp=1,cp=2", "cp=2"},
      {"tiny-moe", "tp=1", "tp=1,etp=1", "etp is a training key"},
      {"tiny-llama", "tp=1", "pp=2,pp_first=1", "pp_first/pp_last are training keys"},
      {"tiny-llama", "pp=4,pp_first=3", "tp=1", "do not divide evenly"},
      {"tiny-llama", "pp=8", "tp=1", "4 layers cannot fill 8 pipeline stages"},
      {"tiny-qwen3", "pp=3", "tp=1", "tie_word_embeddings with pp=3"},
      {"tiny-llama", "tp=1", "tp=1,bogus=2", "unknown key 'bogus'"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.train);
    CAPTURE(c.infer);
    CHECK(contains(err(c.model, c.train, c.infer), c.phrase));
  }
  const std::string bad = std::string(RESHARD_TEST_MODELS) + "/../models/unknown.json";
  CHECK(contains(error_of([&] { model_layouts(bad, "tp=1", "tp=1", false); }), "unknown.json"));
}

// ---------------------------------------------------------------------------
// End to end: plan tiny models and check every schedule with the oracle

TEST_CASE("tiny-llama refits pass the oracle (disaggregated and colocated, tp > kv heads)") {
  {
    const auto m = model_layouts(model("tiny-llama"), "tp=2,pp=2,dp=2", "tp=4", false);
    plan_and_check(m.train, m.infer, {0, 5, 8, 11});
  }
  {
    const auto m = model_layouts(model("tiny-llama"), "tp=4,cp=2", "tp=8", true);
    plan_and_check(m.train, m.infer, {0, 3, 7});
  }
  {
    const auto m = model_layouts(model("tiny-llama"), "tp=8", "tp=2,pp=2,dp=2", false);
    plan_and_check(m.train, m.infer, {1, 9});
  }
}

TEST_CASE("tiny-moe refits pass the oracle: expert TP to flattened dp*tp, EP to EP, per expert and grouped") {
  for (bool grouped : {true, false}) {
    PresetOptions o;
    o.group_experts = grouped;
    {
      const auto m = model_layouts(model("tiny-moe"), "tp=2,dp=4,ep=4,etp=2", "tp=2,dp=2", o);
      plan_and_check(m.train, m.infer, {0, 7, 8});
    }
    {
      PresetOptions rr = o;
      rr.colocate = true;
      rr.vllm.placement = ExpertPlacement::round_robin;
      const auto m = model_layouts(model("tiny-moe"), "tp=1,pp=2,dp=4,ep=4", "tp=2,dp=3,ep=6", rr);
      plan_and_check(m.train, m.infer, {0, 5});
    }
  }
  {
    const auto m = model_layouts(model("tiny-moe"), "tp=2,pp=2,dp=2,ep=4,etp=1", "tp=4,pp=2,dp=2,ep=8", false);
    plan_and_check(m.train, m.infer, {2, 9});
  }
}

TEST_CASE("tiny Qwen3 (tied), Qwen3-MoE and MLA+MTP refits pass the oracle") {
  {
    const auto m = model_layouts(model("tiny-qwen3"), "tp=2,cp=2", "tp=4,dp=2", false);
    CHECK(m.infer.find_tensor("lm_head.weight") < 0);
    plan_and_check(m.train, m.infer, {0, 4});
  }
  {
    const auto m = model_layouts(model("tiny-qwen3-moe"), "tp=2,pp=2,ep=2,etp=1", "tp=2,dp=2,ep=4", false);
    plan_and_check(m.train, m.infer, {0, 4});
  }
  {
    const auto m = model_layouts(model("tiny-mla-mtp"), "tp=2,pp=3,dp=2,ep=4,etp=1", "tp=4,pp=3", false);
    plan_and_check(m.train, m.infer, {0, 11, 12, 23});
  }
}
