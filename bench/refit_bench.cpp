// refit-bench: reshard vs the traditional refit (gather + broadcast + slice)
// on the in-process transport, over a sweep of layouts and model sizes.
// Prints a table and writes an SVG plot of time vs model size (no Python).
//   refit-bench [--iterations N] [--svg FILE] [--quick] [--json]
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "../tools/refit_harness.hpp"

namespace {

using namespace reshard;
using refit_harness::ModelShape;

struct LayoutCase {
  std::string name;
  int train_pp, train_dp, train_tp, infer_tp, infer_pp;
  bool colocated;
};

struct Row {
  std::string layout, model;
  double model_mb = 0;
  refit_harness::RunResult r;
};

ModelShape shape(std::string name, int layers, std::int64_t hidden, std::int64_t heads, std::int64_t kv, std::int64_t inter,
                 std::int64_t vocab) {
  ModelShape m;
  m.name = std::move(name);
  m.layers = layers;
  m.hidden = hidden;
  m.heads = heads;
  m.kv_heads = kv;
  m.head_dim = hidden / heads;
  m.intermediate = inter;
  m.vocab = vocab;
  return m;
}

/// Time (ms) vs model size (MB), log-log, one line per method and layout.
std::string svg_plot(const std::vector<Row>& rows, const std::vector<LayoutCase>& cases) {
  const double W = 900, H = 560, L = 80, R = 250, T = 40, B = 60;
  double xmin = 1e300, xmax = 0, ymin = 1e300, ymax = 0;
  for (const auto& r : rows) {
    xmin = std::min(xmin, r.model_mb);
    xmax = std::max(xmax, r.model_mb);
    for (double y : {r.r.reshard.median * 1e3, r.r.baseline.median * 1e3}) {
      ymin = std::min(ymin, y);
      ymax = std::max(ymax, y);
    }
  }
  auto lo10 = [](double v) { return std::pow(10.0, std::floor(std::log10(v))); };
  auto hi10 = [](double v) { return std::pow(10.0, std::ceil(std::log10(v))); };
  xmin = lo10(xmin);
  xmax = hi10(xmax);
  ymin = lo10(ymin);
  ymax = hi10(ymax);
  auto X = [&](double v) { return L + (W - L - R) * (std::log10(v) - std::log10(xmin)) / (std::log10(xmax) - std::log10(xmin)); };
  auto Y = [&](double v) { return H - B - (H - T - B) * (std::log10(v) - std::log10(ymin)) / (std::log10(ymax) - std::log10(ymin)); };
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{}\" y=\"22\" font-size=\"15\">Refit time vs model size (in-process transport, median)</text>\n",
      W, H, L);
  // Grid and ticks at powers of ten (and 2x, 5x).
  for (double d = xmin; d <= xmax * 1.0001; d *= 10)
    for (double m : {1.0, 2.0, 5.0}) {
      const double v = d * m;
      if (v > xmax * 1.0001) break;
      s += fmt::format("<line x1=\"{:.1f}\" y1=\"{}\" x2=\"{:.1f}\" y2=\"{}\" stroke=\"#ddd\"/>\n", X(v), T, X(v), H - B);
      s += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{:g}</text>\n", X(v), H - B + 18, v);
    }
  for (double d = ymin; d <= ymax * 1.0001; d *= 10)
    for (double m : {1.0, 2.0, 5.0}) {
      const double v = d * m;
      if (v > ymax * 1.0001) break;
      s += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>\n", L, Y(v), W - R, Y(v));
      s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:g}</text>\n", L - 6, Y(v) + 4, v);
    }
  s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"black\"/>\n", L, T, W - L - R, H - T - B);
  s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">model size (MB of bf16 weights)</text>\n", (L + W - R) / 2, H - 18);
  s += fmt::format("<text transform=\"translate(20,{}) rotate(-90)\" text-anchor=\"middle\">refit time (ms)</text>\n", (T + H - B) / 2);
  const char* colors[] = {"#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2"};
  double ly = T + 10;
  for (std::size_t c = 0; c < cases.size(); ++c) {
    for (int method = 0; method < 2; ++method) {
      std::string pts;
      for (const auto& r : rows) {
        if (r.layout != cases[c].name) continue;
        const double y = (method == 0 ? r.r.reshard.median : r.r.baseline.median) * 1e3;
        pts += fmt::format("{:.1f},{:.1f} ", X(r.model_mb), Y(y));
      }
      if (pts.empty()) continue;
      const std::string color = method == 0 ? colors[c % 5] : "#d62728";
      const char* dash = method == 0 ? "" : " stroke-dasharray=\"6,4\"";
      s += fmt::format("<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"{}/>\n", pts, method == 0 ? color : colors[c % 5], dash);
      for (const auto& r : rows) {
        if (r.layout != cases[c].name) continue;
        const double y = (method == 0 ? r.r.reshard.median : r.r.baseline.median) * 1e3;
        s += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"{}\"/>\n", X(r.model_mb), Y(y), colors[c % 5]);
      }
      s += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"{}\" stroke-width=\"2\"{}/>\n", W - R + 12, ly, W - R + 40, ly,
                       colors[c % 5], dash);
      s += fmt::format("<text x=\"{}\" y=\"{:.1f}\">{} {}</text>\n", W - R + 46, ly + 4, method == 0 ? "reshard" : "traditional", cases[c].name);
      ly += 18;
    }
  }
  s += "</svg>\n";
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"refit-bench: reshard vs the traditional refit over layouts and model sizes"};
  int iterations = 3;
  std::string svg = "refit_bench.svg";
  bool quick = false, json = false;
  app.add_option("--iterations", iterations, "refits per method and point (median reported)")->check(CLI::Range(1, 100));
  app.add_option("--svg", svg, "where to write the plot ('' for none)");
  app.add_flag("--quick", quick, "only the two smallest models");
  app.add_flag("--json", json, "also print all points as one JSON array");
  CLI11_PARSE(app, argc, argv);

  const std::vector<ModelShape> models = {
      shape("llama-4x512", 4, 512, 8, 4, 1408, 8001),     shape("llama-4x1024", 4, 1024, 16, 4, 2816, 16001),
      shape("llama-8x1024", 8, 1024, 16, 4, 2816, 32001), shape("llama-8x2048", 8, 2048, 16, 4, 2816, 32001)};
  const std::vector<LayoutCase> cases = {
      {"pp2.dp2.tp2->tp4", 2, 2, 2, 4, 1, false},
      {"tp4->tp2", 1, 1, 4, 2, 1, false},
      {"pp2.tp2->tp2.pp2", 2, 1, 2, 2, 2, false},
      {"tp4->tp2 colocated", 1, 1, 4, 2, 1, true},
  };
  std::vector<Row> rows;
  fmt::print("{:<20} {:<14} {:>9} {:>12} {:>14} {:>8} {:>12} {:>14} {:>12} {:>9}\n", "layout", "model", "MB", "reshard ms", "traditional ms",
             "speedup", "reshard MB", "traditional MB", "peak stg MB", "valid");
  for (const auto& c : cases) {
    for (std::size_t mi = 0; mi < models.size(); ++mi) {
      if (quick && mi >= 2) break;
      const ModelShape& m = models[mi];
      const int train_world = c.train_pp * c.train_dp * c.train_tp;
      Layout src = refit_harness::megatron_layout(m, c.train_pp, c.train_dp, c.train_tp, 0);
      Layout dst = refit_harness::vllm_layout(m, c.infer_tp, c.infer_pp, c.colocated ? 0 : train_world);
      refit_harness::RunOptions opt;
      opt.iterations = iterations;
      Row row{c.name, m.name, static_cast<double>(m.bytes()) / 1e6, refit_harness::run_refit(src, dst, opt)};
      const auto& r = row.r;
      fmt::print("{:<20} {:<14} {:>9.1f} {:>12.1f} {:>14.1f} {:>7.2f}x {:>12.1f} {:>14.1f} {:>12.1f} {:>9}\n", c.name, m.name, row.model_mb,
                 r.reshard.median * 1e3, r.baseline.median * 1e3, r.baseline.median / r.reshard.median,
                 static_cast<double>(r.reshard.bytes_moved + r.reshard.local_bytes) / 1e6,
                 static_cast<double>(r.baseline.bytes_moved + r.baseline.local_bytes) / 1e6, static_cast<double>(r.reshard.peak_staging_bytes) / 1e6,
                 r.reshard.validated && r.baseline.validated ? "yes" : "NO");
      std::fflush(stdout);
      rows.push_back(std::move(row));
    }
  }
  fmt::print("(MB moved = network + local copies per refit; times are medians of {} alternating iterations)\n", iterations);
  if (!svg.empty()) {
    std::ofstream(svg) << svg_plot(rows, cases);
    fmt::print("plot: {}\n", svg);
  }
  if (json) {
    nlohmann::json a = nlohmann::json::array();
    for (const auto& row : rows)
      a.push_back({{"layout", row.layout},
                   {"model", row.model},
                   {"model_bytes", row.model_mb * 1e6},
                   {"seconds", row.r.reshard.median},
                   {"bytes_moved", row.r.reshard.bytes_moved},
                   {"local_bytes", row.r.reshard.local_bytes},
                   {"validated", row.r.reshard.validated},
                   {"baseline", {{"seconds", row.r.baseline.median}, {"bytes_moved", row.r.baseline.bytes_moved}, {"local_bytes", row.r.baseline.local_bytes}}}});
    std::cout << a.dump() << "\n";
  }
  bool ok = true;
  for (const auto& row : rows) ok &= row.r.reshard.validated && row.r.baseline.validated;
  return ok ? 0 : 1;
}
