// reshard-plan: plans the refit between two layouts (CONTRACT.md §3).
//   reshard-plan --src SRC.json --dst DST.json [--json | --stats] [--rank R]
//   reshard-plan --model CONFIG.json --train SPEC --infer SPEC [--colocate]
//                [--emit-layouts DIR] [--json | --stats] [--rank R]
//                [--nic-gbps G] [--picture FILE.svg] [--group-experts]
//   any of the above with a cluster topology (topology.hpp, sim/simulate.hpp):
//                [--topology NAME|FILE [--placement launch|separate]
//                 [--hierarchical [--pipeline K]] [--simulate [--fp8-wire]]]
// Exit status: 0 done, 1 invalid input (one line on stderr naming the file,
// tensor and field; nothing on stdout), 2 usage error.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <new>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "reshard/json_io.hpp"
#include "reshard/layout/storage.hpp"
#include "reshard/plan/hierarchical.hpp"
#include "reshard/plan/plan.hpp"
#include "reshard/plan/plan_summary.hpp"
#include "reshard/plan/topology.hpp"
#include "reshard/presets/presets.hpp"
#include "reshard/sim/simulate.hpp"
#include "layout_args.hpp"

namespace {

using namespace reshard;

void write_picture(const std::string& path, const Schedule& s, const Layout& src, const Layout& dst) {
  const auto sr = src.mesh.global_ranks(), dr = dst.mesh.global_ranks();
  std::map<std::int64_t, std::size_t> si, di;
  for (std::size_t i = 0; i < sr.size(); ++i) si[sr[i]] = i;
  for (std::size_t i = 0; i < dr.size(); ++i) di[dr[i]] = i;
  std::vector<double> m(sr.size() * dr.size(), 0);
  double top = 0;
  for (const auto& c : s.copies) {
    double& v = m[si.at(c.src_rank) * dr.size() + di.at(c.dst_rank)];
    v += static_cast<double>(c.bytes());
    top = std::max(top, v);
  }
  const double cell = std::max(2.0, std::min(24.0, 768.0 / static_cast<double>(std::max(sr.size(), dr.size()))));
  const double left = 90, head = 60;
  const double W = left + cell * static_cast<double>(dr.size()) + 20, H = head + cell * static_cast<double>(sr.size()) + 40;
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{}\" y=\"20\">bytes from source rank (rows, {} ranks) to destination rank (columns, {} ranks); "
      "darkest = {}</text>\n<text x=\"{}\" y=\"40\">local copies on the same rank are included</text>\n",
      W, H, left, sr.size(), dr.size(), human_bytes(top), left);
  for (std::size_t i = 0; i < sr.size(); ++i)
    for (std::size_t j = 0; j < dr.size(); ++j) {
      const double v = m[i * dr.size() + j];
      if (v <= 0) continue;
      const int shade = static_cast<int>(230 - 200 * (top > 0 ? v / top : 0));
      svg += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"rgb({},{},255)\"/>\n",
                         left + cell * static_cast<double>(j), head + cell * static_cast<double>(i), cell, cell, shade, shade);
    }
  svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"none\" stroke=\"black\"/>\n", left,
                     head, cell * static_cast<double>(dr.size()), cell * static_cast<double>(sr.size()));
  svg += fmt::format("<text x=\"5\" y=\"{}\">src {}</text>\n<text x=\"5\" y=\"{:.0f}\">src {}</text>\n", head + 10, sr.front(),
                     head + cell * static_cast<double>(sr.size()), sr.back());
  svg += fmt::format("<text x=\"{}\" y=\"{:.0f}\">dst {} ... dst {}</text>\n</svg>\n", left,
                     head + cell * static_cast<double>(sr.size()) + 20, dr.front(), dr.back());
  std::ofstream f(path);
  f << svg;
  if (!f) fail("reshard-plan: cannot write the picture to '{}'", path);
}

// ---------------------------------------------------------------------------
// --topology / --hierarchical / --simulate (only when --topology is given).

struct TopologyRun {
  std::string topology, placement;
  bool hierarchical = false, simulate = false, fp8_wire = false;
  bool cast = false;  ///< --cast: PlanOptions::cast
  double delta_density = -1, delta_device_gbps = 3000;  ///< --simulate --delta-density: also a delta refit
  int pipeline = 4;
  std::int64_t split_bytes = std::int64_t{1} << 62;
  std::int64_t min_slab_bytes = PlanOptions{}.min_slab_bytes;
  double balance_limit = -1;  // unset: PlanOptions' default for plain plans, 0 with --topology
};

std::string gpu_range(const RankPlacement& place, const Mesh& m) {
  std::int64_t lo = INT64_MAX, hi = -1;
  std::set<std::int64_t> doms;
  for (auto r : m.global_ranks()) {
    lo = std::min(lo, place.gpu(r));
    hi = std::max(hi, place.gpu(r));
    doms.insert(place.domain(r));
  }
  return fmt::format("GPUs {}-{}, NVLink domains {}-{}", lo, hi, *doms.begin(), *doms.rbegin());
}

std::string describe_topology(const Topology& t, const RankPlacement& place, const Layout& src, const Layout& dst) {
  static const char* kinds[] = {"launch", "separate", "gpus"};
  std::string s = fmt::format("topology {}\n", t.name);
  s += fmt::format("  cluster      {} GPUs per node, {} per NVLink domain; per GPU: NIC {} Gb/s, NVLink {} Gb/s each way\n",
                   t.gpus_per_node, t.nvlink_domain, t.nic_gbps, t.nvlink_gbps);
  s += fmt::format("  latency      {} us per network message, {} us per NVLink message, {} us per stage; {} message{} in flight\n",
                   t.latency_us, t.nvlink_latency_us, t.stage_latency_us, t.messages_in_flight,
                   t.messages_in_flight == 1 ? "" : "s");
  s += fmt::format("  messages     as the executor forms them: zero-copy from {}, staging budget {} per rank{}\n",
                   human_bytes(static_cast<double>(t.zero_copy_min)), human_bytes(static_cast<double>(t.staging_budget)),
                   t.host_cores > 0 ? fmt::format("; {} processes on {} host cores", place.gpus().size(), t.host_cores) : "");
  s += fmt::format("  placement    {}: source on {}; destination on {}\n", kinds[static_cast<int>(t.placement)],
                   gpu_range(place, src.mesh), gpu_range(place, dst.mesh));
  return s;
}

std::string describe_simulation(const SimResult& r, const LowerBound& lb, bool fp8_wire, bool quantized) {
  std::string s = fmt::format("simulation (flows per stage and GPU pair, max-min fair over NIC and NVLink ports{})\n",
                              fp8_wire    ? "; FP8 on the wire for decoder linear weights (--fp8-wire accounting)"
                              : quantized ? "; FP8 destinations: the plan's wire bytes (FP8 + scales where senders quantize)"
                                          : "");
  s += fmt::format("  predicted    {}\n", human_seconds(r.seconds));
  s += fmt::format("  lower bound  {} ({:.2f}x): {}\n", human_seconds(lb.seconds), lb.seconds > 0 ? r.seconds / lb.seconds : 0.0,
                   lb.what.empty() ? "nothing to move" : lb.what);
  if (lb.skipped_domains > 0)
    s += fmt::format("               ({} destination domains also hold source GPUs: left out of the domain term)\n",
                     lb.skipped_domains);
  s += fmt::format("  own bound    {} (sum over stages of the busiest port's bytes / rate)\n", human_seconds(r.bound_seconds));
  for (std::size_t i = 0; i < r.stages.size(); ++i) {
    const auto& st = r.stages[i];
    s += fmt::format("  stage {:<6} {} = transfer {} + messages/barrier {}{}; network {}, NVLink {}, local {}\n", i,
                     human_seconds(st.seconds), human_seconds(st.fluid_seconds), human_seconds(st.latency_seconds),
                     st.copy_seconds > 0 ? fmt::format(" + staging copies {}{}", human_seconds(st.copy_seconds),
                                                       st.quantize_seconds > 0 ? fmt::format(" (FP8 quantizing {})", human_seconds(st.quantize_seconds))
                                                                               : std::string())
                                         : std::string(),
                     human_bytes(st.bytes[0]), human_bytes(st.bytes[1]), human_bytes(st.bytes[2]));
    if (st.bound_gpu >= 0 || st.bound_gpu == -2)
      s += fmt::format("               busiest: {} {} {} ({}); {} flows, {} messages, {} rate updates\n",
                       st.bound_gpu >= 0 ? fmt::format("GPU {}", st.bound_gpu) : std::string("the"), to_string(st.bound_port), human_bytes(st.bound_bytes), human_seconds(st.bound_seconds),
                       st.flows, st.messages, st.events);
  }
  return s;
}

nlohmann::json simulation_json(const SimResult& r, const LowerBound& lb) {
  nlohmann::json stages = nlohmann::json::array();
  for (const auto& st : r.stages)
    stages.push_back({{"seconds", st.seconds}, {"transfer_seconds", st.fluid_seconds},
                      {"latency_seconds", st.latency_seconds}, {"copy_seconds", st.copy_seconds},
                      {"quantize_seconds", st.quantize_seconds}, {"bound_seconds", st.bound_seconds},
                      {"network_bytes", st.bytes[0]}, {"nvlink_bytes", st.bytes[1]}, {"local_bytes", st.bytes[2]},
                      {"busiest_gpu", st.bound_gpu}, {"busiest_port", to_string(st.bound_port)}, {"flows", st.flows},
                      {"messages", st.messages}});
  std::int64_t messages = 0;
  for (const auto& st : r.stages) messages += st.messages;
  return {{"predicted_seconds", r.seconds}, {"messages", messages}, {"lower_bound_seconds", lb.seconds}, {"lower_bound", lb.what},
          {"schedule_bound_seconds", r.bound_seconds}, {"stages", stages}};
}

/// Plans with the topology and renders the output (nothing printed yet).
std::string run_with_topology(const TopologyRun& tr, const Layout& src, const Layout& dst, bool as_json, bool as_stats,
                              double nic_gbps) {
  Topology topo = load_topology(tr.topology);
  if (tr.placement == "launch") topo.placement = PlacementKind::launch;
  if (tr.placement == "separate") topo.placement = PlacementKind::separate;
  const RankPlacement place(topo, src, dst);
  StagedSchedule staged;
  HierarchicalReport rep;
  // Whole pieces from the planner (no slabs per replica): choose_senders()
  // balances the senders with the topology in view, and a plan of whole
  // pieces has copies linear in the ranks instead of ranks x replicas.
  PlanOptions po;
  po.cast = tr.cast;
  po.split_bytes = tr.split_bytes;
  po.min_slab_bytes = tr.min_slab_bytes;
  // SenderChoice balances whole pieces here with the topology in view; the
  // planner's replica groups would add about half to the plan time
  // (DeepSeek-V3: every piece goes whole), so they run only when asked for.
  po.balance_limit = tr.balance_limit >= 0 ? tr.balance_limit : 0;
  po.threads = 0;
  if (tr.hierarchical) {
    HierarchicalOptions ho;
    ho.pipeline = tr.pipeline;
    ho.plan = po;
    staged = plan_hierarchical(src, dst, place, ho, &rep);
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    staged.schedule = plan(src, dst, po);
    rep.near_bytes = prefer_near(staged.schedule, src, dst, place);
    staged.schedule.stats.plan_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const Schedule& s = staged.schedule;
  if (as_json) {
    std::ostringstream os;
    if (tr.hierarchical)
      write_staged_schedule_json(os, s, staged.stage, staged.from_dst);
    else
      write_schedule_json(os, s);
    return os.str();
  }
  std::optional<SimResult> sim;
  LowerBound lb;
  const auto quantized = std::find_if(dst.tensors.begin(), dst.tensors.end(), [](const TensorSpec& t) { return t.quant.has_value(); });
  if (tr.fp8_wire && quantized != dst.tensors.end())
    fail("--fp8-wire: the destination already has quantized (FP8) tensors (e.g. '{}'), so the plan carries the real wire bytes; drop "
         "--fp8-wire",
         quantized->name);
  if (tr.simulate) {
    const std::vector<double> wire = fp8_wire_scale(dst);
    Traffic traffic(place);
    add_traffic(traffic, staged, tr.fp8_wire ? &wire : nullptr);
    sim = simulate(traffic);
    lb = refit_lower_bound(src, dst, place, tr.fp8_wire ? &wire : nullptr);
  }
  std::optional<DeltaSimResult> dsim;
  if (tr.simulate && tr.delta_density >= 0) dsim = simulate_delta(s, place, tr.delta_density, tr.delta_device_gbps);
  // Replica shares of direct copies only: a staged plan's fan-out reads the destination layout.
  const std::optional<ReplicaShares> shares =
      tr.hierarchical ? std::nullopt : std::optional<ReplicaShares>(replica_shares(s, src, dst));
  if (as_stats) {
    auto j = stats_json(s.stats, true);
    if (shares) j["max_send_share_ratio"] = shares->worst_ratio;
    j["topology"] = topo.name;
    j["stages"] = staged.stages;
    j["near_bytes"] = rep.near_bytes;
    if (tr.hierarchical) {
      j["fan_out_bytes"] = rep.fan_out_bytes;
      j["fan_out_copies"] = rep.fan_out_copies;
    }
    if (sim) j["simulation"] = simulation_json(*sim, lb);
    if (dsim)
      j["simulation"]["delta"] = {{"changed_fraction", dsim->density}, {"device_gbps", dsim->device_gbps},
                                  {"dense_network_bytes", dsim->dense_bytes}, {"wire_bytes", dsim->wire_bytes},
                                  {"diff_seconds", dsim->diff_seconds}, {"transfer_seconds", dsim->transfer.seconds},
                                  {"scatter_seconds", dsim->scatter_seconds}, {"slices", dsim->slices},
                                  {"host_seconds", dsim->host_seconds}, {"seconds", dsim->seconds}};
    return j.dump() + "\n";
  }
  std::string text = plan_summary(s, src, dst, {.only_rank = -1, .shares = shares ? &*shares : nullptr, .nic_gbps = nic_gbps}) +
                     describe_topology(topo, place, src, dst);
  text += fmt::format("  senders      {} moved to the nearest replica with the least busy port\n",
                      human_bytes(static_cast<double>(rep.near_bytes)));
  if (tr.hierarchical)
    text += fmt::format("  hierarchical {} stages; {} groups of ranks sharing a piece in a domain; {} fan-out copies ({}) "
                        "replace {} of direct copies\n",
                        staged.stages, rep.groups, rep.fan_out_copies, human_bytes(static_cast<double>(rep.fan_out_bytes)),
                        human_bytes(static_cast<double>(rep.dropped_bytes)));
  if (sim) text += describe_simulation(*sim, lb, tr.fp8_wire, quantized != dst.tensors.end());
  if (dsim)
    text += fmt::format("  delta refit  at changed fraction {:g} (docs/delta.md): {} on the wire ({:.4f} of dense); diff {}, transfer {}, "
                        "scatter {} (device memory {} GB/s), overlapped in {} slices{}: {} ({:.3f} of the dense prediction)\n",
                        dsim->density, human_bytes(dsim->wire_bytes), dsim->dense_bytes > 0 ? dsim->wire_bytes / dsim->dense_bytes : 0.0,
                        human_seconds(dsim->diff_seconds), human_seconds(dsim->transfer.seconds), human_seconds(dsim->scatter_seconds),
                        dsim->device_gbps, dsim->slices,
                        dsim->host_seconds > 0 ? fmt::format(", shared host's cores at least {}", human_seconds(dsim->host_seconds)) : std::string(),
                        human_seconds(dsim->seconds), sim && sim->seconds > 0 ? dsim->seconds / sim->seconds : 0.0);
  return text;
}

/// Error messages go out as exactly one line.
void report(const std::string& msg) {
  std::string line = msg;
  for (auto& ch : line)
    if (ch == '\n' || ch == '\r') ch = ' ';
  std::fprintf(stderr, "%s\n", line.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Plans a refit between two parallel layouts (see CONTRACT.md): which rank sends which strided "
               "piece to which rank.",
               "reshard-plan"};
  tools::LayoutArgs la;
  std::string emit_dir, picture;
  bool as_json = false, as_stats = false;
  double nic_gbps = 400;
  std::int64_t rank = -1;
  auto* src_opt = app.add_option("--src", la.src_path, "source layout file (JSON, e.g. the training job)");
  auto* dst_opt = app.add_option("--dst", la.dst_path, "destination layout file (JSON, e.g. the inference job)");
  auto* model_opt = app.add_option("--model", la.model_path, "HuggingFace config.json: build both layouts from it");
  auto* train_opt = app.add_option("--train", la.train_spec, "training parallelism (Megatron-Core), e.g. tp=2,pp=4,dp=2,ep=8");
  auto* infer_opt = app.add_option("--infer", la.infer_spec, "inference parallelism (vLLM), e.g. tp=8,dp=2");
  auto* coloc_opt = app.add_flag("--colocate", la.colocate, "inference ranks are the training ranks (start at rank 0)");
  auto* emit_opt = app.add_option("--emit-layouts", emit_dir, "write DIR/src.json and DIR/dst.json");
  auto* group_opt = app.add_flag("--group-experts", la.group_experts,
                                 "stack each MoE layer's experts into 3-D tensors named 'experts.{0..E-1}' "
                                 "(faster to plan; names are not the checkpoint's)");
  app.add_option("--nic-gbps", nic_gbps, "per-GPU network bandwidth for the refit time estimate (Gb/s)")
      ->check(CLI::PositiveNumber);
  app.add_option("--picture", picture, "write the source x destination traffic matrix as an SVG image");
  src_opt->needs(dst_opt);
  dst_opt->needs(src_opt);
  model_opt->needs(train_opt)->needs(infer_opt);
  for (auto* o : {src_opt, dst_opt}) o->excludes(model_opt)->excludes(train_opt)->excludes(infer_opt);
  for (auto* o : {train_opt, infer_opt, coloc_opt, emit_opt, group_opt}) o->needs(model_opt);
  auto* json_flag = app.add_flag("--json", as_json, "print the schedule as JSON (reshard.schedule/1)");
  auto* stats_flag = app.add_flag("--stats", as_stats, "print only the schedule's stats object, extended");
  json_flag->excludes(stats_flag);
  auto* rank_opt = app.add_option("--rank", rank, "plan only what this global rank sends and receives")
                       ->check(CLI::NonNegativeNumber);
  TopologyRun topo_run;
  app.add_flag("--cast", topo_run.cast,
               "convert a tensor whose float dtype (f32, bf16, f16) differs between the layouts in flight; "
               "without it that is an error");
  auto* topo_opt = app.add_option("--topology", topo_run.topology,
                                  "cluster: a preset (h100-8x400g, h200-8x400g, gb200-nvl72, loopback) or a JSON file; "
                                  "replica choice then prefers the destination's node and NVLink domain");
  app.add_option("--placement", topo_run.placement, "ranks on GPUs: launch (GPU = rank) or separate (each side from "
                                                     "its own NVLink domain); default: the topology's")
      ->check(CLI::IsMember({"launch", "separate"}))
      ->needs(topo_opt);
  auto* hier_opt = app.add_flag("--hierarchical", topo_run.hierarchical,
                                "two-hop staged plan: each unique byte crosses the network once per destination NVLink "
                                "domain, then fans out over NVLink")
                       ->needs(topo_opt);
  app.add_option("--pipeline", topo_run.pipeline, "hierarchical: network chunks per rank (stages = K + 1), default 4")
      ->check(CLI::Range(1, 64))
      ->needs(hier_opt);
  app.add_option("--split-bytes", topo_run.split_bytes,
                 "with --topology: replicated pieces of at least this many bytes are cut into one slab per replica "
                 "(default: never; senders are balanced by the topology-aware choice)")
      ->check(CLI::PositiveNumber)
      ->needs(topo_opt);
  app.add_option("--min-slab-bytes", topo_run.min_slab_bytes,
                 "replica balance: when whole pieces would leave a replica over 1.10x its group's even share, pieces "
                 "are cut into slabs over the replicas, none smaller than this (default 262144)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--balance-limit", topo_run.balance_limit,
                 "replica balance: the most a replica may send over its group's even share before whole pieces are "
                 "reassigned or cut (default 1.10, with --topology 0; 0: rotate whole pieces over the replicas, the "
                 "planner before issue 17)")
      ->check(CLI::NonNegativeNumber);
  auto* sim_opt = app.add_flag("--simulate", topo_run.simulate,
                               "predict the refit time on the topology, with the lower bound and a per-stage breakdown")
                      ->needs(topo_opt);
  app.add_flag("--fp8-wire", topo_run.fp8_wire,
               "simulate a BF16 plan as if decoder linear weights travelled as FP8 (1 byte per element + block "
               "scales); a real FP8 plan (--infer ...,quant=fp8) replaces it, except with --hierarchical, which does "
               "not plan FP8 destinations")
      ->needs(sim_opt);
  auto* delta_opt = app.add_option("--delta-density", topo_run.delta_density,
                                   "simulate: also predict a delta refit (docs/delta.md) in which this fraction of the elements "
                                   "changed (e.g. 0.0257, measured by reshard-refit --delta at lr 1e-6); flat plans, bf16 wire")
                        ->check(CLI::Range(0.0, 1.0))
                        ->needs(sim_opt)
                        ->excludes("--fp8-wire")
                        ->excludes(hier_opt);
  app.add_option("--delta-device-gbps", topo_run.delta_device_gbps,
                 "simulate --delta-density: device memory bandwidth (GB/s) of the diff and scatter kernels (default 3000)")
      ->check(CLI::PositiveNumber)
      ->needs(delta_opt);
  sim_opt->excludes(json_flag);
  topo_opt->excludes(rank_opt);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    report(fmt::format("reshard-plan: {} (run with --help for usage)", e.what()));
    return 2;
  }
  if (la.src_path.empty() && la.model_path.empty()) {
    report("reshard-plan: give --src and --dst, or --model with --train and --infer (run with --help for usage)");
    return 2;
  }

  try {
    // Plan fully, and render fully, before anything reaches stdout; a
    // failed write (a closed pipe, a full disk) is an error, not a success.
    const auto flushed = [&] {
      std::cout.flush();
      if (std::cout) return 0;
      report("reshard-plan: cannot write to standard output");
      return 1;
    };
    auto layouts = la.load();
    const Layout& src = layouts.src;
    const Layout& dst = layouts.dst;
    if (!la.model_path.empty() && !emit_dir.empty()) {
      std::filesystem::create_directories(emit_dir);
      for (auto [L, name] : {std::pair{&src, "src.json"}, std::pair{&dst, "dst.json"}}) {
        const auto path = (std::filesystem::path(emit_dir) / name).string();
        std::ofstream f(path);
        f << layout_to_json(*L).dump(1) << "\n";
        if (!f) fail("reshard-plan: cannot write '{}'", path);
      }
    }
    if (!topo_run.topology.empty()) {
      if (!picture.empty()) fail("reshard-plan: --picture is not available with --topology");
      const std::string text = run_with_topology(topo_run, src, dst, as_json, as_stats, nic_gbps);
      std::cout << text;
      return flushed();
    }
    PlanOptions opt;
    opt.cast = topo_run.cast;
    opt.only_rank = rank;
    opt.threads = 0;  // a full plan uses every core
    opt.min_slab_bytes = topo_run.min_slab_bytes;
    if (topo_run.balance_limit >= 0) opt.balance_limit = topo_run.balance_limit;
    const Schedule s = plan(src, dst, opt);
    std::optional<ReplicaShares> shares;
    if (rank < 0 && !as_json && !as_stats) shares = replica_shares(s, src, dst);
    if (!picture.empty()) write_picture(picture, s, src, dst);
    if (as_json) {
      write_schedule_json(std::cout, s);
    } else if (as_stats) {
      const std::string text = plan_stats_json(s, src, dst).dump() + "\n";
      std::cout << text;
    } else {
      const std::string text = plan_summary(s, src, dst, {.only_rank = rank, .shares = shares ? &*shares : nullptr, .nic_gbps = nic_gbps});
      std::cout << text;
    }
    return flushed();
  } catch (const std::bad_alloc&) {
    report("reshard-plan: out of memory (std::bad_alloc) while reading or planning the layouts");
  } catch (const Error& e) {
    report(e.what());
  } catch (const std::exception& e) {
    report(fmt::format("reshard-plan: internal error: {}", e.what()));
  }
  return 1;
}
