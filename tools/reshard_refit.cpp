// reshard-refit: runs a real refit and the traditional one side by side
// (CONTRACT.md §3).
//   reshard-refit [--transport local] [--iterations N] [--json] [--src SRC.json --dst DST.json]
//                 [--model CONFIG.json --train SPEC --infer SPEC [--colocate] [--group-experts]]
//                 [--staging-budget BYTES] [--no-baseline]
//                 [--topology NAME|FILE [--placement launch|separate] --hierarchical [--pipeline K]]
//                 [--delta --versions N [--lr LR] [--dense-above F] [--master-f32]]
// With no arguments: an embedded Llama-like model (8 layers, hidden 2048,
// bf16, ~700 MB) from Megatron pp=2 x dp=2 x tp=2 to vLLM tp=4 on the
// in-process transport. Every destination element is checked after every
// refit of each method (new source values each iteration). Exit status: 0 validated, 1 validation failed or
// invalid input, 2 usage error.
// --delta: N versions of the weights evolved by Adam (tools/delta_harness.hpp),
// each refit as a delta refit and as a dense refit in the same run, every
// element of the delta destination checked against the dense one.
// --master-f32 (with --delta): the sources are the f32 master copy itself
// (every bf16 / f16 tensor of the training layout made f32), cast to the
// destination's dtype in flight (PlanOptions::cast) by both refits; no
// traditional baseline (it has no cast).
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "delta_harness.hpp"
#include "layout_args.hpp"
#include "refit_harness.hpp"
#include "reshard/json_io.hpp"
#include "reshard/plan/hierarchical.hpp"
#include "reshard/plan/topology.hpp"
#include "reshard/presets/presets.hpp"
#include "reshard_support/clocks.hpp"
#ifdef RESHARD_HAVE_UCX
#include "reshard/transport/mpi_bootstrap.hpp"
#include "reshard_support/ucx_refit.hpp"
#endif
#ifdef RESHARD_HAVE_NCCL
#include "reshard/cuda/runtime.hpp"
#include "reshard/transport/mpi_bootstrap.hpp"
#include "reshard/transport/nccl.hpp"
#include "reshard_support/device_placement.hpp"
#include "reshard_support/measured_refit.hpp"
#else
#include <limits.h>
#include <unistd.h>
#endif

#ifdef RESHARD_HAVE_NCCL
/// tools/cuda_copy_engine.cu (nvcc): the CUDA copy kernels as the executor's
/// device engine, on the current device.
std::shared_ptr<reshard::DeviceCopyEngine> make_cuda_copy_engine();
#endif

namespace {

using namespace reshard;
using reshard::MethodFigures;

std::string human_bytes(double b) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", b) : fmt::format("{:.2f} {}", b, units[u]);
}
std::string human_seconds(double s) { return s < 1 ? fmt::format("{:.1f} ms", s * 1e3) : fmt::format("{:.3f} s", s); }

/// The traditional refit's figures for the --delta report (CONTRACT.md §3's
/// "baseline"), from the plain harness run after the versions.
struct DeltaBaseline {
  nlohmann::json json;  ///< the method's object, "method": "traditional"
  double seconds = 0;
  std::int64_t bytes_moved = 0;
  bool validated = false;
  std::string first_wrong;
};

/// The --delta report: the contract's fields (bytes_moved / seconds: the
/// delta refit's medians over the versions after the first; "baseline": the
/// traditional refit, unless --no-baseline) plus "delta" and "dense" (the
/// dense refit of the same versions).
int print_delta(const delta_harness::Result& r, const Layout& src, const Layout& dst, const std::string& model, const std::string& transport,
                double lr, bool json, const std::optional<DeltaBaseline>& baseline) {
  using V = delta_harness::Version;
  const double dbytes = r.median_of(&V::delta_bytes), nbytes = r.median_of(&V::dense_bytes);
  const double dsec = r.median_of(&V::delta_seconds), nsec = r.median_of(&V::dense_seconds);
  const double frac = r.median_of(&V::changed_fraction);
  const bool ok = r.validated() && (!baseline || baseline->validated);
  if (json) {
    nlohmann::json per = nlohmann::json::array();
    for (const auto& v : r.versions)
      per.push_back({{"mode", v.mode}, {"changed_fraction", v.changed_fraction >= 0 ? nlohmann::json(v.changed_fraction) : nlohmann::json()}, {"bytes_moved", v.delta_bytes}, {"seconds", v.delta_seconds},
                     {"dense_bytes_moved", v.dense_bytes}, {"dense_seconds", v.dense_seconds}, {"wrong_elements", v.wrong},
                     {"diff_seconds", v.diff_seconds}, {"scatter_seconds", v.scatter_seconds}, {"cpu_seconds", v.delta_cpu_seconds},
                     {"dense_cpu_seconds", v.dense_cpu_seconds}});
    nlohmann::json j = {{"model", model},
                        {"transport", transport},
                        {"src_ranks", src.mesh.size()},
                        {"dst_ranks", dst.mesh.size()},
                        {"src_layout", src.origin},
                        {"dst_layout", dst.origin},
                        {"bytes_moved", static_cast<std::int64_t>(dbytes)},
                        {"seconds", dsec},
                        {"validated", ok},
                        {"lr", lr},
                        {"delta",
                         {{"versions", r.versions.size()},
                          {"changed_fraction", frac},
                          {"bytes_moved", static_cast<std::int64_t>(dbytes)},
                          {"seconds", dsec},
                          {"per_version", per}}},
                        {"dense", {{"bytes_moved", static_cast<std::int64_t>(nbytes)}, {"seconds", nsec}}},
                        {"bytes_ratio", nbytes > 0 ? dbytes / nbytes : 0},
                        {"time_ratio", nsec > 0 ? dsec / nsec : 0},
                        {"shadow_bytes_max_rank", r.shadow_bytes},
                        {"delta_staging_bytes_max_rank", r.delta_staging_bytes},
                        {"adam_seconds", r.adam_seconds},
                        {"checked_elements", r.checked},
                        {"wrong_elements", r.wrong}};
    if (baseline) {
      j["baseline"] = baseline->json;
      j["speedup"] = dsec > 0 ? baseline->seconds / dsec : 0;
    }
    std::cout << j.dump() << std::endl;
  } else {
    fmt::print("reshard-refit --delta: {} ({}, {} ranks -> {}, {} ranks) on the {} transport, {} versions, Adam lr {:g}\n", model, src.origin,
               src.mesh.size(), dst.origin, dst.mesh.size(), transport, r.versions.size(), lr);
    fmt::print("{:>8} {:>8} {:>10} {:>14} {:>12} {:>14} {:>12} {:>10} {:>10} {:>10} {:>10}\n", "version", "mode", "changed", "delta bytes",
               "delta time", "dense bytes", "dense time", "diff", "scatter", "delta cpu", "dense cpu");
    for (std::size_t k = 0; k < r.versions.size(); ++k) {
      const auto& v = r.versions[k];
      fmt::print("{:>8} {:>8} {:>10} {:>14} {:>12} {:>14} {:>12} {:>10} {:>10} {:>10} {:>10}\n", k + 1, v.mode,
                 v.changed_fraction >= 0 ? fmt::format("{:.4f}%", 100 * v.changed_fraction) : std::string("-"),
                 human_bytes(static_cast<double>(v.delta_bytes)), human_seconds(v.delta_seconds), human_bytes(static_cast<double>(v.dense_bytes)),
                 human_seconds(v.dense_seconds), human_seconds(v.diff_seconds), human_seconds(v.scatter_seconds),
                 human_seconds(v.delta_cpu_seconds), human_seconds(v.dense_cpu_seconds));
    }
    fmt::print("median after the first: changed {:.4f}%, delta {} in {}, dense {} in {}: {:.4f} of the bytes, {:.3f} of the time\n", 100 * frac,
               human_bytes(dbytes), human_seconds(dsec), human_bytes(nbytes), human_seconds(nsec), nbytes > 0 ? dbytes / nbytes : 0,
               nsec > 0 ? dsec / nsec : 0);
    const double dcpu = r.median_of(&V::delta_cpu_seconds), ncpu = r.median_of(&V::dense_cpu_seconds);
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    fmt::print("CPU time of all ranks' processes (median): delta {}, dense {}; on this host's {} cores no schedule of that work takes less "
               "than {} and {}\n",
               human_seconds(dcpu), human_seconds(ncpu), cores, human_seconds(dcpu / cores), human_seconds(ncpu / cores));
    fmt::print("shadow {} and delta staging {} on the busiest rank; {} elements checked against the dense refit, {} wrong\n",
               human_bytes(static_cast<double>(r.shadow_bytes)), human_bytes(static_cast<double>(r.delta_staging_bytes)), r.checked, r.wrong);
    if (baseline)
      fmt::print("traditional refit (gather + broadcast + slice, same transport): {} in {} (median), {}\n",
                 human_bytes(static_cast<double>(baseline->bytes_moved)), human_seconds(baseline->seconds),
                 baseline->validated ? "validated" : "NOT validated");
  }
  if (!r.validated()) fmt::print(stderr, "reshard-refit: validation failed: {}\n", r.first_wrong.empty() ? "nothing was checked" : r.first_wrong);
  if (baseline && !baseline->validated)
    fmt::print(stderr, "reshard-refit: the traditional refit's validation failed: {}\n", baseline->first_wrong);
  return ok ? 0 : 1;
}

#if defined(RESHARD_HAVE_UCX) || defined(RESHARD_HAVE_NCCL)
/// One rank's part of an mpirun job: `body` returns the rank's exit status;
/// an exception is printed with the rank and aborts the whole job (MPI's
/// finalize can hang after a failed peer).
template <class Body>
int mpi_rank_main(int& argc, char**& argv, Body&& body) {
  MpiSession mpi(argc, argv);
  try {
    return body();
  } catch (const std::exception& e) {
    fmt::print(stderr, "reshard-refit: rank {}: {}\n", mpi.rank(), e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  return 1;
}
#endif

#ifdef RESHARD_HAVE_UCX
/// `--transport ucx` under mpirun: world = both sides' ranks. Rank 0 prints
/// the report; every rank exits 1 unless the refit validated.
int run_ucx(int& argc, char**& argv, const Layout& src, const Layout& dst, const std::string& model, int iterations,
            bool baseline, std::int64_t budget, const std::string& protocol, bool json, const delta_harness::Options* delta,
            std::shared_ptr<const StagedSchedule> staged, const std::string& topo_name) {
  return mpi_rank_main(argc, argv, [&] {
    UcxOptions uo;
    uo.protocol = parse_ucx_protocol(protocol);
    // --delta: the source ranks run Adam over their weights between refits
    // (seconds per GB on a busy host) while the others wait in the bootstrap.
    if (delta) uo.stall_timeout = std::chrono::minutes(10);
    UcxTransport t(mpi_bootstrap(), uo);
    if (delta) {
      require_world(src, dst, t.world_ranks(), "ucx refit");
      delta_harness::Options o = *delta;
      o.executor.staging_budget = budget;
      const auto r = delta_harness::run(src, dst, t, o);
      // The traditional refit (CONTRACT.md §3's baseline), after the
      // versions (their buffers are freed), on the same transport.
      std::optional<DeltaBaseline> base;
      if (baseline) {
        UcxRefitOptions ro;
        ro.iterations = iterations;
        ro.executor.staging_budget = budget;
        ro.probe = false;
        const UcxRefitResult u = ucx_refit(src, dst, t, ro);
        base = DeltaBaseline{to_json(u.baseline), u.baseline.median, u.baseline.bytes_moved, u.baseline.validated, u.baseline.first_wrong};
        base->json["method"] = "traditional";
      }
      int rc = r.validated() && (!base || base->validated) ? 0 : 1;
      if (t.rank() == 0) rc = print_delta(r, src, dst, model, "ucx", o.lr, json, base);
      t.all_gather({}, Clock::now() + std::chrono::seconds(30));
      return rc;
    }
    UcxRefitOptions ro;
    ro.iterations = iterations;
    ro.baseline = baseline;
    ro.executor.staging_budget = budget;
    ro.staged = staged;  // --hierarchical: every rank planned the same staged schedule
    const UcxRefitResult r = ucx_refit(src, dst, t, ro);
    const bool ok = r.reshard.validated && (!baseline || r.baseline.validated);
    if (t.rank() == 0) {
      auto j = to_json(r);
      j["model"] = model;
      if (staged) {
        j["hierarchical"] = true;
        j["topology"] = topo_name;
        j["stages"] = staged->stages;
      }
      std::cout << (json ? j.dump() : j.dump(2)) << std::endl;
      if (!ok)
        fmt::print(stderr, "reshard-refit: validation failed: {}\n",
                   !r.reshard.validated ? r.reshard.first_wrong : r.baseline.first_wrong);
    }
    t.all_gather({}, Clock::now() + std::chrono::seconds(30));
    return ok ? 0 : 1;
  });
}
#endif

#ifdef RESHARD_HAVE_NCCL
/// `--transport nccl` under mpirun: one GPU per process (NCCL cannot put two
/// ranks of one communicator on one GPU), every buffer in device memory
/// (device_placement.hpp), packing by the CUDA kernels. Rank 0 prints the
/// report; every rank exits 1 unless the refit validated.
int run_nccl(int& argc, char**& argv, const Layout& src, const Layout& dst, const std::string& model, int iterations, bool baseline,
             std::int64_t budget, bool json) {
  return mpi_rank_main(argc, argv, [&] {
    MPI_Comm node = MPI_COMM_NULL;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int local_rank = 0, local_size = 1;
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_size(node, &local_size);
    MPI_Comm_free(&node);
    const int gpus = cuda::visible_devices();
    if (gpus < local_size)
      fail("nccl refit: needs one GPU per rank (NCCL cannot put two ranks of one communicator on one GPU): {} rank{} on this host, {} GPU{} visible",
           local_size, local_size == 1 ? "" : "s", gpus, gpus == 1 ? "" : "s");
    cuda::check_cuda(cudaSetDevice(local_rank), "cudaSetDevice");
    NcclOptions no;
    no.device = local_rank;
    NcclTransport t(mpi_bootstrap(), no);
    require_world(src, dst, t.world_ranks(), "nccl refit");
    MeasuredRefitOptions mo;
    mo.iterations = iterations;
    mo.baseline = baseline;
    mo.executor.staging_budget = budget;
    mo.executor.device = make_cuda_copy_engine();
    // A wave is one NCCL group: at most 64 in-place sends per peer in it, the
    // smaller pieces bucketed (ExecutorOptions::max_direct_messages).
    mo.executor.max_direct_messages = 64;
    const auto far = [&] { return Clock::now() + mo.executor.timeout; };
    MethodFigures main, base;
    std::int64_t plan_bytes = 0;
    double plan_seconds = 0;
    {
      DevicePlacement placement;
      const RankFigures me = measure_refit_on_rank(src, dst, t, mo, [](const auto&) {}, placement);
      const std::vector<RankFigures> all = gather_figures(t, me, far());
      bool one_host = true;
      for (const RankFigures& f : all) {
        one_host &= f.host == all.front().host;
        plan_bytes += f.main.plan_bytes_sent;
        plan_seconds = std::max(plan_seconds, f.plan_seconds);
      }
      main = summarize_method(all, false, one_host);
      if (baseline) base = summarize_method(all, true, one_host);
    }
    const bool ok = main.validated && (!baseline || base.validated);
    if (t.rank() == t.world_ranks().front()) {
      nlohmann::json j = to_json(main);
      j.update({{"model", model}, {"transport", "nccl"}, {"src_ranks", src.mesh.size()}, {"dst_ranks", dst.mesh.size()},
                {"world", t.world_ranks().size()}, {"src_layout", src.origin}, {"dst_layout", dst.origin}, {"validated", ok},
                {"plan_bytes", plan_bytes}, {"plan_seconds", plan_seconds}, {"memory", "device"}});
      if (baseline) {
        j["baseline"] = to_json(base);
        j["speedup"] = main.median > 0 ? base.median / main.median : 0;
      }
      std::cout << (json ? j.dump() : j.dump(2)) << std::endl;
      if (!ok) fmt::print(stderr, "reshard-refit: validation failed: {}\n", !main.validated ? main.first_wrong : base.first_wrong);
    }
    t.all_gather({}, Clock::now() + std::chrono::seconds(30));
    return ok ? 0 : 1;
  });
}
#else
/// This reshard-refit has no NCCL (it needs no nvcc to build): runs the
/// build's reshard-refit-nccl beside it, which is this tool built with NCCL
/// and the CUDA kernels, when there is one. Returns only when it cannot.
int exec_nccl_build(char** argv) {
  char self[PATH_MAX] = {};
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return 2;
  std::string path(self, static_cast<std::size_t>(n));
  path = path.substr(0, path.rfind('/') + 1) + "reshard-refit-nccl";
  if (access(path.c_str(), X_OK) != 0) return 2;
  execv(path.c_str(), argv);
  fmt::print(stderr, "reshard-refit: cannot run {}: {}\n", path, std::strerror(errno));
  return 2;
}
#endif

/// Prints "  ... PHASE (N s)" after every `every` of silence: planning, setup
/// and the element checks of a large model take tens of seconds each on a
/// small machine, and a command silent for that long looks hung.
class Heartbeat {
  using Clock = std::chrono::steady_clock;

 public:
  explicit Heartbeat(std::string phase, std::chrono::seconds every = std::chrono::seconds(5))
      : phase_(std::move(phase)), every_(every), since_(Clock::now()), last_(since_), thread_([this] { loop(); }) {}
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;
  ~Heartbeat() {
    {
      std::lock_guard<std::mutex> l(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  /// A line was just printed: the phase is now `phase`, the silence starts again.
  void phase(std::string phase) {
    std::lock_guard<std::mutex> l(m_);
    phase_ = std::move(phase);
    since_ = last_ = Clock::now();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> l(m_);
    while (!stop_) {
      const auto due = last_ + every_;
      if (cv_.wait_until(l, due, [&] { return stop_ || last_ + every_ != due; })) continue;
      const auto now = Clock::now();
      fmt::print("  ... {} ({:.0f} s)\n", phase_, std::chrono::duration<double>(now - since_).count());
      std::fflush(stdout);
      last_ = now;
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::string phase_;
  std::chrono::seconds every_;
  Clock::time_point since_, last_;
  std::thread thread_;  // last: starts once the rest is set
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"reshard-refit: move real weights from a training layout to an inference layout, and compare with the traditional refit"};
  std::string transport = "local";
  tools::LayoutArgs la;
  int iterations = 5;
  bool json = false, no_baseline = false;
  std::int64_t budget = ExecutorOptions{}.staging_budget;
  std::string protocol = "tag";
  app.add_option("--transport", transport, "local (in-process threads), ucx or nccl (under mpirun; nccl: one GPU per rank, device memory)");
  app.add_option("--protocol", protocol, "ucx: tag (tagged messages, default) or put (one-sided puts)");
  app.add_option("--iterations", iterations, "refits per method; seconds is the median")->check(CLI::Range(1, 1000));
  app.add_flag("--json", json, "one JSON object on stdout");
  auto* so = app.add_option("--src", la.src_path, "source layout file (CONTRACT.md §1)");
  auto* dopt = app.add_option("--dst", la.dst_path, "destination layout file");
  so->needs(dopt);
  dopt->needs(so);
  auto* mo = app.add_option("--model", la.model_path, "HuggingFace config.json: both layouts from presets");
  auto* to = app.add_option("--train", la.train_spec, "training parallelism (Megatron-Core), e.g. tp=2,pp=2,dp=2");
  auto* io = app.add_option("--infer", la.infer_spec, "inference parallelism (vLLM), e.g. tp=4");
  auto* co = app.add_flag("--colocate", la.colocate, "inference ranks are the training ranks");
  auto* go = app.add_flag("--group-experts", la.group_experts, "stack MoE experts into 3-D tensors");
  mo->needs(to)->needs(io);
  for (auto* o : {to, io, co, go}) o->needs(mo);
  mo->excludes(so);
  app.add_option("--staging-budget", budget, "staging bytes per rank (default 256 MiB)")->check(CLI::Range(std::int64_t{64}, INT64_MAX));
  app.add_flag("--no-baseline", no_baseline, "skip the traditional refit");
  std::string topology, placement;
  bool hierarchical = false;
  int pipeline = 4;
  app.add_option("--topology", topology, "with --hierarchical: cluster topology preset (" +
                                             fmt::format("{}", fmt::join(topology_preset_names(), ", ")) + ") or JSON file");
  app.add_option("--placement", placement, "with --hierarchical: launch or separate (default: the topology's)")
      ->check(CLI::IsMember({"launch", "separate"}));
  app.add_flag("--hierarchical", hierarchical, "run the hierarchical (staged) plan on the topology (local or ucx transport)");
  app.add_option("--pipeline", pipeline, "with --hierarchical: network chunks per rank")->check(CLI::Range(1, 64));
  bool delta = false;
  int versions = 5;
  double lr = 1e-6, dense_above = DeltaOptions{}.dense_above;
  app.add_flag("--delta", delta, "refit N versions evolved by Adam, sending only what changed (and each dense, to compare)");
  auto* vo = app.add_option("--versions", versions, "with --delta: versions to refit (the first is dense)")->check(CLI::Range(2, 1000));
  auto* lo = app.add_option("--lr", lr, "with --delta: Adam learning rate (default 1e-6)")->check(CLI::PositiveNumber);
  auto* dao = app.add_option("--dense-above", dense_above, "with --delta: changed fraction above which a refit goes dense")
                  ->check(CLI::Range(0.0, 1.0));
  bool master_f32 = false;
  auto* mfo = app.add_flag("--master-f32", master_f32,
                           "with --delta: the sources are the f32 master copy, cast in flight to the destination's dtype");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
#ifdef RESHARD_HAVE_UCX
  const bool have_ucx = true;
#else
  const bool have_ucx = false;
#endif
  if (transport != "local" && transport != "ucx" && transport != "nccl") {
    fmt::print(stderr, "reshard-refit: unknown transport '{}' (local, ucx or nccl)\n", transport);
    return 2;
  }
  if (transport == "ucx" && !have_ucx) {
    fmt::print(stderr, "reshard-refit: transport 'ucx' is not built (UCX or MPI was not found when this was configured)\n");
    return 2;
  }
  if (transport == "nccl" && (delta || hierarchical)) {
    fmt::print(stderr, "reshard-refit: --transport nccl does not run {} yet\n", delta ? "--delta" : "--hierarchical");
    return 2;
  }
#ifndef RESHARD_HAVE_NCCL
  if (transport == "nccl") {
    exec_nccl_build(argv);
    fmt::print(stderr,
               "reshard-refit: transport 'nccl' is not built (it needs the CUDA toolkit with NCCL and MPI at configure time; then "
               "`cmake --build build --target reshard-refit-nccl`, which this tool runs for --transport nccl)\n");
    return 2;
  }
#endif
  if (hierarchical && topology.empty()) {
    fmt::print(stderr, "reshard-refit: --hierarchical needs --topology\n");
    return 2;
  }
  if (!hierarchical && (!topology.empty() || !placement.empty())) {
    fmt::print(stderr, "reshard-refit: --topology and --placement only go with --hierarchical\n");
    return 2;
  }
  if (!delta && (vo->count() || lo->count() || dao->count() || mfo->count())) {
    fmt::print(stderr, "reshard-refit: --versions, --lr, --dense-above and --master-f32 only go with --delta\n");
    return 2;
  }
  if (delta && hierarchical) {
    fmt::print(stderr, "reshard-refit: --delta does not run hierarchical (staged) plans\n");
    return 2;
  }
  if (hierarchical && transport == "nccl") {
    fmt::print(stderr, "reshard-refit: --hierarchical runs on the local and ucx transports (not yet on nccl)\n");
    return 2;
  }

  try {
    Layout src, dst;
    std::string model;
    if (!la.model_path.empty() || !la.src_path.empty()) {
      auto l = la.load();
      src = std::move(l.src);
      dst = std::move(l.dst);
      model = std::move(l.model);
    } else {
      const refit_harness::ModelShape m;
      src = refit_harness::megatron_layout(m, 2, 2, 2, 0);
      dst = refit_harness::vllm_layout(m, 4, 1, 8);
      model = m.name;
    }
    // The traditional refit gathers and broadcasts whole tensors in the
    // destination's dtype; it has no FP8 form here (docs/fp8.md).
    if (std::any_of(dst.tensors.begin(), dst.tensors.end(), [](const TensorSpec& t) { return t.quant.has_value(); })) {
      if (!no_baseline && !json) fmt::print("reshard-refit: FP8 destination: no traditional baseline (as with --no-baseline)\n");
      no_baseline = true;
    }
    if (master_f32) {
      // The trainer's f32 master copy as the source layout; the traditional
      // refit has no cast.
      LayoutSpec f32 = src.spec();
      for (auto& t : f32.tensors)
        if (t.dtype == DType::bf16 || t.dtype == DType::f16) t.dtype = DType::f32;
      f32.origin = src.origin + " (f32 master)";
      src = Layout(std::move(f32));
      if (!no_baseline && !json) fmt::print("reshard-refit: --master-f32: no traditional baseline (as with --no-baseline)\n");
      no_baseline = true;
    }
    delta_harness::Options dho;
    dho.cast = master_f32;
    dho.versions = versions;
    dho.lr = lr;
    dho.delta.dense_above = dense_above;
#ifdef RESHARD_HAVE_NCCL
    if (transport == "nccl") return run_nccl(argc, argv, src, dst, model, iterations, !no_baseline, budget, json);
#endif
    // --hierarchical: the staged plan on the topology (every process of a
    // ucx job computes the same one from the same layouts and topology).
    std::shared_ptr<const StagedSchedule> staged;
    std::string topo_name;
    if (hierarchical) {
      Topology topo = load_topology(topology);
      if (placement == "launch") topo.placement = PlacementKind::launch;
      if (placement == "separate") topo.placement = PlacementKind::separate;
      topo_name = topo.name;
      const RankPlacement place(topo, src, dst);
      HierarchicalOptions ho;
      ho.pipeline = pipeline;
      staged = std::make_shared<const StagedSchedule>(plan_hierarchical(src, dst, place, ho));
    }
#ifdef RESHARD_HAVE_UCX
    if (transport == "ucx")
      return run_ucx(argc, argv, src, dst, model, iterations, !no_baseline, budget, protocol, json, delta ? &dho : nullptr, staged,
                     topo_name);
#endif
    if (delta) {
      dho.executor.staging_budget = budget;
      std::set<std::int64_t> ws;
      for (const Layout* L : {&src, &dst})
        for (auto r : L->mesh.global_ranks()) ws.insert(r);
      const std::vector<std::int64_t> ranks(ws.begin(), ws.end());
      LocalWorld world(ranks);
      std::optional<delta_harness::Result> result;
      std::mutex m;
      world.run([&](LocalTransport& t) {
        auto r = delta_harness::run(src, dst, t, dho);
        std::lock_guard lk(m);
        if (!result) result = std::move(r);
      });
      // The traditional refit (CONTRACT.md §3's baseline), after the versions.
      std::optional<DeltaBaseline> base;
      if (!no_baseline) {
        refit_harness::RunOptions bo;
        bo.iterations = iterations;
        bo.baseline = true;
        bo.executor.staging_budget = budget;
        const auto b = refit_harness::run_refit(src, dst, bo);
        base = DeltaBaseline{to_json(b.baseline), b.baseline.median, b.baseline.bytes_moved, b.baseline.validated, b.baseline.first_wrong};
        base->json["method"] = "traditional";
      }
      return print_delta(*result, src, dst, model, "local", lr, json, base);
    }
    refit_harness::RunOptions opt;
    opt.iterations = iterations;
    opt.baseline = !no_baseline;
    opt.executor.staging_budget = budget;
    opt.staged = staged;
    std::optional<Heartbeat> heartbeat;  // between the progress lines, at least every 5 s
    if (!json) {
      // Progress on stdout (the --json report stays one object): planning,
      // setup and each iteration of a large model take seconds each.
      fmt::print("reshard-refit: {}: planning and setting up {} + {} ranks{} ...\n", model, src.mesh.size(), dst.mesh.size(),
                 no_baseline ? "" : " (and the traditional refit's full-tensor buffers)");
      std::fflush(stdout);
      heartbeat.emplace("planning and setting up");
      opt.progress = [&heartbeat](int done, int of) {
        if (done == 0)
          fmt::print("  set up; refitting {} iterations of each method, every element checked after each\n", of);
        else
          fmt::print("  iteration {}/{} done\n", done, of);
        std::fflush(stdout);
        if (done < of)
          heartbeat->phase(fmt::format("iteration {}/{}: refitting both ways, then checking every element", done + 1, of));
        else
          heartbeat->phase("gathering the figures");
      };
    }
    const auto r = refit_harness::run_refit(src, dst, opt);
    heartbeat.reset();
    const bool ok = r.reshard.validated && (no_baseline || r.baseline.validated);
    const double speedup = r.reshard.median > 0 && !no_baseline ? r.baseline.median / r.reshard.median : 0;

    if (json) {
      // reshard's own figures at the top level (the contract's fields).
      nlohmann::json j = to_json(r.reshard);
      j.update({{"model", model},
                {"transport", transport},
                {"src_ranks", r.src_ranks},
                {"dst_ranks", r.dst_ranks},
                {"src_layout", src.origin},
                {"dst_layout", dst.origin},
                {"validated", ok},
                {"iterations", iterations},
                {"plan_bytes", r.plan_bytes},
                {"minimal_bytes", r.minimal_bytes},
                {"staging_budget_bytes", budget},
                {"transport_bytes", r.transport_bytes},
                {"plan_seconds", r.plan_seconds},
                {"peak_rss_bytes", reshard::clocks::peak_rss_bytes()}});
      if (opt.staged) {
        j["hierarchical"] = true;
        j["topology"] = topo_name;
        j["stages"] = opt.staged->stages;
      }
      if (!no_baseline) {
        j["baseline"] = to_json(r.baseline);
        j["speedup"] = speedup;
      }
      std::cout << j.dump() << "\n";
    } else {
      fmt::print("reshard-refit: {} ({}, {} ranks -> {}, {} ranks) on the {} transport, {} iterations\n", model, src.origin, r.src_ranks,
                 dst.origin, r.dst_ranks, transport, iterations);
      if (opt.staged)
        fmt::print("hierarchical plan on topology {}: {} stages, {} copies\n", topo_name, opt.staged->stages,
                   opt.staged->schedule.copies.size());
      fmt::print("{:<24} {:>14} {:>14}\n", "", "reshard", no_baseline ? "" : "traditional");
      auto row = [&](const char* name, const std::string& a, const std::string& b) { fmt::print("{:<24} {:>14} {:>14}\n", name, a, b); };
      const MethodFigures& b = r.baseline;
      row("median time", human_seconds(r.reshard.median), no_baseline ? "" : human_seconds(b.median));
      row("best time", human_seconds(r.reshard.best), no_baseline ? "" : human_seconds(b.best));
      row("bytes over the network", human_bytes(static_cast<double>(r.reshard.bytes_moved)), no_baseline ? "" : human_bytes(static_cast<double>(b.bytes_moved)));
      row("bytes copied locally", human_bytes(static_cast<double>(r.reshard.local_bytes)), no_baseline ? "" : human_bytes(static_cast<double>(b.local_bytes)));
      row("messages", fmt::format("{}", r.reshard.messages), no_baseline ? "" : fmt::format("{}", b.messages));
      row("waves (max per rank)", fmt::format("{}", r.reshard.waves), no_baseline ? "" : fmt::format("{}", b.waves));
      row("peak staging (max rank)", human_bytes(static_cast<double>(r.reshard.peak_staging_bytes)),
          no_baseline ? "" : human_bytes(static_cast<double>(b.peak_staging_bytes)));
      row("validated", r.reshard.validated ? "yes" : "NO", no_baseline ? "" : (b.validated ? "yes" : "NO"));
      fmt::print("plan: {} over the network (minimal {}), {} locally; staging budget {} per rank\n",
                 human_bytes(static_cast<double>(r.plan_bytes)), human_bytes(static_cast<double>(r.minimal_bytes)),
                 human_bytes(static_cast<double>(r.plan_local_bytes)), human_bytes(static_cast<double>(budget)));
      if (!no_baseline)
        fmt::print("speedup: {:.2f}x faster than the traditional refit (median of {} alternating iterations; best {:.2f}x)\n", speedup,
                   iterations, r.reshard.best > 0 ? b.best / r.reshard.best : 0.0);
      if (!r.reshard.validated) fmt::print("reshard: {} wrong elements; first: {}\n", r.reshard.wrong, r.reshard.first_wrong);
      if (!no_baseline && !b.validated) fmt::print("traditional: {} wrong elements; first: {}\n", b.wrong, b.first_wrong);
      fmt::print("memory: {} peak for this process: both layouts' buffers for every rank{}\n", human_bytes(static_cast<double>(reshard::clocks::peak_rss_bytes())),
                 no_baseline ? "" : ", and the traditional refit's whole tensors (gathered once, then one copy per destination rank)");
    }
    if (!ok) {
      fmt::print(stderr, "reshard-refit: validation failed: {}\n", !r.reshard.validated ? r.reshard.first_wrong : r.baseline.first_wrong);
      return 1;
    }
    return 0;
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "reshard-refit: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "reshard-refit: {}\n", e.what());
    return 1;
  }
}
