#pragma once
// Parallel specs: the text a user gives for one side of a refit, such as
// "tp=2,pp=4,dp=2,ep=8,etp=1,cp=1" (CONTRACT.md §3, `reshard-plan --model`).
//
// Keys (each at most once, values positive integers, comma separated):
//   tp   tensor parallel size             pp   pipeline stages
//   dp   data parallel replicas           cp   context parallel size (training)
//   ep   expert parallel size             etp  expert tensor parallel size (training;
//                                              Megatron's default: etp = tp)
//   pp_first, pp_last  layers on the first / last pipeline stage (training; Megatron's
//                      --decoder-first/last-pipeline-num-layers)
//   quant  inference weights: fp8 (block FP8, 128x128 tiles), mxfp8, or none
//          (BF16 even where the config has a quantization_config); docs/fp8.md
// Which keys a side accepts is checked by its preset (megatron.hpp, vllm.hpp).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "../base/error.hpp"

namespace reshard::presets {

struct ParallelSpec {
  std::int64_t tp = 1, pp = 1, dp = 1, cp = 1, ep = 1;
  std::optional<std::int64_t> etp;                 ///< unset: the preset's default
  std::optional<std::int64_t> pp_first, pp_last;   ///< uneven pipeline ends
  std::string quant;                               ///< "fp8", "mxfp8", "none" or "" (the config's)
  std::string text;                                ///< as given, for messages
  std::vector<std::string> keys;                   ///< keys given, in order

  bool has(std::string_view key) const {
    for (const auto& k : keys)
      if (k == key) return true;
    return false;
  }
};

namespace detail {
inline std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}
}  // namespace detail

/// Parses a spec; `what` names it in messages ("train spec", "infer spec").
/// Throws reshard::Error naming the spec, the key and what is wrong.
inline ParallelSpec parse_parallel_spec(std::string_view text, std::string_view what = "parallel spec") {
  ParallelSpec s;
  s.text = std::string(text);
  const std::string head = fmt::format("{} '{}'", what, text);
  if (detail::trim(text).empty())
    fail("{}: empty; expected keys like tp=2,pp=4,dp=2 (keys: tp pp dp cp ep etp pp_first pp_last quant)", head);
  std::size_t at = 0;
  while (at <= text.size()) {
    const std::size_t comma = std::min(text.find(',', at), text.size());
    const std::string_view item = detail::trim(text.substr(at, comma - at));
    at = comma + 1;
    if (item.empty()) fail("{}: an empty item between commas", head);
    const std::size_t eq = item.find('=');
    if (eq == std::string_view::npos) fail("{}: '{}' is not key=value", head, item);
    const std::string key(detail::trim(item.substr(0, eq)));
    const std::string_view val = detail::trim(item.substr(eq + 1));
    if (key == "quant") {
      if (s.has(key)) fail("{}: key '{}' is given twice", head, key);
      if (val != "fp8" && val != "mxfp8" && val != "none")
        fail("{}: quant='{}' is not one of fp8, mxfp8, none", head, val);
      s.keys.push_back(key);
      s.quant = std::string(val);
      if (comma == text.size()) break;
      continue;
    }
    std::int64_t* field = nullptr;
    std::optional<std::int64_t>* opt = nullptr;
    if (key == "tp") field = &s.tp;
    else if (key == "pp") field = &s.pp;
    else if (key == "dp") field = &s.dp;
    else if (key == "cp") field = &s.cp;
    else if (key == "ep") field = &s.ep;
    else if (key == "etp") opt = &s.etp;
    else if (key == "pp_first") opt = &s.pp_first;
    else if (key == "pp_last") opt = &s.pp_last;
    else
      fail("{}: unknown key '{}' (keys: tp pp dp cp ep etp pp_first pp_last quant)", head, key);
    if (s.has(key)) fail("{}: key '{}' is given twice", head, key);
    s.keys.push_back(key);
    // A positive decimal integer, at most 2^31 (mesh sizes are bounded there).
    bool digits = !val.empty() && val.size() <= 10;
    std::int64_t v = 0;
    for (char c : val) {
      if (c < '0' || c > '9') {
        digits = false;
        break;
      }
      v = v * 10 + (c - '0');
    }
    if (!digits) {
      if (!val.empty() && val[0] == '-') fail("{}: {}={} is not positive", head, key, val);
      fail("{}: {}='{}' is not a positive integer", head, key, val);
    }
    if (v < 1) fail("{}: {}={} is not positive", head, key, v);
    if (v > (std::int64_t{1} << 31)) fail("{}: {}={} is too large", head, key, v);
    if (field) *field = v;
    else *opt = v;
    if (comma == text.size()) break;
  }
  return s;
}

/// Canonical text of a spec ("tp=2,pp=4,dp=2,cp=1,ep=8,etp=1"), for summaries.
inline std::string to_string(const ParallelSpec& s) {
  std::string out = fmt::format("tp={},pp={},dp={}", s.tp, s.pp, s.dp);
  if (s.cp != 1) out += fmt::format(",cp={}", s.cp);
  if (s.ep != 1) out += fmt::format(",ep={}", s.ep);
  if (s.etp) out += fmt::format(",etp={}", *s.etp);
  if (s.pp_first) out += fmt::format(",pp_first={}", *s.pp_first);
  if (s.pp_last) out += fmt::format(",pp_last={}", *s.pp_last);
  if (!s.quant.empty()) out += ",quant=" + s.quant;
  return out;
}

}  // namespace reshard::presets
