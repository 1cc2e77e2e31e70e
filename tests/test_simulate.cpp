// The refit simulator against hand-computed cases: one flow, shared ports,
// max-min fair sharing with a flow finishing early, NVLink vs network vs
// local, message latency, stages in sequence; the lower bound of a small
// refit; FP8 wire bytes.
#include <doctest/doctest.h>

#include "plan_test_util.hpp"
#include "reshard/simulate.hpp"

using namespace reshard;
using namespace plantest;

namespace {

/// Ranks 0..n-1 on GPUs 0..n-1 (two layouts of n ranks each, colocated).
struct World {
  Layout a, b;
  Topology topo;
  RankPlacement place;
  World(std::int64_t n, std::int64_t per_node, std::int64_t domain) {
    a = mesh_layout({{"x", n}});
    add_tensor(a, "t", {n}, {cut({ax(a, "x")})});
    a.validate();
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

}  // namespace

TEST_CASE("one network flow: bytes over the NIC rate, plus latency") {
  World w(4, 1, 1);
  Traffic tr(w.place);
  tr.add(0, 0, 1, 1 * GB);
  auto r = simulate(tr);
  CHECK(r.seconds == doctest::Approx(0.020));
  CHECK(r.stages.at(0).bound_port == Port::nic_out);
  CHECK(r.stages[0].bytes[static_cast<int>(LinkKind::network)] == 1 * GB);
  // With latency: one message per 256 MiB, paid by sender and receiver.
  w.topo.latency_us = 100;
  w.topo.stage_latency_us = 50;
  w.place = RankPlacement(w.topo, w.a, w.b);
  Traffic t2(w.place);
  t2.add(0, 0, 1, 1 * GB);
  r = simulate(t2);
  const double msgs = std::ceil(1e9 / (256.0 * 1024 * 1024));  // 4
  CHECK(r.stages[0].messages == 4);
  CHECK(r.seconds == doctest::Approx(0.020 + msgs * 100e-6 + 50e-6));
}

TEST_CASE("two sources into one GPU share its NIC ingress") {
  World w(4, 1, 1);
  Traffic tr(w.place);
  tr.add(0, 0, 2, 1 * GB);
  tr.add(0, 1, 2, 1 * GB);
  const auto r = simulate(tr);
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
  Traffic tr(w.place);
  tr.add(0, 0, 2, 2 * GB);
  tr.add(0, 1, 2, 1 * GB);
  tr.add(0, 1, 3, 2 * GB);
  const auto r = simulate(tr);
  CHECK(r.seconds == doctest::Approx(0.060));
  CHECK(r.stages[0].events == 2);
  // A and D: 0->1 4 GB alone on its ports, E: 2->3 1 GB: 80 ms (the longest).
  Traffic t2(w.place);
  t2.add(0, 0, 1, 4 * GB);
  t2.add(0, 2, 3, 1 * GB);
  CHECK(simulate(t2).seconds == doctest::Approx(0.080));
}

TEST_CASE("ports shared at both ends of a flow") {
  // F1: 0->1 3 GB, F2: 0->2 1 GB, F3: 3->2 3 GB. Ports: GPU 0 egress (F1,F2)
  // 4 GB, GPU 2 ingress (F2,F3) 4 GB: bound 80 ms. Max-min: all 25 GB/s;
  // F2 ends at 40 ms (1 GB); F1 and F3 have 2 GB left at 50 GB/s: +40 ms = 80 ms.
  World w(4, 1, 1);
  Traffic tr(w.place);
  tr.add(0, 0, 1, 3 * GB);
  tr.add(0, 0, 2, 1 * GB);
  tr.add(0, 3, 2, 3 * GB);
  const auto r = simulate(tr);
  CHECK(r.stages[0].bound_seconds == doctest::Approx(0.080));
  CHECK(r.seconds == doctest::Approx(0.080));
  // Now F1 3 GB and F2 3 GB share GPU 0 egress (120 ms at 25 each), F3 1 GB
  // into GPU 2 shares with F2: F3 gets 25 until 40 ms... max-min gives F2
  // min(25 at egress, 25 at ingress) = 25, F3 = 25, F1 = 25; F3 ends at
  // 40 ms; F2 still limited to 25 by GPU 0 egress (F1 also 25): 3 GB at
  // 25 GB/s = 120 ms. Bound: egress 6 GB = 120 ms.
  Traffic t2(w.place);
  t2.add(0, 0, 1, 3 * GB);
  t2.add(0, 0, 2, 3 * GB);
  t2.add(0, 3, 2, 1 * GB);
  CHECK(simulate(t2).seconds == doctest::Approx(0.120));
}

TEST_CASE("NVLink inside a domain, the NIC between domains, local copies at the copy rate") {
  World w(8, 2, 4);  // domains {0-3}, {4-7}
  Traffic tr(w.place);
  tr.add(0, 0, 1, 4.5 * GB);  // NVLink, 450 GB/s: 10 ms
  tr.add(0, 2, 5, 0.5 * GB);  // network: 10 ms
  tr.add(0, 6, 6, 1 * GB);    // local: free (memcpy_gbps 0)
  auto r = simulate(tr);
  CHECK(r.stages[0].bytes[static_cast<int>(LinkKind::nvlink)] == 4.5 * GB);
  CHECK(r.stages[0].bytes[static_cast<int>(LinkKind::network)] == 0.5 * GB);
  CHECK(r.stages[0].bytes[static_cast<int>(LinkKind::local)] == 1 * GB);
  CHECK(r.seconds == doctest::Approx(0.010));
  w.topo.memcpy_gbps = 8 * 50;  // 50 GB/s: the local copy takes 20 ms
  w.place = RankPlacement(w.topo, w.a, w.b);
  Traffic t2(w.place);
  t2.add(0, 0, 1, 4.5 * GB);
  t2.add(0, 6, 6, 1 * GB);
  r = simulate(t2);
  CHECK(r.seconds == doctest::Approx(0.020));
  CHECK(r.stages[0].bound_port == Port::memcpy);
}

TEST_CASE("stages run one after another") {
  World w(8, 2, 4);
  w.topo.stage_latency_us = 100;
  w.place = RankPlacement(w.topo, w.a, w.b);
  Traffic tr(w.place);
  tr.add(0, 0, 4, 1 * GB);    // 20 ms over the network
  tr.add(1, 4, 5, 4.5 * GB);  // 10 ms over NVLink, after stage 0
  const auto r = simulate(tr);
  REQUIRE(r.stages.size() == 2);
  CHECK(r.stages[0].seconds == doctest::Approx(0.020 + 100e-6));
  CHECK(r.stages[1].seconds == doctest::Approx(0.010 + 100e-6));
  CHECK(r.seconds == doctest::Approx(0.030 + 200e-6));
  CHECK(r.bound_seconds == doctest::Approx(0.030));
}

TEST_CASE("lower bound: a destination domain takes each unique byte once over its NICs") {
  // Source: 2 ranks (tp=2), destination dp=2 x tp=2 = 4 ranks, separate
  // placement with 4-GPU domains: the destination is one domain of 4 GPUs
  // needing all of w once: 1 GB / (4 x 50 GB/s) = 5 ms; the source NICs:
  // 1 GB / (2 x 50 GB/s) = 10 ms (the bound).
  Layout src = mesh_layout({{"tp", 2}});
  add_tensor(src, "w", {1000, 250000}, {cut({ax(src, "tp")}), {}}, DType::f32);
  src.validate();
  Layout dst = mesh_layout({{"dp", 2}, {"tp", 2}}, 2);
  add_tensor(dst, "w", {1000, 250000}, {{}, cut({ax(dst, "tp")})}, DType::f32);
  dst.validate();
  Topology topo;
  topo.gpus_per_node = 4;
  topo.nvlink_domain = 4;
  topo.placement = PlacementKind::separate;
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

TEST_CASE("FP8 on the inference side: decoder linear weights at 1 byte per element plus block scales") {
  Layout L = mesh_layout({{"tp", 1}});
  add_tensor(L, "model.embed_tokens.weight", {16, 8});
  add_tensor(L, "model.layers.0.self_attn.o_proj.weight", {8, 8});
  add_tensor(L, "model.layers.0.mlp.gate.weight", {4, 8});
  add_tensor(L, "model.layers.0.input_layernorm.weight", {8});
  add_tensor(L, "model.layers.1.mlp.experts.{0..3}.down_proj.weight", {4, 8, 8});
  add_tensor(L, "lm_head.weight", {16, 8});
  L.validate();
  const auto s = fp8_wire_scale(L);
  const double q = (1 + 4.0 / 16384) / 2;
  CHECK(s == std::vector<double>{1, q, 1, 1, q, 1});
}
