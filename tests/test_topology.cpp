// Topology presets, the JSON form and its errors, and where ranks land
// (launch order, separate sides, an explicit list).
#include <doctest/doctest.h>

#include "plan_test_util.hpp"
#include "reshard/plan/topology.hpp"

using namespace reshard;
using namespace plantest;

namespace {

std::string error_of(const std::string& text) {
  try {
    parse_topology(nlohmann::json::parse(text), "t.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

Layout side(std::int64_t n, std::int64_t first) {
  LayoutSpec L = mesh_layout({{"tp", n}}, first);
  add_tensor(L, "w", {n}, {cut({ax(L, "tp")})});
  return Layout(std::move(L));
}

}  // namespace

TEST_CASE("presets") {
  for (const auto& n : topology_preset_names()) {
    const auto t = topology_preset(n);
    REQUIRE(t);
    CHECK_NOTHROW(t->validate());
  }
  const auto gb = *topology_preset("gb200-nvl72");
  CHECK(gb.nvlink_domain == 72);
  CHECK(gb.gpus_per_node == 4);
  CHECK(gb.nic_bytes_per_s() == doctest::Approx(50e9));
  CHECK(gb.nvlink_bytes_per_s() == doctest::Approx(900e9));
  const auto h = *topology_preset("h100-8x400g");
  CHECK(h.nvlink_domain == 8);
  CHECK(h.domain_of_gpu(15) == 1);
  CHECK(h.node_of_gpu(7) == 0);
  CHECK_FALSE(topology_preset("h100-8x200g"));
  // The executor's message options by default; only loopback shares a host.
  CHECK(h.staging_budget == kDefaultStagingBudget);
  CHECK(h.zero_copy_min == kDefaultZeroCopyMin);
  CHECK(h.host_cores == 0);
  CHECK(gb.host_cores == 0);
  CHECK(topology_preset("loopback")->host_cores == 2);
  // Cluster NICs keep many messages in flight; the loopback fit measured them one after another.
  CHECK(h.messages_in_flight == kRdmaMessagesInFlight);
  CHECK(gb.messages_in_flight == kRdmaMessagesInFlight);
  CHECK(topology_preset("loopback")->messages_in_flight == 1);
  CHECK(Topology{}.messages_in_flight == 1);
  CHECK_THROWS_WITH_AS(load_topology("no-such-topology"), doctest::Contains("neither a preset"), Error);
}

TEST_CASE("JSON form: a base preset with overrides") {
  const auto t = parse_topology(nlohmann::json::parse(
                                    R"({"base": "h100-8x400g", "name": "slow", "nic_gbps": 200, "latency_us": 8,
                                        "placement": "separate"})"),
                                "t.json");
  CHECK(t.name == "slow");
  CHECK(t.gpus_per_node == 8);
  CHECK(t.nic_bytes_per_s() == doctest::Approx(25e9));
  CHECK(t.latency_us == 8);
  CHECK(t.placement == PlacementKind::separate);
  const auto m = parse_topology(nlohmann::json::parse(R"({"base": "loopback", "host_cores": 16, "staging_budget": 1048576,
                                                          "zero_copy_min": 4096, "messages_in_flight": 4,
                                                          "staging_copy_gbps": 80, "staging_run_ns": 50})"),
                                "t.json");
  CHECK(m.host_cores == 16);
  CHECK(m.messages_in_flight == 4);
  CHECK(m.staging_copy_gbps == 80);
  CHECK(m.staging_run_ns == 50);
  CHECK(topology_preset("h100-8x400g")->staging_copy_gbps == 0);  // cluster GPUs: free
  CHECK(m.staging_budget == 1048576);
  CHECK(m.zero_copy_min == 4096);
  CHECK(m.fabric_gbps == topology_preset("loopback")->fabric_gbps);
  const auto e = parse_topology(nlohmann::json::parse(R"({"gpus_per_node": 2, "nvlink_domain": 2, "rank_gpus": [3, 2, 1, 0]})"),
                                "t.json");
  CHECK(e.placement == PlacementKind::explicit_gpus);
}

TEST_CASE("JSON errors name the file and the field") {
  CHECK(error_of(R"({"nic_gbps": "fast"})").find("t.json: nic_gbps: expected a number") != std::string::npos);
  CHECK(error_of(R"({"nic_gbps": 0})").find("nic_gbps: 0 must be a positive number") != std::string::npos);
  CHECK(error_of(R"({"gpus_per_node": 8, "nvlink_domain": 12})").find("nvlink_domain: an NVLink domain of 12 GPUs") !=
        std::string::npos);
  CHECK(error_of(R"({"gpus_per_node": 2.5})").find("gpus_per_node: expected an integer") != std::string::npos);
  CHECK(error_of(R"({"nics": 8})").find("nics: unknown field") != std::string::npos);
  CHECK(error_of(R"({"base": "dgx"})").find("base: unknown preset 'dgx'") != std::string::npos);
  CHECK(error_of(R"({"placement": "random"})").find("placement: 'random' is not one of") != std::string::npos);
  CHECK(error_of(R"({"rank_gpus": [0, 1, 1]})").find("rank_gpus: GPU 1 is given to two ranks") != std::string::npos);
  CHECK(error_of(R"({"rank_gpus": [0, "a"]})").find("rank_gpus[1]: expected an integer") != std::string::npos);
  CHECK(error_of(R"({"placement": "gpus"})").find("rank_gpus: placement \"gpus\" needs") != std::string::npos);
  CHECK(error_of(R"({"latency_us": -1})").find("latency_us: -1 must be >= 0") != std::string::npos);
  CHECK(error_of(R"({"host_cores": -2})").find("host_cores: -2 must be >= 0") != std::string::npos);
  CHECK(error_of(R"({"staging_copy_gbps": -1})").find("staging_copy_gbps: -1 must be >= 0") != std::string::npos);
  CHECK(error_of(R"({"staging_run_ns": "x"})").find("staging_run_ns: expected a number") != std::string::npos);
  CHECK(error_of(R"({"messages_in_flight": 0})").find("messages_in_flight: 0 must be >= 1") != std::string::npos);
  CHECK(error_of(R"({"messages_in_flight": 2.5})").find("messages_in_flight: expected an integer") != std::string::npos);
  CHECK(error_of(R"({"staging_budget": 8})").find("staging_budget: 8 must be >= 64") != std::string::npos);
  CHECK(error_of(R"({"zero_copy_min": 1.5})").find("zero_copy_min: expected an integer") != std::string::npos);
  CHECK(error_of(R"({"message_bytes": 1024})").find("message_bytes: unknown field") != std::string::npos);
  CHECK(error_of(R"([1, 2])").find("a topology is a JSON object") != std::string::npos);
}

TEST_CASE("placement: launch order, separate sides, explicit lists, colocated ranks") {
  const Layout src = side(6, 0), dst = side(4, 6), colo = side(4, 0);
  Topology t;
  t.gpus_per_node = 2;
  t.nvlink_domain = 4;
  {
    const RankPlacement p(t, src, dst);  // launch: GPU = rank
    CHECK(p.gpu(7) == 7);
    CHECK(p.node(7) == 3);
    CHECK(p.domain(5) == 1);
    CHECK(p.domain(6) == 1);  // the seam: source 4-5 and destination 6-7 share domain 1
    CHECK_THROWS_WITH_AS(p.gpu(10), doctest::Contains("rank 10 is in neither layout"), Error);
  }
  {
    t.placement = PlacementKind::separate;  // destination from the next domain boundary
    const RankPlacement p(t, src, dst);
    CHECK(p.gpu(5) == 5);
    CHECK(p.gpu(6) == 8);
    CHECK(p.gpu(9) == 11);
    CHECK(p.domain(6) == 2);
    const RankPlacement c(t, src, colo);  // colocated ranks stay on their source GPU
    CHECK(c.gpu(3) == 3);
  }
  {
    t.placement = PlacementKind::explicit_gpus;
    t.rank_gpus = {9, 8, 7, 6, 5, 4, 3, 2, 1, 0};
    const RankPlacement p(t, src, dst);
    CHECK(p.gpu(0) == 9);
    CHECK(p.domain(0) == 2);
    t.rank_gpus.resize(8);
    CHECK_THROWS_WITH_AS(RankPlacement(t, src, dst), doctest::Contains("lists 8 ranks but the layouts use rank 8"), Error);
  }
}
