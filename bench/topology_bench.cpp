// topology-bench: how planning and simulating a refit grows with the cluster.
//   topology-bench [--model CONFIG] [--topology NAME|FILE] [--sizes DP,DP,...]
//                  [--hierarchical] [--infer-tp N] [--pp N] [--ep-per-stage N] [--split-bytes B]
//                  [--stream auto|on|off] [--threads N] [--per-expert]
// For each training dp in --sizes: Megatron tp=1, pp=PP, dp=DP, ep=min(E, DP)
// (E = --ep-per-stage) training ranks, and vLLM tp=T, dp=DP*PP/(2*T),
// ep=dp*tp inference ranks (half as many, as in the Kimi-K2 anchor: 256 -> 128),
// with grouped experts; it times building the layouts, planning (direct, or
// hierarchical), summing the traffic and simulating it, and prints one JSON
// line per size (ranks, tensors, copies, seconds per phase, peak RSS).
// --stream: build the traffic from plan_each_destination() without keeping
// the schedule (stream_traffic.hpp; auto: from 4096 ranks on, as the whole
// plan of a 10,000-GPU refit may not fit in memory); the near sender choice
// still applies, over 24-byte records. --hierarchical needs the whole plan.
// --per-expert: one tensor per expert (3 x 384 per MoE layer for Kimi-K2)
// instead of grouped experts, to see how the cost grows with tensors.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "reshard/plan/hierarchical.hpp"
#include "reshard/plan/plan.hpp"
#include "reshard/plan/topology.hpp"
#include "reshard/presets/presets.hpp"
#include "reshard/sim/simulate.hpp"
#include "reshard/sim/stream_traffic.hpp"
#include "reshard_support/clocks.hpp"
#include "model_options.hpp"

using namespace reshard;

using reshard::clocks::cpu_seconds;
using reshard::clocks::peak_rss_gb;
using reshard::clocks::seconds_since;

int main(int argc, char** argv) {
  CLI::App app{"Times planning and simulating refits at growing cluster sizes", "topology-bench"};
  ModelBenchOptions mo(1, "examples/models/kimi-k2.json");
  std::string topology = "h200-8x400g", sizes = "32,64,128";
  bool hierarchical = false;
  std::string stream = "auto";
  int infer_tp = 8, pp = 8, ep_stage = 32;
  std::int64_t split_bytes = std::int64_t{1} << 62;
  mo.add_to(app);
  app.add_option("--topology", topology, "topology preset or file");
  app.add_option("--sizes", sizes, "training dp values, comma separated (training ranks = dp * pp)");
  app.add_option("--infer-tp", infer_tp, "inference tp");
  app.add_option("--pp", pp, "training pipeline stages");
  app.add_option("--ep-per-stage", ep_stage, "training ep (capped at dp)");
  app.add_option("--split-bytes", split_bytes, "planner: cut replicated pieces of at least this size into one slab per replica");
  app.add_flag("--hierarchical", hierarchical, "plan hierarchically (else the direct plan, topology-aware)");
  app.add_option("--stream", stream, "stream the plan into the traffic: auto (from 4096 ranks), on, off")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  CLI11_PARSE(app, argc, argv);
  try {
    std::vector<int> dps;
    std::stringstream ss(sizes);
    for (std::string item; std::getline(ss, item, ',');) dps.push_back(std::stoi(item));
    for (int dp : dps) {
      const int ep = std::min(ep_stage, dp);
      const int infer_world = dp * pp / 2;
      const int infer_dp = infer_world / infer_tp;
      const std::string train = fmt::format("tp=1,pp={},dp={},ep={}", pp, dp, ep);
      const std::string infer = fmt::format("tp={},dp={},ep={}", infer_tp, infer_dp, infer_tp * infer_dp);
      auto t0 = std::chrono::steady_clock::now();
      auto m = presets::model_layouts(mo.model, train, infer, mo.presets());
      const double layouts_s = seconds_since(t0);
      Topology topo = load_topology(topology);
      topo.placement = PlacementKind::separate;
      const RankPlacement place(topo, m.train, m.infer);
      const std::int64_t ranks = m.train_world + m.infer_world;
      const bool streamed = stream == "on" || (stream == "auto" && ranks >= 4096 && !hierarchical);
      if (streamed && hierarchical) fail("--hierarchical needs the whole plan: use --stream off");
      PlanOptions po = mo.plan();
      po.split_bytes = split_bytes;
      po.balance_limit = 0;  // as reshard-plan --topology: SenderChoice balances the senders
      Traffic tr(place);
      std::int64_t copies = 0, stages = 1;
      double plan_s = 0, near_s = 0, traffic_s = 0, record_gb = 0;
      if (streamed) {
        StreamReport rep;
        tr = streamed_traffic(m.train, m.infer, place, po, true, nullptr, &rep);
        copies = rep.copies;
        plan_s = rep.plan_seconds;
        near_s = rep.choose_seconds;
        traffic_s = rep.traffic_seconds;
        record_gb = static_cast<double>(rep.record_bytes) / 1e9;
      } else {
        t0 = std::chrono::steady_clock::now();
        StagedSchedule s;
        if (hierarchical) {
          HierarchicalOptions ho;
          ho.plan = po;
          s = plan_hierarchical(m.train, m.infer, place, ho);
          plan_s = seconds_since(t0);
        } else {
          s.schedule = plan(m.train, m.infer, po);
          plan_s = seconds_since(t0);
          t0 = std::chrono::steady_clock::now();
          prefer_near(s.schedule, m.train, m.infer, place);
          near_s = seconds_since(t0);
        }
        copies = static_cast<std::int64_t>(s.schedule.copies.size());
        stages = s.stages;
        t0 = std::chrono::steady_clock::now();
        add_traffic(tr, s);
        traffic_s = seconds_since(t0);
      }
      t0 = std::chrono::steady_clock::now();
      double c0 = cpu_seconds();
      const SimResult r = simulate(tr);
      const double sim_s = seconds_since(t0), sim_cpu = cpu_seconds() - c0;
      t0 = std::chrono::steady_clock::now();
      c0 = cpu_seconds();
      const LowerBound lb = refit_lower_bound(m.train, m.infer, place);
      const double lb_s = seconds_since(t0), lb_cpu = cpu_seconds() - c0;
      std::int64_t flows = 0, classes = 0, port_classes = 0, events = 0;
      for (const auto& st : r.stages) {
        flows += st.flows;
        classes += st.classes;
        port_classes += st.port_classes;
        events += st.events;
      }
      nlohmann::json j = {{"train", train},
                          {"hierarchical", hierarchical},
                          {"streamed", streamed},
                          {"per_expert", mo.per_expert},
                          {"split_bytes", split_bytes},
                          {"infer", infer},
                          {"ranks", ranks},
                          {"tensors", m.infer.tensors.size()},
                          {"copies", copies},
                          {"flows", flows},
                          {"flow_classes", classes},
                          {"port_classes", port_classes},
                          {"events", events},
                          {"stages", stages},
                          {"layouts_seconds", layouts_s},
                          {"plan_seconds", plan_s},
                          {"near_seconds", near_s},
                          {"traffic_seconds", traffic_s},
                          {"simulate_seconds", sim_s},
                          {"simulate_cpu_seconds", sim_cpu},
                          {"lower_bound_seconds_to_compute", lb_s},
                          {"lower_bound_cpu_seconds", lb_cpu},
                          {"predicted_refit_seconds", r.seconds},
                          {"lower_bound_refit_seconds", lb.seconds},
                          {"record_gb", record_gb},
                          {"peak_rss_gb", peak_rss_gb()}};
      j["process_cpu_seconds"] = cpu_seconds();  // all sizes so far: run one size per process to read one
      std::cout << j.dump() << std::endl;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "topology-bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
