// The refit simulator against hand-computed cases: one flow, shared ports,
// max-min fair sharing with a flow finishing early, NVLink vs network vs
// local, message latency, stages in sequence; the lower bound of a small
// refit; FP8 wire bytes.
#include <doctest/doctest.h>

#include "plan_test_util.hpp"
#include "random_layouts.hpp"
#include "refit_util.hpp"
#include "reshard/exec/binding.hpp"
#include "reshard/exec/executor.hpp"
#include "reshard/exec/staged_executor.hpp"
#include "reshard/presets/presets.hpp"
#include "reshard/sim/simulate.hpp"
#include "reshard/sim/stream_traffic.hpp"

#include <map>
#include <random>
#include <string>

using namespace reshard;
using namespace plantest;

namespace {

/// Ranks 0..n-1 on GPUs 0..n-1 (two layouts of n ranks each, colocated).
struct World {
  Layout a;
  Layout b;
  Topology topo;
  RankPlacement place;
  World(std::int64_t n, std::int64_t per_node, std::int64_t domain) {
    LayoutSpec spec = mesh_layout({{"x", n}});
    add_tensor(spec, "t", {n}, {cut({ax(spec, "x")})});
    a = Layout(std::move(spec));
    b = a;
    topo.gpus_per_node = per_node;
    topo.nvlink_domain = domain;
    topo.nic_gbps = 400;      // 50 GB/s
    topo.nvlink_gbps = 3600;  // 450 GB/s
    topo.latency_us = 0;
    topo.nvlink_latency_us = 0;
    topo.stage_latency_us = 0;
    place = RankPlacement(topo, a, b);
  }
};

constexpr double GB = 1e9;

/// A packed flow of `bytes` from one rank to another in one stage.
struct Flow {
  std::int32_t stage;
  std::int64_t src, dst;
  double bytes;
};

/// Every stage of x has y's GPU pairs, with the same bytes, copies and forms.
void check_same_traffic(const Traffic& x, const Traffic& y) {
  REQUIRE(x.stages() == y.stages());
  for (std::size_t s = 0; s < x.stages(); ++s) {
    const auto a = x.pairs(s), b = y.pairs(s);
    REQUIRE(a.size() == b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      CHECK(a[i].src_gpu == b[i].src_gpu);
      CHECK(a[i].dst_gpu == b[i].dst_gpu);
      CHECK(a[i].bytes == b[i].bytes);
      CHECK(a[i].copies == b[i].copies);
      CHECK(a[i].forms.zero_copy == b[i].forms.zero_copy);
      CHECK(a[i].forms.half == b[i].forms.half);
      CHECK(a[i].forms.half_bytes == b[i].forms.half_bytes);
      CHECK(a[i].forms.packed_bytes == b[i].forms.packed_bytes);
    }
  }
}

/// Simulates packed flows on w's placement.
SimResult simulate_flows(const World& w, std::initializer_list<Flow> flows) {
  Traffic tr(w.place);
  for (const auto& f : flows) tr.add(f.stage, f.src, f.dst, f.bytes);
  return simulate(tr);
}

}  // namespace

TEST_CASE("one network flow: bytes over the NIC rate, plus latency") {
  World w(4, 1, 1);
  auto r = simulate_flows(w, {{0, 0, 1, 1 * GB}});
  CHECK(r.seconds == doctest::Approx(0.020));
  CHECK(r.stages.at(0).bound_port == Port::nic_out);
  CHECK(r.stages[0].bytes[static_cast<int>(LinkKind::network)] == 1 * GB);
  // With latency, paid per message by sender and receiver. A packed copy
  // over the 256 MiB staging budget goes in waves of half of it (pipeline
  // 2): 8 messages of 128 MiB; contiguous on both sides it is one message.
  w.topo.latency_us = 100;
  w.topo.stage_latency_us = 50;
  w.place = RankPlacement(w.topo, w.a, w.b);
  r = simulate_flows(w, {{0, 0, 1, 1 * GB}});
  const double msgs = std::ceil(1e9 / (128.0 * 1024 * 1024));  // 8
  CHECK(r.stages[0].messages == 8);
  CHECK(r.seconds == doctest::Approx(0.020 + msgs * 100e-6 + 50e-6));
  Traffic t3(w.place);
  t3.add(0, 0, 1, 1 * GB, CopyForm::zero_copy);
  r = simulate(t3);
  CHECK(r.stages[0].messages == 1);
  CHECK(r.seconds == doctest::Approx(0.020 + 100e-6 + 50e-6));
}

TEST_CASE("messages as the executor forms them: zero-copy, half-staged pieces, one packed message per wave") {
  World w(4, 1, 1);
  w.topo.latency_us = 10;
  w.place = RankPlacement(w.topo, w.a, w.b);
  Traffic tr(w.place);
  for (int i = 0; i < 3; ++i) tr.add(0, 0, 1, 1e6, CopyForm::zero_copy);
  for (int i = 0; i < 2; ++i) tr.add(0, 0, 1, 1e5, CopyForm::half);
  for (int i = 0; i < 10; ++i) tr.add(0, 0, 1, 1e3, CopyForm::packed);
  const auto pairs = tr.pairs(0);
  REQUIRE(pairs.size() == 1);
  CHECK(pairs[0].forms.zero_copy == 3);
  CHECK(pairs[0].forms.half == 2);
  CHECK(pairs[0].forms.staged() == doctest::Approx(2e5 + 1e4));
  auto r = simulate(tr);
  CHECK(r.stages[0].messages == 3 + 2 + 1);  // within the budget: one wave
  CHECK(r.stages[0].latency_seconds == doctest::Approx(6 * 10e-6));
  // A budget of 4096 bytes: waves of 2048 - 16 per pair share (the staged
  // stream of 210,000 bytes in 103 waves), a packed message in each wave
  // the half copies do not fill.
  w.topo.staging_budget = 4096;
  w.place = RankPlacement(w.topo, w.a, w.b);
  Traffic t2(w.place);
  for (int i = 0; i < 10; ++i) t2.add(0, 0, 1, 1e3, CopyForm::packed);
  r = simulate(t2);
  CHECK(r.stages[0].messages == 5);  // 10,000 bytes in waves of 2,048: 5
  PairForms f;
  f.half = 2, f.half_bytes = 2e5, f.packed_bytes = 1e4;
  // 103 waves: 2 pieces + 102 boundaries x 20/21 inside half copies = 97
  // more, and the packed message in the 103 - 97 waves not all half.
  CHECK(pair_messages(f, 2048) == 2 + 97 + 6);
}

TEST_CASE("a shared host: more processes than cores stretch every message") {
  World w(4, 1, 1);  // 4 processes
  w.topo.latency_us = 10;
  w.topo.host_cores = 2;
  w.place = RankPlacement(w.topo, w.a, w.b);
  Traffic tr(w.place);
  tr.add(0, 0, 1, 1e3, CopyForm::packed);
  tr.add(0, 0, 2, 1e3, CopyForm::packed);
  auto r = simulate(tr);
  CHECK(r.stages[0].messages == 2);
  CHECK(r.stages[0].latency_seconds == doctest::Approx(2 * 10e-6 * 2.0));  // 4 processes / 2 cores
  w.topo.stage_latency_us = 50;  // the barrier too
  w.place = RankPlacement(w.topo, w.a, w.b);
  Traffic tb(w.place);
  tb.add(0, 0, 1, 1e3, CopyForm::packed);
  CHECK(simulate(tb).stages[0].latency_seconds == doctest::Approx((10e-6 + 50e-6) * 2.0));
  w.topo.stage_latency_us = 0;
  w.topo.host_cores = 8;  // fewer processes than cores: no effect
  w.place = RankPlacement(w.topo, w.a, w.b);
  Traffic t2(w.place);
  t2.add(0, 0, 1, 1e3, CopyForm::packed);
  t2.add(0, 0, 2, 1e3, CopyForm::packed);
  CHECK(simulate(t2).stages[0].latency_seconds == doctest::Approx(2 * 10e-6));
}

TEST_CASE("messages in flight: n messages cost n x latency / in-flight, still added to the transfer") {
  World w(4, 1, 1);
  w.topo.latency_us = 10;
  auto run = [&](std::int64_t in_flight) {
    w.topo.messages_in_flight = in_flight;
    w.place = RankPlacement(w.topo, w.a, w.b);
    Traffic tr(w.place);
    for (int i = 0; i < 12; ++i) tr.add(0, 0, 1, 1e6, CopyForm::zero_copy);  // 12 messages out of GPU 0
    tr.add(0, 2, 1, 1e6, CopyForm::zero_copy);                                // GPU 1 receives 13
    return simulate(tr);
  };
  const auto one = run(1), four = run(4);
  CHECK(one.stages[0].messages == 13);
  CHECK(four.stages[0].messages == 13);
  CHECK(one.stages[0].latency_seconds == doctest::Approx(13 * 10e-6));
  CHECK(four.stages[0].latency_seconds == doctest::Approx(13 * 10e-6 / 4));
  CHECK(four.stages[0].fluid_seconds == doctest::Approx(one.stages[0].fluid_seconds));
  CHECK(four.seconds == doctest::Approx(four.stages[0].fluid_seconds + 13 * 10e-6 / 4));
}

TEST_CASE("staging copies: the packers, then the unpackers, bytes at staging_copy_gbps plus a cost per run") {
  World w(4, 1, 1);
  auto run = [&](double gbps, double run_ns, double cores) {
    w.topo.staging_copy_gbps = gbps;
    w.topo.staging_run_ns = run_ns;
    w.topo.host_cores = cores;
    w.place = RankPlacement(w.topo, w.a, w.b);
    Traffic tr(w.place);
    tr.add(0, 0, 1, 1e9, CopyShape{CopyForm::packed, 1000, 2000});
    tr.add(0, 0, 2, 1e9, CopyShape{CopyForm::half, 0, 500});  // in place at the source
    tr.add(0, 0, 1, 1e9, CopyForm::zero_copy);                // no staging
    tr.add(0, 3, 3, 1e9, CopyForm::packed);                   // local: box to box
    return simulate(tr).stages.at(0);
  };
  const auto free = run(0, 0, 0);
  CHECK(free.copy_seconds == 0);
  // GPU 0 packs 1 GB in 1000 runs; GPU 1 unpacks 1 GB in 2000, GPU 2 1 GB in 500.
  const auto st = run(80, 100, 0);  // 10 GB/s, 100 ns a run
  CHECK(st.copy_seconds == doctest::Approx((0.1 + 1000 * 100e-9) + (0.1 + 2000 * 100e-9)));
  CHECK(st.seconds == doctest::Approx(st.fluid_seconds + st.latency_seconds + st.copy_seconds));
  CHECK(st.fluid_seconds == doctest::Approx(free.fluid_seconds));
  // One host core: the two unpackers take turns on it (the one packer does not wait).
  CHECK(run(80, 100, 1).copy_seconds == doctest::Approx((0.1 + 1000 * 100e-9) + 2 * (0.1 + 2000 * 100e-9)));
  CHECK(run(0, 100, 0).copy_seconds == doctest::Approx(1000 * 100e-9 + 2000 * 100e-9));  // runs only
}

TEST_CASE("a copy's shape: its form and the unit-stride runs of its staged sides") {
  // Rows of an 8x8 tensor over 2 ranks -> columns over 2 others: every
  // piece is 4 rows of a 4-wide half row at the source (4 runs), and 4
  // whole rows of the destination's 8x4 shard (one run).
  LayoutSpec src_spec = mesh_layout({{"tp", 2}});
  add_tensor(src_spec, "w", {8, 8}, {cut({ax(src_spec, "tp")}), {}});
  Layout src(std::move(src_spec));
  LayoutSpec dst_spec = mesh_layout({{"tp", 2}}, 2);
  add_tensor(dst_spec, "w", {8, 8}, {{}, cut({ax(dst_spec, "tp")})});
  Layout dst(std::move(dst_spec));
  Topology topo;
  const RankPlacement place(topo, src, dst);
  Traffic tr(place);
  const Schedule s = plan(src, dst);
  REQUIRE(s.copies.size() == 4);
  for (const auto& c : s.copies) {
    const CopyShape sh = tr.shape_of(c);
    CHECK(sh.form == CopyForm::packed);  // 16 elements: under zero_copy_min on both sides
    CHECK(sh.pack_runs == 4);
    CHECK(sh.unpack_runs == 1);
  }
  topo.zero_copy_min = 1;  // now the destination side is written in place
  const RankPlacement p1(topo, src, dst);
  Traffic t1(p1);
  const CopyShape sh = t1.shape_of(s.copies[0]);
  CHECK(sh.form == CopyForm::half);
  CHECK(sh.pack_runs == 4);
  CHECK(sh.unpack_runs == 0);
  add_traffic(t1, s);
  const auto pairs = t1.pairs(0);
  REQUIRE(pairs.size() == 4);
  CHECK(pairs[0].staging.pack_runs == 4);
  CHECK(pairs[0].staging.pack_bytes == static_cast<double>(s.copies[0].bytes()));
  CHECK(pairs[0].staging.unpack_bytes == 0);
}

TEST_CASE("two sources into one GPU share its NIC ingress") {
  World w(4, 1, 1);
  const auto r = simulate_flows(w, {{0, 0, 2, 1 * GB}, {0, 1, 2, 1 * GB}});
  CHECK(r.seconds == doctest::Approx(0.040));
  CHECK(r.stages[0].bound_gpu == 2);
  CHECK(r.stages[0].bound_port == Port::nic_in);
  CHECK(r.stages[0].bound_bytes == 2 * GB);
}

TEST_CASE("max-min fair: a short flow finishes, the others speed up") {
  // A: 0->2 2 GB, B: 1->2 1 GB, C: 1->3 2 GB. GPU 2's ingress (A, B) and
  // GPU 1's egress (B, C) are shared: all run at 25 GB/s until B ends at
  // 40 ms; then A and C run alone at 50 GB/s for their last 1 GB: 60 ms.
  World w(4, 1, 1);
  const auto r = simulate_flows(w, {{0, 0, 2, 2 * GB}, {0, 1, 2, 1 * GB}, {0, 1, 3, 2 * GB}});
  CHECK(r.seconds == doctest::Approx(0.060));
  CHECK(r.stages[0].events == 2);
  // A and D: 0->1 4 GB alone on its ports, E: 2->3 1 GB: 80 ms (the longest).
  CHECK(simulate_flows(w, {{0, 0, 1, 4 * GB}, {0, 2, 3, 1 * GB}}).seconds == doctest::Approx(0.080));
}

TEST_CASE("ports shared at both ends of a flow") {
  // F1: 0->1 3 GB, F2: 0->2 1 GB, F3: 3->2 3 GB. Ports: GPU 0 egress (F1,F2)
  // 4 GB, GPU 2 ingress (F2,F3) 4 GB: bound 80 ms. Max-min: all 25 GB/s;
  // F2 ends at 40 ms (1 GB); F1 and F3 have 2 GB left at 50 GB/s: +40 ms = 80 ms.
  World w(4, 1, 1);
  const auto r = simulate_flows(w, {{0, 0, 1, 3 * GB}, {0, 0, 2, 1 * GB}, {0, 3, 2, 3 * GB}});
  CHECK(r.stages[0].bound_seconds == doctest::Approx(0.080));
  CHECK(r.seconds == doctest::Approx(0.080));
  // Now F1 3 GB and F2 3 GB share GPU 0 egress (120 ms at 25 each), F3 1 GB
  // into GPU 2 shares with F2: F3 gets 25 until 40 ms... max-min gives F2
  // min(25 at egress, 25 at ingress) = 25, F3 = 25, F1 = 25; F3 ends at
  // 40 ms; F2 still limited to 25 by GPU 0 egress (F1 also 25): 3 GB at
  // 25 GB/s = 120 ms. Bound: egress 6 GB = 120 ms.
  CHECK(simulate_flows(w, {{0, 0, 1, 3 * GB}, {0, 0, 2, 3 * GB}, {0, 3, 2, 1 * GB}}).seconds == doctest::Approx(0.120));
}

TEST_CASE("NVLink inside a domain, the NIC between domains, local copies at the copy rate") {
  World w(8, 2, 4);  // domains {0-3}, {4-7}
  auto r = simulate_flows(w, {
      {0, 0, 1, 4.5 * GB},  // NVLink, 450 GB/s: 10 ms
      {0, 2, 5, 0.5 * GB},  // network: 10 ms
      {0, 6, 6, 1 * GB},    // local: free (memcpy_gbps 0)
  });
  CHECK(r.stages[0].bytes[static_cast<int>(LinkKind::nvlink)] == 4.5 * GB);
  CHECK(r.stages[0].bytes[static_cast<int>(LinkKind::network)] == 0.5 * GB);
  CHECK(r.stages[0].bytes[static_cast<int>(LinkKind::local)] == 1 * GB);
  CHECK(r.seconds == doctest::Approx(0.010));
  w.topo.memcpy_gbps = 8 * 50;  // 50 GB/s: the local copy takes 20 ms
  w.place = RankPlacement(w.topo, w.a, w.b);
  r = simulate_flows(w, {{0, 0, 1, 4.5 * GB}, {0, 6, 6, 1 * GB}});
  CHECK(r.seconds == doctest::Approx(0.020));
  CHECK(r.stages[0].bound_port == Port::memcpy);
}

TEST_CASE("stages run one after another") {
  World w(8, 2, 4);
  w.topo.stage_latency_us = 100;
  w.place = RankPlacement(w.topo, w.a, w.b);
  const auto r = simulate_flows(w, {
      {0, 0, 4, 1 * GB},    // 20 ms over the network
      {1, 4, 5, 4.5 * GB},  // 10 ms over NVLink, after stage 0
  });
  REQUIRE(r.stages.size() == 2);
  CHECK(r.stages[0].seconds == doctest::Approx(0.020 + 100e-6));
  CHECK(r.stages[1].seconds == doctest::Approx(0.010 + 100e-6));
  CHECK(r.seconds == doctest::Approx(0.030 + 200e-6));
  CHECK(r.bound_seconds == doctest::Approx(0.030));
}

namespace {
/// 4 GPUs per node and per NVLink domain, each side on domains of its own.
Topology four_gpu_domains_separate() {
  Topology topo;
  topo.gpus_per_node = 4;
  topo.nvlink_domain = 4;
  topo.placement = PlacementKind::separate;
  return topo;
}
}  // namespace

TEST_CASE("lower bound: a destination domain takes each unique byte once over its NICs") {
  // Source: 2 ranks (tp=2), destination dp=2 x tp=2 = 4 ranks, separate
  // placement with 4-GPU domains: the destination is one domain of 4 GPUs
  // needing all of w once: 1 GB / (4 x 50 GB/s) = 5 ms; the source NICs:
  // 1 GB / (2 x 50 GB/s) = 10 ms (the bound).
  LayoutSpec src_spec = mesh_layout({{"tp", 2}});
  add_tensor(src_spec, "w", {1000, 250000}, {cut({ax(src_spec, "tp")}), {}}, DType::f32);
  Layout src(std::move(src_spec));
  LayoutSpec dst_spec = mesh_layout({{"dp", 2}, {"tp", 2}}, 2);
  add_tensor(dst_spec, "w", {1000, 250000}, {{}, cut({ax(dst_spec, "tp")})}, DType::f32);
  Layout dst(std::move(dst_spec));
  const Topology topo = four_gpu_domains_separate();
  const RankPlacement place(topo, src, dst);
  const auto lb = refit_lower_bound(src, dst, place);
  CHECK(lb.unique_bytes.at(1) == doctest::Approx(1e9));
  CHECK(lb.domain_seconds == doctest::Approx(0.005));
  CHECK(lb.egress_seconds == doctest::Approx(0.010));
  CHECK(lb.group_seconds == doctest::Approx(0.010));  // GPUs 0-1 alone hold w
  CHECK(lb.seconds == doctest::Approx(0.010));
  // Each destination GPU holds half of w, 0.5 GB: 0.5 GB / (50 + 450 GB/s) = 1 ms.
  CHECK(lb.gpu_seconds == doctest::Approx(0.5e9 / 500e9));
  // The hierarchical plan meets the domain's unique bytes exactly.
  const StagedSchedule h = plan_hierarchical(src, dst, place);
  Traffic tr(place);
  add_traffic(tr, h);
  const auto r = simulate(tr);
  double net = 0;
  for (const auto& s : r.stages) net += s.bytes[static_cast<int>(LinkKind::network)];
  CHECK(net == doctest::Approx(1e9));
  CHECK(r.seconds >= lb.seconds);
  // With launch placement the destination shares domain 0 with the source:
  // that domain is left out of the domain term.
  Topology launch = topo;
  launch.placement = PlacementKind::launch;
  const auto lb2 = refit_lower_bound(src, dst, RankPlacement(launch, src, dst));
  CHECK(lb2.skipped_domains == 1);
}

TEST_CASE("FP8 destinations (quant): the simulator and the lower bound take the plan's real wire bytes") {
  // Source dp=2 x tp=2 in bf16 (two replicas of each half); destination
  // dp=2 x tp=2 in block FP8 (128x128 tiles, f32 scales), one 4-GPU domain
  // of its own. Every copy is sender-side: FP8 (1 byte per element) plus 4
  // bytes per tile cross.
  LayoutSpec src_spec = mesh_layout({{"dp", 2}, {"tp", 2}});
  add_tensor(src_spec, "w", {2048, 4096}, {cut({ax(src_spec, "tp")}), {}}, DType::bf16);
  Layout src(std::move(src_spec));
  LayoutSpec dst_spec = mesh_layout({{"dp", 2}, {"tp", 2}}, 4);
  add_tensor(dst_spec, "w", {2048, 4096}, {cut({ax(dst_spec, "tp")}), {}}, DType::fp8e4m3);
  dst_spec.tensors.back().quant = QuantSpec{QuantScheme::block, {128, 128}, "w_scale_inv"};
  add_tensor(dst_spec, "w_scale_inv", {16, 32}, {cut({ax(dst_spec, "tp")}), {}}, DType::f32);
  Layout dst(std::move(dst_spec));
  const double fp8_bytes = 2048.0 * 4096 + 16 * 32 * 4;  // the tensor once, as the wire carries it
  const Topology topo = four_gpu_domains_separate();
  const RankPlacement place(topo, src, dst);
  const auto lb = refit_lower_bound(src, dst, place);
  CHECK(lb.unique_bytes.at(1) == doctest::Approx(fp8_bytes));
  CHECK(lb.egress_seconds == doctest::Approx(fp8_bytes / (4 * topo.nic_bytes_per_s())));
  Schedule s = plan(src, dst);
  CHECK(s.stats.bytes == static_cast<std::int64_t>(2 * fp8_bytes));  // dp=2: each replica takes it once
  // The topology-aware sender choice leaves quantized copies (and their
  // scale copies) on the planner's sender.
  const Schedule before = s;
  prefer_near(s, src, dst, place);
  REQUIRE(s.copies.size() == before.copies.size());
  for (std::size_t i = 0; i < s.copies.size(); ++i) CHECK(s.copies[i].src_rank == before.copies[i].src_rank);
  Traffic tr(place);
  add_traffic(tr, s);
  const auto r = simulate(tr);
  CHECK(r.stages.at(0).bytes[static_cast<int>(LinkKind::network)] == doctest::Approx(2 * fp8_bytes));
  CHECK(r.seconds >= lb.seconds);
}

TEST_CASE("FP8 destinations: the senders' quantizing is charged at quantize_gbps before the transfer, shared on a shared host") {
  // Source tp=4 in bf16, destination tp=2 in block FP8 (128x128 tiles): each
  // source GPU holds a quarter of w (1024 x 4096 elements) and sends it
  // quantized, so each quantizes 4 Mi FP8 bytes; scale copies cost nothing.
  LayoutSpec src_spec = mesh_layout({{"tp", 4}});
  add_tensor(src_spec, "w", {4096, 4096}, {cut({ax(src_spec, "tp")}), {}}, DType::bf16);
  Layout src(std::move(src_spec));
  LayoutSpec dst_spec = mesh_layout({{"tp", 2}}, 4);
  add_tensor(dst_spec, "w", {4096, 4096}, {cut({ax(dst_spec, "tp")}), {}}, DType::fp8e4m3);
  dst_spec.tensors.back().quant = QuantSpec{QuantScheme::block, {128, 128}, "w_scale_inv"};
  add_tensor(dst_spec, "w_scale_inv", {32, 32}, {cut({ax(dst_spec, "tp")}), {}}, DType::f32);
  Layout dst(std::move(dst_spec));
  const Schedule s = plan(src, dst);
  auto run = [&](double quantize_gbps, double cores) {
    Topology topo = four_gpu_domains_separate();
    topo.quantize_gbps = quantize_gbps;
    topo.host_cores = cores;
    const RankPlacement place(topo, src, dst);
    Traffic tr(place);
    add_traffic(tr, s);
    return simulate(tr).stages.at(0);
  };
  const auto free = run(0, 0);
  CHECK(free.quantize_seconds == 0);
  const double each = 1024.0 * 4096;  // FP8 bytes per sender
  const auto st = run(8, 0);           // 1 GB/s of FP8 bytes
  CHECK(st.quantize_seconds == doctest::Approx(each / 1e9));
  CHECK(st.copy_seconds == doctest::Approx(free.copy_seconds + each / 1e9));
  CHECK(st.seconds == doctest::Approx(free.seconds + each / 1e9));
  // Four senders on 2 shared cores take twice as long (every process is a sender or a receiver here).
  CHECK(run(8, 2).quantize_seconds == doctest::Approx(2 * each / 1e9));
  // The JSON form takes the field and refuses a negative one, naming it.
  const Topology j = parse_topology(nlohmann::json::parse(R"({"base": "loopback", "quantize_gbps": 12.5})"), "t.json");
  CHECK(j.quantize_gbps == 12.5);
  CHECK_THROWS_WITH_AS(parse_topology(nlohmann::json::parse(R"({"quantize_gbps": -1})"), "t.json"),
                       doctest::Contains("quantize_gbps"), LayoutError);
}

TEST_CASE("FP8 quantizing as QuantRefit does it: a piece sent to two replicas once, the receivers' where no sender holds a tile") {
  // w 4096 x 4096: bf16 rows cut over the source's tp, block FP8 rows cut
  // over the destination's tp (tiles of tile_rows x 128, scales beside).
  auto bf16_src = [](std::int64_t tp) {
    LayoutSpec spec = mesh_layout({{"tp", tp}});
    add_tensor(spec, "w", {4096, 4096}, {cut({ax(spec, "tp")}), {}}, DType::bf16);
    return Layout(std::move(spec));
  };
  auto fp8_dst = [](std::int64_t dp, std::int64_t first, std::int64_t tile_rows) {
    LayoutSpec spec = mesh_layout({{"dp", dp}, {"tp", 2}}, first);
    add_tensor(spec, "w", {4096, 4096}, {cut({ax(spec, "tp")}), {}}, DType::fp8e4m3);
    spec.tensors.back().quant = QuantSpec{QuantScheme::block, {tile_rows, 128}, "w_scale_inv"};
    add_tensor(spec, "w_scale_inv", {4096 / tile_rows, 32}, {cut({ax(spec, "tp")}), {}}, DType::f32);
    return Layout(std::move(spec));
  };
  Topology topo;
  topo.gpus_per_node = topo.nvlink_domain = 8;
  topo.placement = PlacementKind::separate;
  topo.quantize_gbps = 8;  // 1 GB/s of FP8 bytes
  auto quantize = [&](const Traffic& tr) { return simulate(tr).stages.at(0).quantize_seconds; };
  auto planned = [&](const Layout& src, const Layout& dst, const RankPlacement& place) {
    Traffic tr(place);
    add_traffic(tr, plan(src, dst));
    return tr;
  };
  // tp=4 -> tp=2 (128 x 128 tiles): each sender quantizes its quarter of w,
  // 4 Mi FP8 bytes, before the transfer, once even when two replicas (dp=2)
  // receive it; the streamed traffic (threads' accumulators merged) alike.
  const Layout src4 = bf16_src(4);
  const double quarter = 1024.0 * 4096 / 1e9;
  for (std::int64_t dp : {1, 2}) {
    CAPTURE(dp);
    const Layout dst = fp8_dst(dp, 4, 128);
    const RankPlacement place(topo, src4, dst);
    CHECK(quantize(planned(src4, dst, place)) == doctest::Approx(quarter));
    PlanOptions po;
    po.threads = 2;
    CHECK(quantize(streamed_traffic(src4, dst, place, po, false)) == doctest::Approx(quarter));
    CHECK_THROWS_WITH_AS(streamed_traffic(src4, dst, place, po, true), doctest::Contains("'w' is FP8"), Error);
  }
  // Tiles of 1024 rows over sources of 512 rows: no sender holds a whole
  // tile, so the copies carry bf16 and each receiver quantizes its half of
  // w (8 Mi FP8 bytes) after the transfer.
  const Layout src8 = bf16_src(8), halves = fp8_dst(1, 8, 1024);
  const RankPlacement place(topo, src8, halves);
  const Schedule s = plan(src8, halves);
  CHECK(std::all_of(s.copies.begin(), s.copies.end(), [](const Copy& c) { return c.quant == CopyQuant::receiver; }));
  CHECK(quantize(planned(src8, halves, place)) == doctest::Approx(2048.0 * 4096 / 1e9));
}

TEST_CASE("a delta refit: diff, transfer and scatter overlapped slice by slice, and on a shared host at least its cores' work") {
  // One bf16 tensor of 64 Mi elements (128 MiB) from rank 0 to rank 1, each
  // on a node of its own, at 2.57% changed. By the model's definition: the
  // sender reads weights and shadow and writes the payload, the receiver
  // reads the payload and rewrites the 32-byte sectors holding a change.
  LayoutSpec a = mesh_layout({{"x", 1}});
  add_tensor(a, "w", {8192, 8192}, {{}, {}}, DType::bf16);
  LayoutSpec b = mesh_layout({{"x", 1}}, 1);
  add_tensor(b, "w", {8192, 8192}, {{}, {}}, DType::bf16);
  const Layout src(std::move(a)), dst(std::move(b));
  const Schedule s = plan(src, dst);
  const double F = 0.0257, dense = 8192.0 * 8192 * 2, gbps = 8;
  const double wire = dense * delta::expected_wire_fraction(2, F);
  const double diff = (2 * dense + wire) / (gbps * 1e9);
  const double scatter = (wire + 2 * dense * (1 - std::pow(1 - F, 16.0))) / (gbps * 1e9);
  Topology topo;
  topo.gpus_per_node = topo.nvlink_domain = 1;
  topo.nic_gbps = 0.8;  // 100 MB/s: the transfer (5.1 MB) is the slowest phase
  const RankPlacement place(topo, src, dst);
  const auto one = simulate_delta(s, place, F, gbps, std::int64_t{1} << 40);  // one slice: one after another
  CHECK(one.slices == 1);
  CHECK(one.diff_seconds == doctest::Approx(diff));
  CHECK(one.scatter_seconds == doctest::Approx(scatter));
  CHECK(one.seconds == doctest::Approx(diff + one.transfer.seconds + scatter));
  const auto many = simulate_delta(s, place, F, gbps, std::int64_t{32} << 20);  // 128 MiB in 4 slices
  CHECK(many.slices == 4);
  CHECK(many.transfer.seconds > diff);
  CHECK(many.seconds == doctest::Approx(many.transfer.seconds + (diff + scatter) / 4));
  CHECK(many.host_seconds == 0);
  // Both ranks on one shared core: the diff and the scatter cannot overlap,
  // and the CPU's scatter rewrites 64-byte cache lines (32 elements).
  topo.host_cores = 1;
  topo.nic_gbps = 800;
  const double scatter_cpu = (wire + 2 * dense * (1 - std::pow(1 - F, 32.0))) / (gbps * 1e9);
  const RankPlacement shared(topo, src, dst);
  const auto host = simulate_delta(s, shared, F, gbps, std::int64_t{32} << 20);
  CHECK(host.scatter_seconds == doctest::Approx(scatter_cpu));
  CHECK(host.host_seconds == doctest::Approx(diff + scatter_cpu));
  // The cores' work, then the last slice's transfer and scatter.
  CHECK(host.seconds == doctest::Approx(diff + scatter_cpu + (host.transfer.seconds + scatter_cpu) / 4));
  // The same cores move the payloads: at the host's fabric rate, beside the kernels.
  topo.fabric_gbps = 8;  // 1 GB/s
  const auto moved = simulate_delta(s, RankPlacement(topo, src, dst), F, gbps, std::int64_t{32} << 20);
  CHECK(moved.host_seconds == doctest::Approx(diff + scatter_cpu + wire / 1e9));
  // A slow link on the shared host: the link bounds it again (the first slice's diff, the last one's scatter).
  topo.nic_gbps = 0.08;  // 10 MB/s: 0.5 s for the payload
  const auto link = simulate_delta(s, RankPlacement(topo, src, dst), F, gbps, std::int64_t{32} << 20);
  CHECK(link.transfer.seconds > 0.4);
  CHECK(link.seconds == doctest::Approx(link.transfer.seconds + (diff + scatter_cpu) / 4));
}

TEST_CASE("FP8 on the inference side: decoder linear weights at 1 byte per element plus block scales") {
  LayoutSpec L_spec = mesh_layout({{"tp", 1}});
  add_tensor(L_spec, "model.embed_tokens.weight", {16, 8});
  add_tensor(L_spec, "model.layers.0.self_attn.o_proj.weight", {8, 8});
  add_tensor(L_spec, "model.layers.0.mlp.gate.weight", {4, 8});
  add_tensor(L_spec, "model.layers.0.input_layernorm.weight", {8});
  add_tensor(L_spec, "model.layers.1.mlp.experts.{0..3}.down_proj.weight", {4, 8, 8});
  add_tensor(L_spec, "lm_head.weight", {16, 8});
  Layout L(std::move(L_spec));
  const auto s = fp8_wire_scale(L);
  const double q = (1 + 4.0 / 16384) / 2;
  CHECK(s == std::vector<double>{1, q, 1, 1, q, 1});
}

// ---------------------------------------------------------------------------
// The simulator runs on classes of alike flows (simulate.hpp): against a
// plain reference in which every flow is separate.

namespace {

/// The reference fluid time of one stage: every flow on its own, progressive
/// filling from scratch at every event (O(flows x ports) each), the same 1%
/// retirement rule.
double reference_fluid(const Traffic& tr, std::size_t stage) {
  const Topology& topo = tr.placement().topology();
  std::vector<std::vector<std::string>> ports;  // port names per flow
  std::vector<double> left;
  std::map<std::string, double> cap;
  for (const auto& p : tr.pairs(stage)) {
    if (p.bytes <= 0) continue;
    const auto a = std::to_string(p.src_gpu), b = std::to_string(p.dst_gpu);
    switch (tr.kind(p)) {
      case LinkKind::network:
        ports.push_back({"nic_out" + a, "nic_in" + b});
        cap[ports.back()[0]] = cap[ports.back()[1]] = topo.nic_bytes_per_s();
        if (topo.fabric_gbps > 0) {
          ports.back().push_back("fabric");
          cap["fabric"] = topo.fabric_bytes_per_s();
        }
        break;
      case LinkKind::nvlink:
        ports.push_back({"nvl_out" + a, "nvl_in" + b});
        cap[ports.back()[0]] = cap[ports.back()[1]] = topo.nvlink_bytes_per_s();
        break;
      case LinkKind::local:
        if (topo.memcpy_gbps <= 0) continue;
        ports.push_back({"copy" + a});
        cap[ports.back()[0]] = topo.memcpy_bytes_per_s();
        break;
    }
    left.push_back(p.bytes);
  }
  const std::size_t F = ports.size();
  std::vector<char> done(F, 0);
  double now = 0;
  for (std::size_t alive = F; alive > 0;) {
    // Progressive filling: the port with the smallest fair share fixes its
    // flows at that share; repeat.
    std::vector<double> rate(F, -1);
    std::map<std::string, double> room = cap;
    for (;;) {
      std::map<std::string, int> users;
      for (std::size_t f = 0; f < F; ++f)
        if (!done[f] && rate[f] < 0)
          for (const auto& q : ports[f]) ++users[q];
      if (users.empty()) break;
      std::string best;
      double share = 0;
      for (const auto& [q, n] : users)
        if (best.empty() || room[q] / n < share) {
          best = q;
          share = room[q] / n;
        }
      for (std::size_t f = 0; f < F; ++f)
        if (!done[f] && rate[f] < 0 && std::find(ports[f].begin(), ports[f].end(), best) != ports[f].end()) {
          rate[f] = share;
          for (const auto& q : ports[f]) room[q] -= share;
        }
    }
    double first = 1e300;
    for (std::size_t f = 0; f < F; ++f)
      if (!done[f]) first = std::min(first, left[f] / rate[f]);
    double step = first;
    for (std::size_t f = 0; f < F; ++f)
      if (!done[f] && left[f] / rate[f] <= first + 0.01 * (now + first)) step = std::max(step, left[f] / rate[f]);
    for (std::size_t f = 0; f < F; ++f) {
      if (done[f]) continue;
      if (left[f] / rate[f] <= step * (1 + 1e-12)) {
        done[f] = 1;
        --alive;
      } else {
        left[f] -= rate[f] * step;
      }
    }
    now += step;
  }
  return now;
}

}  // namespace

TEST_CASE("classes of alike flows: the same times as every flow simulated on its own (random traffic)") {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 60; ++trial) {
    World w(16, 2, 4);
    if (trial % 3 == 1) w.topo.fabric_gbps = 400 * 6;  // a fabric tighter than the NICs together
    if (trial % 4 == 2) w.topo.memcpy_gbps = 8 * 100;
    w.place = RankPlacement(w.topo, w.a, w.b);
    Traffic tr(w.place);
    const int n = 1 + static_cast<int>(rng() % 60);
    // Bytes from a small set (so alike flows exist) or arbitrary.
    const bool round_bytes = trial % 2 == 0;
    for (int i = 0; i < n; ++i) {
      const auto stage = static_cast<std::int32_t>(rng() % 2);
      const auto s = static_cast<std::int64_t>(rng() % 16), d = static_cast<std::int64_t>(rng() % 16);
      const double bytes = round_bytes ? static_cast<double>(1 + rng() % 3) * 0.25 * GB
                                       : std::uniform_real_distribution<double>(0.01, 2)(rng) * GB;
      tr.add(stage, s, d, bytes);
    }
    const auto r = simulate(tr);
    REQUIRE(r.stages.size() == tr.stages());
    for (std::size_t s = 0; s < tr.stages(); ++s) {
      const double ref = reference_fluid(tr, s);
      CAPTURE(trial);
      CAPTURE(s);
      CHECK(r.stages[s].fluid_seconds == doctest::Approx(ref).epsilon(1e-9));
      CHECK(r.stages[s].classes <= r.stages[s].flows);
    }
  }
}

TEST_CASE("dense random traffic over many events: the same times as the reference") {
  // Up to 240 GPU pairs per stage with distinct bytes: hundreds of events,
  // so retired flows are packed away and port lists compacted many times
  // (fluid_time), with and without a fabric, one shared source group.
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 6; ++trial) {
    World w(16, 2, 4);
    if (trial % 2 == 1) w.topo.fabric_gbps = 400 * 5;
    if (trial % 3 == 2) w.topo.memcpy_gbps = 8 * 100;
    w.place = RankPlacement(w.topo, w.a, w.b);
    Traffic tr(w.place);
    for (int i = 0; i < 320; ++i) {
      const auto s = static_cast<std::int64_t>(rng() % (trial < 3 ? 16 : 5)), d = static_cast<std::int64_t>(rng() % 16);
      tr.add(0, s, d, std::uniform_real_distribution<double>(0.001, 1)(rng) * GB);
    }
    const auto r = simulate(tr);
    CAPTURE(trial);
    CHECK(r.stages[0].events > 20);
    CHECK(r.stages[0].fluid_seconds == doctest::Approx(reference_fluid(tr, 0)).epsilon(1e-9));
  }
}

TEST_CASE("many identical flows collapse to one class with the exact time") {
  // 64 source GPUs (one per domain) each send 0.1 GB to each of 32
  // destination GPUs: every NIC egress carries 3.2 GB (64 ms), every
  // ingress 6.4 GB: 128 ms. All 2048 flows are alike: one class.
  World w(96, 1, 1);
  Traffic tr(w.place);
  for (std::int64_t s = 0; s < 64; ++s)
    for (std::int64_t d = 64; d < 96; ++d) tr.add(0, s, d, 0.1 * GB);
  const auto r = simulate(tr);
  CHECK(r.stages[0].flows == 64 * 32);
  CHECK(r.stages[0].classes == 1);
  CHECK(r.stages[0].port_classes == 2);
  CHECK(r.stages[0].fluid_seconds == doctest::Approx(0.128).epsilon(1e-12));
  CHECK(r.stages[0].fluid_seconds == doctest::Approx(reference_fluid(tr, 0)).epsilon(1e-12));
  // Two kinds of destinations: 16 take 0.1 GB from each source, 16 take
  // 0.3 GB. The egress of a source (6.4 GB: 128 ms) is shared by 32 flows;
  // ingress of the small ones 6.4 GB, big ones 19.2 GB (384 ms): the big
  // flows are held by their ingress at 50/64 GB/s each, the small ones get
  // the rest of the egress: (50 - 16 x 50/64) / 16 each, and finish first;
  // then the big flows are still ingress-bound. Total: 384 ms.
  Traffic t2(w.place);
  for (std::int64_t s = 0; s < 64; ++s)
    for (std::int64_t d = 64; d < 96; ++d) t2.add(0, s, d, (d < 80 ? 0.1 : 0.3) * GB);
  const auto r2 = simulate(t2);
  CHECK(r2.stages[0].classes == 2);
  CHECK(r2.stages[0].port_classes == 3);
  CHECK(r2.stages[0].fluid_seconds == doctest::Approx(0.384).epsilon(1e-12));
  CHECK(r2.stages[0].fluid_seconds == doctest::Approx(reference_fluid(t2, 0)).epsilon(1e-12));
  // One odd flow breaks the symmetry only around itself: more classes, the
  // same time as the reference.
  t2.add(0, 0, 64, 0.05 * GB);
  const auto r3 = simulate(t2);
  CHECK(r3.stages[0].classes > 2);
  CHECK(r3.stages[0].classes < 64 * 32 / 4);
  CHECK(r3.stages[0].fluid_seconds == doctest::Approx(reference_fluid(t2, 0)).epsilon(1e-12));
}

TEST_CASE("Traffic::merge sums the pairs of two halves") {
  World w(8, 2, 4);
  Traffic a(w.place), b(w.place), whole(w.place);
  std::mt19937_64 rng(3);
  for (int i = 0; i < 40; ++i) {
    const auto s = static_cast<std::int64_t>(rng() % 8), d = static_cast<std::int64_t>(rng() % 8);
    const double bytes = static_cast<double>(1 + rng() % 1000);
    const auto stage = static_cast<std::int32_t>(rng() % 3);
    (i % 2 ? a : b).add(stage, s, d, bytes);
    whole.add(stage, s, d, bytes);
  }
  a.merge(b);
  check_same_traffic(a, whole);
}

// ---------------------------------------------------------------------------
// The streamed traffic (stream_traffic.hpp) equals the traffic of the
// materialized plan, with and without the near sender choice.

TEST_CASE("streamed traffic equals the traffic of plan() and of plan() + prefer_near()") {
  std::vector<Topology> topos(3);
  topos[0].gpus_per_node = 2, topos[0].nvlink_domain = 4, topos[0].placement = PlacementKind::separate;
  topos[1].gpus_per_node = 1, topos[1].nvlink_domain = 3, topos[1].placement = PlacementKind::launch;
  topos[2].gpus_per_node = 4, topos[2].nvlink_domain = 8, topos[2].placement = PlacementKind::separate;
  std::int64_t moved_total = 0, copies_total = 0;
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    const auto pair = testgen::random_layout_pair(seed);
    const RankPlacement place(topos[seed % topos.size()], pair.src, pair.dst);
    CAPTURE(seed);
    PlanOptions po;
    po.split_bytes = seed % 2 ? 64 : (std::int64_t{1} << 40);
    Schedule s = plan(pair.src, pair.dst, po);
    Traffic plain(place);
    add_traffic(plain, s);
    Schedule near = s;
    const std::int64_t moved = prefer_near(near, pair.src, pair.dst, place);
    Traffic with_near(place);
    add_traffic(with_near, near);
    for (int threads : {1, 3}) {
      po.threads = threads;
      CAPTURE(threads);
      StreamReport rep;
      INFO("without the near choice");
      check_same_traffic(streamed_traffic(pair.src, pair.dst, place, po, false, nullptr, &rep), plain);
      CHECK(rep.copies == static_cast<std::int64_t>(s.copies.size()));
      INFO("with the near choice");
      check_same_traffic(streamed_traffic(pair.src, pair.dst, place, po, true, nullptr, &rep), with_near);
      CHECK(rep.copies == static_cast<std::int64_t>(s.copies.size()));
      CHECK(rep.near_bytes == moved);
    }
    moved_total += moved;
    copies_total += static_cast<std::int64_t>(s.copies.size());
  }
  CHECK(moved_total > 0);  // the near choice did change senders somewhere
  CHECK(copies_total > 0);
}

TEST_CASE("streamed traffic with the near choice equals prefer_near() on Kimi-K2 (96 GPUs)") {
  // Thousands of copies choosing among replica groups of 8 (dense layers)
  // and 1 (experts): the tournament trees against prefer_near's scan.
  const std::string dir = std::string(__FILE__).substr(0, std::string(__FILE__).rfind('/'));
  presets::PresetOptions popt;
  const auto m = presets::model_layouts(dir + "/../examples/models/kimi-k2.json", "tp=1,pp=8,dp=8,ep=8",
                                        "tp=8,dp=4,ep=32", popt);
  Topology topo = load_topology("h200-8x400g");
  topo.placement = PlacementKind::separate;
  const RankPlacement place(topo, m.train, m.infer);
  PlanOptions po;
  Schedule s = plan(m.train, m.infer, po);
  const std::int64_t moved = prefer_near(s, m.train, m.infer, place);
  Traffic want(place);
  add_traffic(want, s);
  po.threads = 2;
  StreamReport rep;
  const Traffic got = streamed_traffic(m.train, m.infer, place, po, true, nullptr, &rep);
  check_same_traffic(got, want);
  CHECK(rep.near_bytes == moved);
  CHECK(moved > 0);
  CHECK(rep.copies == static_cast<std::int64_t>(s.copies.size()));
}

namespace {

/// Messages the executor sends for a schedule (in-process transport, dense
/// buffers), all ranks together.
std::int64_t executor_messages(const Layout& src, const Layout& dst, const Schedule& s, const ExecutorOptions& opt) {
  refit_test::DenseWorld dw(src, dst);
  std::vector<std::int64_t> sent(dw.ranks.size(), 0);
  std::int64_t wrong = 0;
  std::mutex m;
  dw.run(src, dst, [&](LocalTransport& t, std::size_t i, auto sb, auto db) {
    Executor<LocalTransport> ex;
    ex.setup(s, sb, db, t, opt);
    sent[i] = ex.run().messages_sent;
    const auto w = refit_test::count_wrong(dst, dw.dst_mem[i], t.rank(), 0, nullptr);
    std::lock_guard lk(m);
    wrong += w;
  });
  CHECK(wrong == 0);
  std::int64_t n = 0;
  for (auto x : sent) n += x;
  return n;
}

}  // namespace

TEST_CASE("messages: the simulator counts what the executor sends (random layout pairs)") {
  // The same rule (message_rule.hpp) on both sides: exact within the
  // staging budget, and over it when no pair has copies staged on one side
  // only; with those, an estimate (their order is not in the sums).
  struct Config {
    std::string what;
    std::int64_t budget, zero_copy_min;
    bool exact;
  };
  const Config configs[] = {
      {"defaults", kDefaultStagingBudget, kDefaultZeroCopyMin, true},
      {"small zero_copy_min: every form", kDefaultStagingBudget, 64, true},
      {"small budget, all packed: waves", 1024, std::int64_t{1} << 40, true},
      {"small budget, every form: waves", 1024, 64, false},
  };
  for (const auto& cfg : configs) {
    CAPTURE(cfg.what);
    std::int64_t got_total = 0, want_total = 0, multi = 0;
    for (std::uint64_t seed = 1; seed <= 30; ++seed) {
      const auto pair = testgen::random_layout_pair(seed);
      CAPTURE(seed);
      Topology topo;
      topo.staging_budget = cfg.budget;
      topo.zero_copy_min = cfg.zero_copy_min;
      const RankPlacement place(topo, pair.src, pair.dst);
      const Schedule s = plan(pair.src, pair.dst);
      Traffic tr(place);
      add_traffic(tr, s);
      std::int64_t predicted = 0;
      for (const auto& st : simulate(tr).stages) predicted += st.messages;
      ExecutorOptions opt;
      opt.staging_budget = cfg.budget;
      opt.zero_copy_min = cfg.zero_copy_min;
      const std::int64_t sent = executor_messages(pair.src, pair.dst, s, opt);
      if (cfg.exact) CHECK(predicted == sent);
      multi += sent > predicted || sent < predicted;
      got_total += sent;
      want_total += predicted;
    }
    MESSAGE(cfg.what, ": executor ", got_total, " messages, simulator ", want_total, " (", multi, " of 30 pairs differ)");
    CHECK(got_total > 0);
    CHECK(static_cast<double>(want_total) == doctest::Approx(static_cast<double>(got_total)).epsilon(0.05));
  }
}

TEST_CASE("messages of staged refits: the simulator splits the staging budget among the stages as the staged executor does") {
  // A small budget, everything packed: exact for one stage (above), so any
  // difference here is how the stages share the budget.
  constexpr std::int64_t kBudget = 8192, kAllPacked = std::int64_t{1} << 40;
  int staged = 0;
  for (std::uint64_t seed = 1; seed <= 30; ++seed) {
    const auto pair = testgen::random_layout_pair(seed + 900);
    CAPTURE(seed);
    Topology topo;
    topo.gpus_per_node = 2;
    topo.nvlink_domain = 2;
    topo.placement = PlacementKind::separate;
    topo.staging_budget = kBudget;
    topo.zero_copy_min = kAllPacked;
    const RankPlacement place(topo, pair.src, pair.dst);
    const StagedSchedule h = plan_hierarchical(pair.src, pair.dst, place);
    if (h.stages < 2) continue;
    ++staged;
    Traffic tr(place);
    add_traffic(tr, h);
    std::int64_t predicted = 0;
    for (const auto& st : simulate(tr).stages) predicted += st.messages;
    ExecutorOptions opt;
    opt.staging_budget = kBudget;
    opt.zero_copy_min = kAllPacked;
    refit_test::DenseWorld dw(pair.src, pair.dst);
    std::vector<std::int64_t> sent(dw.ranks.size(), 0);
    dw.run(pair.src, pair.dst, [&](LocalTransport& t, std::size_t i, auto sb, auto db) {
      StagedExecutor<LocalTransport> ex;
      ex.setup(h, sb, db, t, opt);
      sent[i] = ex.run(1).messages_sent;
    });
    std::int64_t total = 0;
    for (auto x : sent) total += x;
    CHECK(predicted == total);
  }
  CHECK(staged >= 10);
}
