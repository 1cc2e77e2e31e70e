// libFuzzer target: the layout JSON reader (CONTRACT.md §1).
//
// Any input either reads to a valid layout or throws reshard::Error (a
// LayoutError naming the file, tensor and field); anything else (another
// exception, a crash, a sanitizer report, a hang) is a finding. A layout
// that reads must also write back to JSON that reads to the same layout,
// and a small one refits onto itself without moving anything over the
// network (the plan is checked by the oracle).
#include <cstdint>
#include <string>

#include "fuzz_common.hpp"
#include "oracle.hpp"
#include "reshard/json_io.hpp"
#include "reshard/plan/plan.hpp"

namespace {

/// Elements of every tensor, and the world, small enough to plan and to
/// simulate slot by slot (no overflow: the reader accepts any int64 shape).
bool small_enough(const reshard::Layout& L) {
  if (oracle::mesh_positions(L.mesh) > 32 || L.tensors.size() > 16) return false;
  std::int64_t total = 0;
  for (const auto& t : L.tensors) {
    std::int64_t n = 1;
    for (auto e : t.shape)
      if (__builtin_mul_overflow(n, e, &n) || n > 4096) return false;
    for (const auto& d : t.dims)
      if (d.pad_to > 4096) return false;
    total += n;
  }
  for (const auto& b : L.buffers)
    if (b.kind == reshard::BufferKind::flat && b.flat.pad_to > 8192) return false;
  return total <= 8192;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  reshard::Layout L;
  try {
    L = reshard::parse_layout(reshard::json_detail::parse_text(text, "fuzz.json"), "fuzz.json");
  } catch (const reshard::Error&) {
    return 0;  // rejected with the project's error: what the contract asks
  }
  if (!L.validated()) fuzzgen::finding("parse_layout returned a layout that is not validated");
  const nlohmann::json j = reshard::layout_to_json(L);
  reshard::Layout back;
  try {
    back = reshard::parse_layout(j, "roundtrip.json");
  } catch (const reshard::Error& e) {
    fuzzgen::finding("a valid layout's own JSON does not read back: " + std::string(e.what()) + "\njson: " + j.dump());
  }
  if (reshard::layout_to_json(back) != j)
    fuzzgen::finding("JSON round trip changed the layout:\nfirst:  " + j.dump() + "\nsecond: " + reshard::layout_to_json(back).dump());
  if (!small_enough(L)) return 0;
  // The layout onto itself: every destination element is already on its rank.
  reshard::Schedule s;
  try {
    s = reshard::plan(L, L);
  } catch (const std::exception& e) {
    fuzzgen::finding("plan(L, L) of a valid layout threw: " + std::string(e.what()) + "\nlayout: " + j.dump());
  }
  if (s.stats.bytes != 0)
    fuzzgen::finding("plan(L, L) moves " + std::to_string(s.stats.bytes) + " bytes over the network\nlayout: " + j.dump());
  const auto r = oracle::check_schedule(L, L, s);
  if (!r.ok) fuzzgen::finding("plan(L, L) fails the oracle: " + r.fault + "\nlayout: " + j.dump());
  return 0;
}
