#pragma once
// The options the model benches (preset-plan-bench, topology-bench) read the
// same way: the config.json, how experts become tensors, the planner threads.
#include <string>
#include <utility>

#include <CLI/CLI.hpp>

#include "reshard/plan/plan.hpp"
#include "reshard/presets/presets.hpp"

struct ModelBenchOptions {
  std::string model;
  bool per_expert = false;
  int threads;  ///< PlanOptions::threads (0: one per core)

  explicit ModelBenchOptions(int default_threads, std::string default_model = {})
      : model(std::move(default_model)), threads(default_threads) {}

  /// Returns --model's option (a bench may make it required).
  CLI::Option* add_to(CLI::App& app) {
    CLI::Option* m = app.add_option("--model", model, "HuggingFace config.json");
    app.add_option("--threads", threads, "planner threads (0: one per core)");
    app.add_flag("--per-expert", per_expert, "one tensor per expert (else the experts of a layer stacked in one)");
    return m;
  }
  reshard::presets::PresetOptions presets() const {
    reshard::presets::PresetOptions opt;
    opt.group_experts = !per_expert;
    return opt;
  }
  reshard::PlanOptions plan() const {
    reshard::PlanOptions po;
    po.threads = threads;
    return po;
  }
};
