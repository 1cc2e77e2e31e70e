// verify.hpp, the tags by which reshard-refit, the benchmarks and the UCX
// harness call a refit "validated", against the oracle's own slot view of
// local memory (tests/oracle.hpp, which does not use the library's storage
// code): every slot of every buffer gets the tag of the element the oracle
// says sits there, padding its fixed byte, and a poisoned buffer fails every
// real slot. A storage bug the planner and verify.hpp shared would show here.
// Layouts: random pairs, the Megatron / vLLM presets from HuggingFace
// configs, and reshard-refit's own built-in Llama-like layouts, scaled down.
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "../tools/refit_harness.hpp"
#include "oracle.hpp"
#include "random_layouts.hpp"
#include "reshard/presets/presets.hpp"
#include "reshard_support/verify.hpp"

using namespace reshard;

namespace {

/// The first slot where verify.hpp and the oracle disagree, in words; "" if none.
std::string tags_disagree_with_oracle(const Layout& L) {
  constexpr std::uint64_t salt = 3;
  for (std::int64_t pos = 0; pos < L.mesh.size(); ++pos) {
    const auto slots = oracle::local_slots(L, pos);
    for (std::size_t b = 0; b < slots.buffers.size(); ++b) {
      if (!slots.present[b]) continue;
      const auto& name = L.local_buffers()[b].name;
      const auto E = static_cast<std::size_t>(element_bytes(L.local_buffers()[b].dtype));
      std::vector<std::byte> mem(slots.buffers[b].size() * E, std::byte{0x11});
      fill_tags(L, pos, static_cast<int>(b), mem.data(), TagFill::source, salt);
      std::int64_t real = 0;
      for (std::size_t i = 0; i < slots.buffers[b].size(); ++i) {
        const auto& sl = slots.buffers[b][i];
        std::vector<std::byte> want(E, kSourcePadding);
        if (!sl.padding()) {
          ++real;
          const auto v = element_tag(tensor_key(L.tensors[static_cast<std::size_t>(sl.tensor)].name), sl.index, salt);
          std::memcpy(want.data(), &v, std::min<std::size_t>(E, 8));
        }
        if (std::memcmp(mem.data() + i * E, want.data(), E) != 0)
          return fmt::format("{}: position {} buffer '{}' slot {}: the oracle puts {} there, verify.hpp writes something else",
                             L.origin, pos, name, i, oracle::describe_slot(L, sl));
      }
      // A destination filled with the poison fails every real slot; every slot is looked at.
      fill_tags(L, pos, static_cast<int>(b), mem.data(), TagFill::poison, salt);
      const auto bad = check_tags(L, pos, static_cast<int>(b), mem.data(), salt);
      if (bad.wrong != real || bad.checked != static_cast<std::int64_t>(slots.buffers[b].size()))
        return fmt::format("{}: position {} buffer '{}': poison fails {} of {} real slots, {} of {} slots checked", L.origin, pos,
                           name, bad.wrong, real, bad.checked, slots.buffers[b].size());
    }
  }
  return "";
}

std::string model(const std::string& name) { return std::string(RESHARD_TEST_MODELS) + "/" + name + ".json"; }

}  // namespace

TEST_CASE("verify.hpp tags every slot the way the oracle lays them out: random layout pairs") {
  for (std::uint64_t seed = 1; seed <= 60; ++seed) {
    const auto pair = testgen::random_layout_pair(seed);
    INFO(pair.describe());
    CHECK(tags_disagree_with_oracle(pair.src) == "");
    CHECK(tags_disagree_with_oracle(pair.dst) == "");
  }
}

TEST_CASE("verify.hpp tags every slot the way the oracle lays them out: Megatron and vLLM presets") {
  using namespace presets;
  struct Case {
    const char* model;
    const char* train;
    const char* infer;
  };
  for (const Case& c : {Case{"tiny-llama", "tp=2,pp=2,dp=2", "tp=4"}, Case{"tiny-llama", "tp=4", "tp=2,pp=2"},
                        Case{"tiny-moe", "tp=2,pp=2,dp=2,ep=4", "tp=4,dp=2"}, Case{"tiny-moe", "tp=1,dp=4,ep=4,etp=1", "tp=2,ep=2"},
                        Case{"tiny-qwen3-moe", "tp=2,dp=2,ep=2", "tp=4"}, Case{"tiny-mla-mtp", "tp=2,pp=2", "tp=2,dp=2"}}) {
    CAPTURE(c.model);
    CAPTURE(c.train);
    CAPTURE(c.infer);
    const auto manifest = model_manifest(model(c.model), true);
    const Layout train = megatron_layout(manifest, parse_parallel_spec(c.train, "train"));
    const Layout infer = vllm_layout(manifest, parse_parallel_spec(c.infer, "infer"), train.mesh.size());
    CHECK(tags_disagree_with_oracle(train) == "");
    CHECK(tags_disagree_with_oracle(infer) == "");
  }
}

TEST_CASE("verify.hpp tags every slot the way the oracle lays them out: reshard-refit's built-in model, scaled down") {
  refit_harness::ModelShape m;
  m.layers = 2;
  m.hidden = 64;
  m.heads = 8;
  m.kv_heads = 4;
  m.head_dim = 8;
  m.intermediate = 96;
  m.vocab = 301;  // odd, padded differently on each side as in the full model
  for (const Layout& L : {refit_harness::megatron_layout(m, 2, 2, 2), refit_harness::megatron_layout(m, 1, 1, 4),
                          refit_harness::vllm_layout(m, 4, 1, 8), refit_harness::vllm_layout(m, 8, 2, 8)}) {
    CAPTURE(L.origin);
    CHECK(tags_disagree_with_oracle(L) == "");
  }
}
