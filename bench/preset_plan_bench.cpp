// Times the whole-model presets and the planner on them: building both
// layouts from a config.json, plan() for every rank, and plan() for single
// ranks (PlanOptions::only_rank), as one process of a real job would.
//
//   preset-plan-bench --model examples/models/deepseek-v3.json
//     --train tp=1,pp=4,dp=32,ep=16 --infer tp=8,dp=16 --rank 0 --rank 256
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "reshard/plan/plan.hpp"
#include "reshard/presets/presets.hpp"
#include "reshard_support/clocks.hpp"
#include "model_options.hpp"

using reshard::clocks::cpu_seconds;
using reshard::clocks::seconds_since;

// Minor page faults of this process so far: a one-rank plan's cost is much
// in the memory it touches for the first time, and unlike time on a shared
// machine this count is the same from run to run.
static long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

int main(int argc, char** argv) {
  CLI::App app{"Time presets + plan() on a whole model"};
  ModelBenchOptions mo(0);
  std::string train = "tp=1,pp=4,dp=32,ep=16", infer = "tp=8,dp=16";
  std::vector<std::int64_t> ranks;
  bool colocate = false, skip_full = false;
  mo.add_to(app)->required();
  app.add_option("--train", train, "training spec (Megatron)");
  app.add_option("--infer", infer, "inference spec (vLLM)");
  app.add_option("--rank", ranks, "also plan only this global rank (repeatable)");
  app.add_flag("--colocate", colocate, "inference ranks start at 0");
  app.add_flag("--skip-full", skip_full, "do not plan all ranks");
  CLI11_PARSE(app, argc, argv);
  try {
    auto t0 = std::chrono::steady_clock::now();
    const auto manifest = reshard::presets::model_manifest(mo.model, !mo.per_expert);
    const double t_manifest = seconds_since(t0);
    reshard::presets::PresetOptions opt = mo.presets();
    opt.colocate = colocate;
    t0 = std::chrono::steady_clock::now();
    const auto m = reshard::presets::model_layouts(manifest, reshard::presets::parse_parallel_spec(train, "train spec"),
                                                   reshard::presets::parse_parallel_spec(infer, "infer spec"), opt);
    const double t_layouts = seconds_since(t0);
    fmt::print("model {}: {} tensors, {:.3f} B parameters, {:.1f} GiB (manifest {:.3f} s)\n", mo.model,
               manifest.tensors.size(), manifest.parameters() / 1e9, manifest.bytes() / double(1ull << 30),
               t_manifest);
    fmt::print("layouts: train {} ranks, {} tensors, {} buffers; infer {} ranks, {} tensors, {} buffers ({:.3f} s)\n",
               m.train_world, m.train.tensors.size(), m.train.local_buffers().size(), m.infer_world,
               m.infer.tensors.size(), m.infer.local_buffers().size(), t_layouts);
    if (!skip_full) {
      t0 = std::chrono::steady_clock::now();
      const double c0 = cpu_seconds();
      const auto s = reshard::plan(m.train, m.infer, mo.plan());
      const double t = seconds_since(t0), cpu = cpu_seconds() - c0;
      fmt::print("plan all ranks: {:.3f} s ({:.3f} s CPU), {} copies, {:.2f} GiB over the network, max send {:.2f} GiB, max recv "
                 "{:.2f} GiB\n",
                 t, cpu, s.copies.size(), s.stats.bytes / double(1ull << 30), s.stats.max_send_bytes / double(1ull << 30),
                 s.stats.max_recv_bytes / double(1ull << 30));
    }
    for (auto r : ranks) {
      reshard::PlanOptions po;
      po.only_rank = r;
      const long f0 = minor_faults();
      t0 = std::chrono::steady_clock::now();
      const double c0 = cpu_seconds();
      const auto s = reshard::plan(m.train, m.infer, po);
      const double t = seconds_since(t0), cpu = cpu_seconds() - c0;
      const long faults = minor_faults() - f0;
      fmt::print("plan rank {}: {:.4f} s ({:.4f} s CPU), {} copies, {:.3f} GiB, {} page faults\n", r, t, cpu,
                 s.copies.size(), s.stats.bytes / double(1ull << 30), faults);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
