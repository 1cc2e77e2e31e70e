// Named refit layouts checked element by element by the oracle, and the
// oracle itself checked: its reading of the contract on hand-written slots,
// and planted faults it must catch.
#include <mutex>
#include <set>
#include <span>
#include <doctest/doctest.h>

#include "plan_test_util.hpp"
#include "random_layouts.hpp"

using namespace reshard;
using namespace plantest;

namespace {

/// Plans with the default options and without coalescing; both must pass.
Schedule require_correct(const Layout& src, const Layout& dst, PlanOptions opt = {}) {
  auto c = plan_and_check(src, dst, opt);
  REQUIRE_MESSAGE(c.result.ok, c.result.fault << "\nsrc: " << oracle::describe(src) << "\ndst: " << oracle::describe(dst));
  CHECK(c.result.dst_elements > 0);
  opt.coalesce = false;
  const auto u = plan_and_check(src, dst, opt);
  REQUIRE_MESSAGE(u.result.ok, "uncoalesced: " << u.result.fault);
  opt.coalesce = true;
  opt.split_bytes = 1;  // every replicated piece cut into slabs
  const auto sl = plan_and_check(src, dst, opt);
  REQUIRE_MESSAGE(sl.result.ok, "split_bytes 1: " << sl.result.fault);
  return c.schedule;
}

std::vector<oracle::Slot> slots_of(const Layout& L, std::int64_t pos, const std::string& buffer) {
  const auto r = oracle::local_slots(L, pos);
  const int b = L.find_buffer(buffer);
  REQUIRE(b >= 0);
  REQUIRE(r.present[static_cast<std::size_t>(b)]);
  return r.buffers[static_cast<std::size_t>(b)];
}

/// Slot names "t[i,j]" / "pad" of a buffer, for comparing with hand-written lists.
std::vector<std::string> names(const Layout& L, const std::vector<oracle::Slot>& v) {
  std::vector<std::string> out;
  for (const auto& s : v) out.push_back(s.padding() ? "pad" : oracle::describe_slot(L, s));
  return out;
}

/// Megatron linear_qkv on [dp, tp]: per query group [q_g; k_g; v_g], i.e.
/// concat(q, k, v) with interleave = local query groups.
Layout megatron_qkv(std::int64_t dp, std::int64_t tp, std::int64_t nh, std::int64_t ng, std::int64_t hd, std::int64_t H) {
  LayoutSpec L = mesh_layout({{"dp", dp}, {"tp", tp}});
  const AxisRef t{1, 1, tp};
  add_tensor(L, "q", {nh * hd, H}, {cut({t}), {}});
  add_tensor(L, "k", {ng * hd, H}, {cut({t}), {}});
  add_tensor(L, "v", {ng * hd, H}, {cut({t}), {}});
  add_concat(L, "linear_qkv", {"q", "k", "v"}, 0, ng / tp);
  return Layout(std::move(L));
}

/// vLLM qkv_proj on [tp]: [q_r; k_r; v_r]; kv heads replicated over
/// tp / ng ranks when tp > ng (k shard index = rank / replicas).
Layout vllm_qkv(std::int64_t tp, std::int64_t first, std::int64_t nh, std::int64_t ng, std::int64_t hd, std::int64_t H) {
  LayoutSpec L = mesh_layout({{"tp", tp}}, first);
  const AxisRef t{0, 1, tp};
  const AxisRef kv = tp > ng ? AxisRef{0, tp / ng, ng} : t;
  add_tensor(L, "q", {nh * hd, H}, {cut({t}), {}});
  add_tensor(L, "k", {ng * hd, H}, {cut({kv}), {}});
  add_tensor(L, "v", {ng * hd, H}, {cut({kv}), {}});
  add_concat(L, "qkv_proj", {"q", "k", "v"});
  return Layout(std::move(L));
}

}  // namespace

// ---------------------------------------------------------------------------
// The oracle's reading of the contract, on slots written out by hand.

TEST_CASE("oracle: concat with interleave lays out G rounds of each part's slices") {
  LayoutSpec L_spec = mesh_layout({{"x", 1}});
  add_tensor(L_spec, "q", {4});
  add_tensor(L_spec, "k", {2});
  add_concat(L_spec, "qk", {"q", "k"}, 0, 2);
  Layout L(std::move(L_spec));
  CHECK(names(L, slots_of(L, 0, "qk")) == std::vector<std::string>{"q[0]", "q[1]", "k[0]", "q[2]", "q[3]", "k[1]"});
}

TEST_CASE("oracle: concat along dim 1 of 2-D parts, one part empty on a rank") {
  LayoutSpec L_spec = mesh_layout({{"tp", 2}});
  add_tensor(L_spec, "a", {2, 2});
  add_tensor(L_spec, "b", {2, 1}, {{}, cut({AxisRef{0, 1, 2}}, Split::chunk)});  // rank 1 holds nothing of b
  add_concat(L_spec, "ab", {"a", "b"}, 1);
  Layout L(std::move(L_spec));
  CHECK(names(L, slots_of(L, 0, "ab")) == std::vector<std::string>{"a[0,0]", "a[0,1]", "b[0,0]", "a[1,0]", "a[1,1]", "b[1,0]"});
  CHECK(names(L, slots_of(L, 1, "ab")) == std::vector<std::string>{"a[0,0]", "a[0,1]", "a[1,0]", "a[1,1]"});
}

TEST_CASE("oracle: flat buffer cut with chunk over dp, with padding parts") {
  LayoutSpec L_spec = mesh_layout({{"dp", 2}});
  add_tensor(L_spec, "a", {2, 2});
  add_tensor(L_spec, "b", {3}, {padded(DimSpec{}, 4)});
  add_flat(L_spec, "bucket", {"a", "b"}, cut({AxisRef{0, 1, 2}}, Split::chunk));
  Layout L(std::move(L_spec));
  // sequence: a00 a01 a10 a11 b0 b1 b2 pad (L = 8), chunk of 4 each
  CHECK(names(L, slots_of(L, 0, "bucket")) == std::vector<std::string>{"a[0,0]", "a[0,1]", "a[1,0]", "a[1,1]"});
  CHECK(names(L, slots_of(L, 1, "bucket")) == std::vector<std::string>{"b[0]", "b[1]", "b[2]", "pad"});
}

TEST_CASE("oracle: cyclic blocks, sub-axes and pad_to") {
  LayoutSpec L_spec = mesh_layout({{"ep", 4}});
  // dim 0: block-cyclic B=2 over the high digit of ep (ep / 2), padded to 10
  add_tensor(L_spec, "e", {9}, {padded(cyclic({AxisRef{0, 2, 2}}, 2), 10)});
  Layout L(std::move(L_spec));
  // part 0 (ep 0,1): blocks 0, 2, 4 -> 0 1 4 5 8 9(pad); part 1 (ep 2,3): 2 3 6 7
  CHECK(names(L, slots_of(L, 1, "e")) == std::vector<std::string>{"e[0]", "e[1]", "e[4]", "e[5]", "e[8]", "pad"});
  CHECK(names(L, slots_of(L, 2, "e")) == std::vector<std::string>{"e[2]", "e[3]", "e[6]", "e[7]"});
}

TEST_CASE("oracle: stage and explicit sizes") {
  LayoutSpec L_spec = mesh_layout({{"pp", 2}, {"tp", 3}});
  DimSpec s = cut({AxisRef{1, 1, 3}}, Split::sizes);
  s.sizes = {0, 3, 2};
  add_tensor(L_spec, "w", {5}, {s}).stage = {{0, 1}};
  Layout L(std::move(L_spec));
  const auto r0 = oracle::local_slots(L, 1);  // pp 0: outside the stage
  CHECK_FALSE(r0.present[0]);
  const auto r4 = oracle::local_slots(L, 3);  // pp 1, tp 0: empty part
  CHECK_FALSE(r4.present[0]);
  CHECK(names(L, slots_of(L, 4, "w")) == std::vector<std::string>{"w[0]", "w[1]", "w[2]"});
  CHECK(names(L, slots_of(L, 5, "w")) == std::vector<std::string>{"w[3]", "w[4]"});
}

// ---------------------------------------------------------------------------
// The oracle catches planted faults.

TEST_CASE("oracle: every planted fault is caught") {
  int planted = 0, caught = 0;
  for (std::uint64_t seed = 1; seed <= 300; ++seed) {
    const auto pair = testgen::random_layout_pair(seed);
    const auto s = plan(pair.src, pair.dst);
    if (s.copies.empty()) continue;
    const std::size_t i = seed % s.copies.size();
    for (int m = 0; m < 6; ++m) {
      Schedule x = s;
      Copy& c = x.copies[i];
      switch (m) {
        case 0: x.copies.erase(x.copies.begin() + static_cast<std::ptrdiff_t>(i)); break;  // a slot never written
        case 1: x.copies.push_back(c); break;                                              // written twice
        case 2: c.dst_offset += 1; break;                                                  // wrong slot
        case 3: c.src_offset += 1; break;                                                  // wrong element
        case 4: c.extent(0) += 1; break;                                                   // too much
        case 5: c.src_rank = -5; break;                                                    // not a source rank
      }
      x.compute_stats(0);  // so only the element check can notice
      const auto r = oracle::check_schedule(pair.src, pair.dst, x);
      INFO("seed " << seed << " mutation " << m << " of copy " << oracle::describe_copy(s.copies[i]));
      CHECK_FALSE(r.ok);
      ++planted;
      caught += r.ok ? 0 : 1;
    }
  }
  MESSAGE(planted << " planted faults, " << caught << " caught");
}

TEST_CASE("oracle: a network copy of data the receiver already holds is not minimal") {
  // Colocated identical replicated layouts: every copy should be local.
  LayoutSpec L_spec = mesh_layout({{"dp", 2}});
  add_tensor(L_spec, "w", {4, 4});
  Layout L(std::move(L_spec));
  auto s = plan(L, L);
  REQUIRE(oracle::check_schedule(L, L, s).ok);
  REQUIRE(s.stats.bytes == 0);
  // Rewire rank 1's copy to read rank 0's replica: same elements, wrong rank.
  for (auto& c : s.copies)
    if (c.dst_rank == 1) c.src_rank = 0;
  s.compute_stats(2);
  const auto r = oracle::check_schedule(L, L, s);
  CHECK_FALSE(r.ok);
  CHECK(r.fault.find("not minimal") != std::string::npos);
  oracle::CheckOptions lax;
  lax.minimal = false;
  CHECK(oracle::check_schedule(L, L, s, lax).ok);
}

TEST_CASE("oracle: stats that disagree with the copies are a fault") {
  LayoutSpec src_spec = mesh_layout({{"tp", 2}});
  add_tensor(src_spec, "w", {4, 4}, {cut({AxisRef{0, 1, 2}}), {}});
  Layout src(std::move(src_spec));
  LayoutSpec dst_spec = mesh_layout({{"tp", 2}}, 2);
  add_tensor(dst_spec, "w", {4, 4}, {{}, cut({AxisRef{0, 1, 2}})});
  Layout dst(std::move(dst_spec));
  auto s = plan(src, dst);
  REQUIRE(oracle::check_schedule(src, dst, s).ok);
  s.stats.bytes += 2;
  CHECK_FALSE(oracle::check_schedule(src, dst, s).ok);
}

// ---------------------------------------------------------------------------
// Named refits

TEST_CASE("megatron linear_qkv (per-group interleave) -> vLLM qkv_proj") {
  SUBCASE("dp=2,tp=2 (2 groups per rank) -> tp=4") {
    const auto s = require_correct(megatron_qkv(2, 2, 8, 4, 4, 16), vllm_qkv(4, 4, 8, 4, 4, 16));
    CHECK(s.stats.bytes == (32 + 16 + 16) * 16 * 2);
  }
  SUBCASE("tp=4 (1 group per rank) -> tp=8 (kv heads replicated on 2 ranks)") {
    const auto s = require_correct(megatron_qkv(1, 4, 8, 4, 4, 16), vllm_qkv(8, 4, 8, 4, 4, 16));
    CHECK(s.stats.bytes == (32 + 2 * 16 + 2 * 16) * 16 * 2);  // every kv row lands on two ranks
  }
  SUBCASE("tp=1 (4 groups interleaved on one rank) -> tp=2") {
    require_correct(megatron_qkv(1, 1, 8, 4, 4, 16), vllm_qkv(2, 1, 8, 4, 4, 16));
  }
  SUBCASE("back: vLLM tp=4 -> megatron dp=2,tp=2") {
    require_correct(vllm_qkv(4, 4, 8, 4, 4, 16), megatron_qkv(2, 2, 8, 4, 4, 16));
  }
}

TEST_CASE("megatron linear_fc1 [gate_t; up_t] tp=2 -> vLLM gate_up_proj tp=4") {
  LayoutSpec src_spec = mesh_layout({{"tp", 2}});
  add_tensor(src_spec, "gate", {24, 8}, {cut({AxisRef{0, 1, 2}}), {}});
  add_tensor(src_spec, "up", {24, 8}, {cut({AxisRef{0, 1, 2}}), {}});
  add_concat(src_spec, "linear_fc1", {"gate", "up"});
  Layout src(std::move(src_spec));
  LayoutSpec dst_spec = mesh_layout({{"tp", 4}}, 2);
  add_tensor(dst_spec, "gate", {24, 8}, {cut({AxisRef{0, 1, 4}}), {}});
  add_tensor(dst_spec, "up", {24, 8}, {cut({AxisRef{0, 1, 4}}), {}});
  add_concat(dst_spec, "gate_up_proj", {"gate", "up"});
  Layout dst(std::move(dst_spec));
  const auto s = require_correct(src, dst);
  CHECK(s.copies.size() == 8);  // one run of gate and one of up per receiver
}

TEST_CASE("tp=2 -> tp=4 and tp=4 -> tp=2, column and row parallel") {
  auto make = [](std::int64_t tp, std::int64_t first) {
    LayoutSpec L = mesh_layout({{"tp", tp}}, first);
    const AxisRef t{0, 1, tp};
    add_tensor(L, "col", {32, 12}, {cut({t}), {}});
    add_tensor(L, "row", {12, 32}, {{}, cut({t})});
    add_tensor(L, "norm", {12});
    return Layout(std::move(L));
  };
  SUBCASE("tp=2 -> tp=4") {
    const auto s = require_correct(make(2, 0), make(4, 2));
    CHECK(s.stats.bytes == (32 * 12 + 12 * 32 + 4 * 12) * 2);
  }
  SUBCASE("tp=4 -> tp=2") {
    const auto s = require_correct(make(4, 0), make(2, 4));
    CHECK(s.stats.bytes == (32 * 12 + 12 * 32 + 2 * 12) * 2);
  }
}

TEST_CASE("cyclic (round-robin) experts -> linear experts with expert TP") {
  LayoutSpec src_spec = mesh_layout({{"ep", 4}});
  add_tensor(src_spec, "experts.w13", {8, 6, 4}, {cyclic({AxisRef{0, 1, 4}}, 1), {}, {}});
  Layout src(std::move(src_spec));
  LayoutSpec dst_spec = mesh_layout({{"ep", 2}, {"tp", 2}}, 4);
  add_tensor(dst_spec, "experts.w13", {8, 6, 4}, {cut({AxisRef{0, 1, 2}}), cut({AxisRef{1, 1, 2}}), {}});
  Layout dst(std::move(dst_spec));
  const auto s = require_correct(src, dst);
  // Each receiver gets its 4 experts' halves: from every source rank one strided copy.
  CHECK(s.copies.size() == 16);
}

TEST_CASE("flat ZeRO bucket over dp -> tensors, and tensors -> flat bucket") {
  auto bucket = [](std::int64_t dp, Split split, std::int64_t first) {
    LayoutSpec L = mesh_layout({{"dp", dp}}, first);
    add_tensor(L, "a", {10, 6});
    add_tensor(L, "b", {7});
    add_tensor(L, "c", {3, 5}, {}, DType::bf16);
    add_flat(L, "bucket0", {"a", "b", "c"}, cut({AxisRef{0, 1, dp}}, split));
    return Layout(std::move(L));
  };
  auto tensors = [](std::int64_t first) {
    LayoutSpec L = mesh_layout({{"tp", 2}}, first);
    add_tensor(L, "a", {10, 6}, {cut({AxisRef{0, 1, 2}}), {}});
    add_tensor(L, "b", {7});
    add_tensor(L, "c", {3, 5}, {{}, cut({AxisRef{0, 1, 2}}, Split::balanced)});
    return Layout(std::move(L));
  };
  SUBCASE("bucket (chunk over dp=4) -> tensors") { require_correct(bucket(4, Split::chunk, 0), tensors(4)); }
  SUBCASE("bucket (balanced over dp=3) -> tensors") { require_correct(bucket(3, Split::balanced, 0), tensors(3)); }
  SUBCASE("tensors -> bucket") { require_correct(tensors(0), bucket(4, Split::chunk, 2)); }
  SUBCASE("bucket -> bucket of another dp, colocated") { require_correct(bucket(4, Split::chunk, 0), bucket(3, Split::balanced, 0)); }
}

TEST_CASE("padded vocabulary: Megatron pads to 128*tp, vLLM to 64, on both sides different") {
  const std::int64_t vocab = 1100, H = 8;
  LayoutSpec src_spec = mesh_layout({{"dp", 2}, {"tp", 2}});
  add_tensor(src_spec, "embed", {vocab, H}, {padded(cut({AxisRef{1, 1, 2}}), 1280), {}});  // 640 rows per rank
  Layout src(std::move(src_spec));
  LayoutSpec dst_spec = mesh_layout({{"tp", 4}}, 4);
  add_tensor(dst_spec, "embed", {vocab, H}, {padded(cut({AxisRef{0, 1, 4}}), 1152), {}});  // 288 rows per rank
  Layout dst(std::move(dst_spec));
  const auto s = require_correct(src, dst);
  CHECK(s.stats.bytes == vocab * H * 2);  // padding rows never move
  SUBCASE("and back") { require_correct(dst, src); }
}

TEST_CASE("colocated: tp=4 -> dp=2,tp=2 on the same four ranks") {
  LayoutSpec src_spec = mesh_layout({{"tp", 4}});
  add_tensor(src_spec, "w", {16, 8}, {cut({AxisRef{0, 1, 4}}), {}});
  add_tensor(src_spec, "o", {8, 16}, {{}, cut({AxisRef{0, 1, 4}})});
  Layout src(std::move(src_spec));
  LayoutSpec dst_spec = mesh_layout({{"dp", 2}, {"tp", 2}});
  add_tensor(dst_spec, "w", {16, 8}, {cut({AxisRef{1, 1, 2}}), {}});
  add_tensor(dst_spec, "o", {8, 16}, {{}, cut({AxisRef{1, 1, 2}})});
  Layout dst(std::move(dst_spec));
  const auto s = require_correct(src, dst);
  CHECK(s.stats.local_bytes > 0);
  // Receivers 0 and 3 already hold a quarter of each tensor (half of what
  // they need), 1 and 2 nothing of it: 3/8 of the 2 x 4 halves stay local.
  CHECK(s.stats.local_bytes == 2 * (2 * 32) * 2);
  CHECK(s.stats.bytes == 2 * (4 * 64 - 2 * 32) * 2);
}

TEST_CASE("permuted and non-contiguous rank lists") {
  LayoutSpec src_spec = mesh_layout({{"dp", 2}, {"tp", 2}}, 0, {9, 3, 12, 0});
  add_tensor(src_spec, "w", {12, 10}, {cut({AxisRef{1, 1, 2}}), {}});
  Layout src(std::move(src_spec));
  LayoutSpec dst_spec = mesh_layout({{"tp", 3}}, 0, {12, 7, 3});  // partly overlapping, reversed order
  add_tensor(dst_spec, "w", {12, 10}, {{}, cut({AxisRef{0, 1, 3}}, Split::chunk)});
  Layout dst(std::move(dst_spec));
  const auto s = require_correct(src, dst);
  for (const auto& c : s.copies) {
    CHECK((c.src_rank == 9 || c.src_rank == 3 || c.src_rank == 12 || c.src_rank == 0));
    CHECK((c.dst_rank == 12 || c.dst_rank == 7 || c.dst_rank == 3));
  }
}

TEST_CASE("ranks too far apart to pack into one sort key are still sorted and planned exactly") {
  // Source ranks 0 and 2^62 with 8 tensors (8 source buffers): a batch's route
  // fields span 63 + 3 + 3 bits, more than one 64-bit word, so the planner
  // sorts field by field. The result must be what the oracle wants,
  // and one-rank plans the full plan's copies in its order.
  const std::int64_t far = std::int64_t{1} << 62;
  LayoutSpec src_spec = mesh_layout({{"tp", 2}}, 0, {0, far});
  LayoutSpec dst_spec = mesh_layout({{"tp", 4}}, 5);
  std::vector<std::string> reversed;
  for (int t = 0; t < 8; ++t) {
    add_tensor(src_spec, fmt::format("w{}", t), {8, 6}, {cut({AxisRef{0, 1, 2}}), {}});
    add_tensor(dst_spec, fmt::format("w{}", t), {8, 6}, {{}, cut({AxisRef{0, 1, 4}}, Split::chunk)});
    reversed.insert(reversed.begin(), fmt::format("w{}", t));
  }
  // One destination buffer in reverse tensor order: the planner meets the
  // tensors (and the two senders by turns) out of the order it must list.
  add_concat(dst_spec, "b", reversed);
  Layout src(std::move(src_spec));
  Layout dst(std::move(dst_spec));
  const Schedule full = require_correct(src, dst);
  auto order = [](const Copy& c) {
    return std::make_tuple(c.dst_rank, c.dst_buffer, c.src_rank, c.src_buffer, c.tensor, c.dst_offset);
  };
  std::set<std::int64_t> senders;
  for (std::size_t i = 0; i < full.copies.size(); ++i) {
    senders.insert(full.copies[i].src_rank);
    if (i > 0) CHECK(order(full.copies[i - 1]) <= order(full.copies[i]));
  }
  CHECK(senders == std::set<std::int64_t>{0, far});
  for (std::int64_t rank : {std::int64_t{0}, far, std::int64_t{5}, std::int64_t{8}}) {
    PlanOptions one;
    one.only_rank = rank;
    oracle::CheckOptions co;
    co.only_rank = rank;
    const auto c = plan_and_check(src, dst, one, co);
    REQUIRE_MESSAGE(c.result.ok, "only_rank " << rank << ": " << c.result.fault);
    std::vector<Copy> want;
    for (const auto& x : full.copies)
      if (x.src_rank == rank || x.dst_rank == rank) want.push_back(x);
    REQUIRE(c.schedule.copies.size() == want.size());
    for (std::size_t i = 0; i < want.size(); ++i) CHECK(copy_key(c.schedule.copies[i]) == copy_key(want[i]));
  }
}

TEST_CASE("a large batch met out of order is listed in the planner's order, one-rank plans alike") {
  // 300 tensors cut over 2 source ranks, all in one destination buffer (in
  // reverse order, 4 rounds each): the destination's 1200 emitted copies
  // alternate senders and repeat routes, so the key sort (by radix at this
  // size) has real work.
  LayoutSpec src_spec = mesh_layout({{"tp", 2}});
  LayoutSpec dst_spec = mesh_layout({{"tp", 1}}, 2);
  std::vector<std::string> reversed;
  for (int t = 0; t < 300; ++t) {
    add_tensor(src_spec, fmt::format("w{}", t), {4, 6}, {cut({AxisRef{0, 1, 2}}), {}});
    add_tensor(dst_spec, fmt::format("w{}", t), {4, 6});
    reversed.insert(reversed.begin(), fmt::format("w{}", t));
  }
  add_concat(dst_spec, "b", reversed, 0, 4);
  Layout src(std::move(src_spec));
  Layout dst(std::move(dst_spec));
  for (bool coalesce : {true, false}) {
    PlanOptions opt;
    opt.coalesce = coalesce;
    const Schedule full = require_correct(src, dst, opt);
    if (!coalesce) CHECK(full.copies.size() == 1200);
    for (std::size_t i = 1; i < full.copies.size(); ++i) {
      const Copy &a = full.copies[i - 1], &b = full.copies[i];
      CHECK(std::make_tuple(a.dst_rank, a.dst_buffer, a.src_rank, a.src_buffer, a.tensor, a.dst_offset) <
            std::make_tuple(b.dst_rank, b.dst_buffer, b.src_rank, b.src_buffer, b.tensor, b.dst_offset));
    }
    for (std::int64_t rank : {0, 1, 2}) {
      PlanOptions one = opt;
      one.only_rank = rank;
      const Schedule part = plan(src, dst, one);
      std::vector<Copy> want;
      for (const auto& x : full.copies)
        if (x.src_rank == rank || x.dst_rank == rank) want.push_back(x);
      REQUIRE(part.copies.size() == want.size());
      for (std::size_t i = 0; i < want.size(); ++i) CHECK(copy_key(part.copies[i]) == copy_key(want[i]));
    }
  }
}

TEST_CASE("pipeline stages: pp=2 (layers split by stage) -> pp=1, and pp=1 -> pp=3") {
  auto make = [](std::int64_t pp, std::int64_t tp, std::int64_t first) {
    LayoutSpec L = mesh_layout({{"pp", pp}, {"tp", tp}}, first);
    for (int layer = 0; layer < 6; ++layer) {
      auto& t = add_tensor(L, fmt::format("layers.{}.w", layer), {8, 6}, {cut({AxisRef{1, 1, tp}}), {}});
      if (pp > 1) t.stage = {{0, layer * pp / 6}};
    }
    return Layout(std::move(L));
  };
  SUBCASE("pp=2,tp=2 -> tp=4") { require_correct(make(2, 2, 0), make(1, 4, 4)); }
  SUBCASE("tp=2 -> pp=3,tp=2") { require_correct(make(1, 2, 0), make(3, 2, 2)); }
}

TEST_CASE("source-only tensors are ignored; a destination tensor missing from the source is an error") {
  LayoutSpec src_spec = mesh_layout({{"tp", 2}});
  add_tensor(src_spec, "a", {4});
  add_tensor(src_spec, "extra", {4});
  Layout src(std::move(src_spec));
  LayoutSpec dst_spec = mesh_layout({{"tp", 1}}, 2);
  add_tensor(dst_spec, "a", {4});
  Layout dst(std::move(dst_spec));
  require_correct(src, dst);
  CHECK_THROWS_AS(plan(dst, src), LayoutError);
}

TEST_CASE("a tensor whose shape or dtype differs between the sides is an error naming it") {
  const Layout src = one_tensor({{"tp", 2}}, {4, 6});
  const std::pair<Layout, std::string> mismatches[] = {{one_tensor({{"tp", 2}}, {6, 4}, 2), "shape"},
                                                       {one_tensor({{"tp", 2}}, {4, 6}, 2, {}, DType::f32), "dtype"}};
  for (const auto& [dst, field] : mismatches) {
    CAPTURE(field);
    try {
      plan(src, dst);
      FAIL("no error for a mismatch");
    } catch (const LayoutError& e) {
      CHECK(e.context.tensor == "w");
      CHECK(e.context.field == field);
    }
  }
}

TEST_CASE("a piece needing more than kMaxBoxRank box dims is cut into several copies") {
  // Each of 5 dims of 12 is block-cyclic over its own axis on both sides
  // (B=4 on the source, B=2 on the destination): a source part meets a
  // destination part in 2 runs of 2 on every dim, which merge on neither side
  // (local extents 8 and 6), so the piece has 10 box dims.
  const std::vector<Axis> axes{{"a", 2}, {"b", 2}, {"c", 2}, {"d", 2}, {"e", 2}};
  LayoutSpec src_spec = mesh_layout(axes), dst_spec = mesh_layout(axes, 32);
  std::vector<DimSpec> sdims, ddims;
  for (int d = 0; d < 5; ++d) {
    sdims.push_back(cyclic({AxisRef{d, 1, 2}}, 4));
    ddims.push_back(cyclic({AxisRef{d, 1, 2}}, 2));
  }
  add_tensor(src_spec, "w", {12, 12, 12, 12, 12}, sdims);
  add_tensor(dst_spec, "w", {12, 12, 12, 12, 12}, ddims);
  Layout src(std::move(src_spec)), dst(std::move(dst_spec));
  static_assert(2 * 5 > kMaxBoxRank);
  const Schedule s = require_correct(src, dst);
  int widest = 0;
  for (const auto& c : s.copies) widest = std::max(widest, static_cast<int>(c.rank));
  CHECK(widest == kMaxBoxRank);
  CHECK(s.copies.size() > 32 * 32);  // more than one copy per pair of ranks
}

TEST_CASE("a full plan is the same for any thread count") {
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    const auto pair = testgen::random_layout_pair(seed);
    PlanOptions one, many;
    many.threads = 3;
    const Schedule a = plan(pair.src, pair.dst, one), b = plan(pair.src, pair.dst, many);
    REQUIRE(a.copies.size() == b.copies.size());
    CHECK(copy_multiset(a.copies) == copy_multiset(b.copies));
    for (std::size_t i = 0; i < a.copies.size(); ++i) CHECK(copy_key(a.copies[i]) == copy_key(b.copies[i]));
  }
}

TEST_CASE("plan_each_destination streams exactly plan()'s copies, destination by destination") {
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    const auto pair = testgen::random_layout_pair(seed);
    PlanOptions opt;
    opt.threads = 1;
    const Schedule whole = plan(pair.src, pair.dst, opt);
    std::vector<Copy> streamed;
    std::int64_t last = -1;
    plan_each_destination(pair.src, pair.dst, opt, [&](std::int64_t pos, std::span<const Copy> copies) {
      CHECK(pos > last);  // one call per destination, in order with one thread
      last = pos;
      for (const auto& c : copies) CHECK(c.dst_rank == pair.dst.mesh.global_rank(pos));
      streamed.insert(streamed.end(), copies.begin(), copies.end());
    });
    // plan() lists destinations by global rank, the stream by mesh position.
    std::stable_sort(streamed.begin(), streamed.end(), [](const Copy& a, const Copy& b) { return a.dst_rank < b.dst_rank; });
    REQUIRE(streamed.size() == whole.copies.size());
    for (std::size_t i = 0; i < streamed.size(); ++i) CHECK(copy_key(streamed[i]) == copy_key(whole.copies[i]));
    // Several threads: the same copies per destination, whatever the call order.
    opt.threads = 3;
    std::mutex m;
    std::vector<Copy> parallel;
    plan_each_destination(pair.src, pair.dst, opt, [&](std::int64_t, std::span<const Copy> copies) {
      std::lock_guard lk(m);
      parallel.insert(parallel.end(), copies.begin(), copies.end());
    });
    CHECK(copy_multiset(parallel) == copy_multiset(whole.copies));
  }
}
