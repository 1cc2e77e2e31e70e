#pragma once
// The JSON side of the file contract (CONTRACT.md §1 layout files, §2
// schedules). The reader checks JSON types and shapes, maps axis names to
// indices and rejects unknown fields, then leaves the semantic rules to
// Layout's validation. Every rejection is a LayoutError naming the file, the
// tensor (or buffer) and the field, so a tool can print it as one line.
// Compatible leniencies: an optional field set to null means it is absent;
// a dimspec object may leave out "axes" (e.g. {"pad_to": P}: padded, not cut).
#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <ostream>
#include <set>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "base/dtype.hpp"
#include "base/error.hpp"
#include "layout/layout.hpp"
#include "plan/plan.hpp"
#include "schedule/schedule.hpp"

namespace reshard {

namespace json_detail {

using json = nlohmann::json;

/// Where the reader stands: the file, the tensor ("" outside tensors) and the
/// field path inside it ("dims[0].split", or "buffers[1] 'qkv'.dim").
struct Where {
  std::string file;
  std::string tensor;
  std::string field;

  Where at(std::string_view key) const {
    Where w = *this;
    w.field = field.empty() ? std::string(key) : fmt::format("{}.{}", field, key);
    return w;
  }
  Where at(std::size_t i) const {
    Where w = *this;
    w.field = fmt::format("{}[{}]", field, i);
    return w;
  }
  ErrorContext ctx() const { return ErrorContext{file, tensor, field}; }
};

template <class... Args>
[[noreturn]] inline void bad(const Where& w, fmt::format_string<Args...> f, Args&&... args) {
  layout_fail(w.ctx(), f, std::forward<Args>(args)...);
}

/// "a string (\"4096\")": what a JSON value is, short enough for one line.
inline std::string describe(const json& j) {
  auto excerpt = [&] {
    std::string s = j.dump(-1, ' ', true, json::error_handler_t::replace);
    if (s.size() > 40) s = s.substr(0, 37) + "...";
    return s;
  };
  switch (j.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean (" + excerpt() + ")";
    case json::value_t::string: return "a string (" + excerpt() + ")";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "an integer (" + excerpt() + ")";
    case json::value_t::number_float: return "a number (" + excerpt() + ")";
    case json::value_t::array: return fmt::format("an array of {} elements", j.size());
    case json::value_t::object: return "an object";
    default: return "an unsupported value";
  }
}

inline void expect_object(const json& j, const Where& w) {
  if (!j.is_object()) bad(w, "expected an object, got {}", describe(j));
}
inline void expect_array(const json& j, const Where& w) {
  if (!j.is_array()) bad(w, "expected an array, got {}", describe(j));
}

inline std::int64_t as_int(const json& j, const Where& w) {
  if (j.is_number_unsigned()) {
    const auto u = j.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      bad(w, "integer {} is out of the 64-bit signed range", u);
    return static_cast<std::int64_t>(u);
  }
  if (j.is_number_integer()) return j.get<std::int64_t>();
  if (j.is_number_float())
    bad(w, "expected an integer, got {} (integers are written without a fraction or exponent, and "
           "must fit in 64 bits)",
        describe(j));
  bad(w, "expected an integer, got {}", describe(j));
}

inline std::string as_string(const json& j, const Where& w) {
  if (!j.is_string()) bad(w, "expected a string, got {}", describe(j));
  return j.get<std::string>();
}

/// Rejects keys outside `allowed`: a typo must not pass silently.
inline void check_keys(const json& j, const Where& w, std::initializer_list<std::string_view> allowed) {
  for (const auto& [key, value] : j.items()) {
    if (std::find(allowed.begin(), allowed.end(), key) != allowed.end()) continue;
    bad(w.at(key), "unknown field; allowed here: {}", fmt::join(allowed, ", "));
  }
}

/// The optional member `key` of object j, or nullptr when it is absent or
/// null (an optional field set to null means the same as leaving it out).
inline const json* member(const json& j, std::string_view key) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}
inline const json& required(const json& j, std::string_view key, const Where& w) {
  auto it = j.find(key);
  if (it == j.end()) bad(w.at(key), "missing required field");
  return *it;
}

inline std::string axis_list(const Mesh& m) {
  std::vector<std::string> names;
  for (const auto& a : m.axes) names.push_back(a.name);
  return fmt::format("{}", fmt::join(names, ", "));
}

inline int axis_by_name(const Mesh& m, const std::string& name, const Where& w) {
  const int a = m.axis_index(name);
  if (a < 0) bad(w, "no axis named '{}' in the mesh (its axes: {})", name, axis_list(m));
  return a;
}

/// An axis name, or a sub-axis {"axis", "stride", "size"} (size defaults to
/// axis_size / stride).
inline AxisRef read_axis_ref(const json& j, const Mesh& m, const Where& w) {
  if (j.is_string()) {
    const int a = axis_by_name(m, j.get<std::string>(), w);
    return AxisRef{a, 1, m.axes[static_cast<std::size_t>(a)].size};
  }
  if (!j.is_object()) bad(w, "expected an axis name or a sub-axis object, got {}", describe(j));
  check_keys(j, w, {"axis", "stride", "size"});
  const Where wa = w.at("axis");
  const int a = axis_by_name(m, as_string(required(j, "axis", w), wa), wa);
  const std::int64_t axis_size = m.axes[static_cast<std::size_t>(a)].size;
  AxisRef r{a, 1, 0};
  if (const json* s = member(j, "stride")) {
    r.stride = as_int(*s, w.at("stride"));
    if (r.stride < 1) bad(w.at("stride"), "stride {} must be >= 1", r.stride);
  }
  if (const json* z = member(j, "size")) {
    r.size = as_int(*z, w.at("size"));
    if (r.size < 1) bad(w.at("size"), "size {} must be >= 1", r.size);
  } else {
    if (axis_size % r.stride != 0)
      bad(w.at("stride"), "stride {} does not divide the size {} of axis '{}'", r.stride, axis_size,
          m.axes[static_cast<std::size_t>(a)].name);
    r.size = axis_size / r.stride;
  }
  return r;
}

/// One dimspec (CONTRACT.md §1): null, "tp", ["ep", "tp"] or an object.
inline DimSpec read_dimspec(const json& j, const Mesh& m, const Where& w) {
  DimSpec d;
  if (j.is_null()) return d;
  if (j.is_string()) {
    d.axes.push_back(read_axis_ref(j, m, w.at("axes").at(std::size_t{0})));
    return d;
  }
  auto read_axes = [&](const json& arr, const Where& wa) {
    for (std::size_t i = 0; i < arr.size(); ++i) d.axes.push_back(read_axis_ref(arr[i], m, wa.at(i)));
  };
  if (j.is_array()) {
    read_axes(j, w.at("axes"));
    return d;
  }
  if (!j.is_object())
    bad(w, "expected null, an axis name, a list of axes or a dimspec object, got {}", describe(j));
  check_keys(j, w, {"axes", "split", "cyclic", "pad_to"});
  if (const json* a = member(j, "axes")) {
    expect_array(*a, w.at("axes"));
    read_axes(*a, w.at("axes"));
  }
  const json* split = member(j, "split");
  const json* cyclic = member(j, "cyclic");
  if (split && cyclic)
    bad(w.at("cyclic"), "'split' and 'cyclic' exclude each other: a dim is cut into contiguous parts or "
                        "round-robin blocks, not both");
  if (split) {
    const Where ws = w.at("split");
    if (split->is_string()) {
      const auto s = split->get<std::string>();
      if (s == "even") d.split = Split::even;
      else if (s == "chunk") d.split = Split::chunk;
      else if (s == "balanced") d.split = Split::balanced;
      else bad(ws, "unknown split '{}'; expected \"even\", \"chunk\", \"balanced\" or an array of sizes", s);
    } else if (split->is_array()) {
      d.split = Split::sizes;
      for (std::size_t i = 0; i < split->size(); ++i) {
        d.sizes.push_back(as_int((*split)[i], ws.at(i)));
        if (d.sizes.back() < 0) bad(ws.at(i), "part size {} is negative", d.sizes.back());
      }
    } else {
      bad(ws, "expected \"even\", \"chunk\", \"balanced\" or an array of sizes, got {}", describe(*split));
    }
  }
  if (cyclic) {
    d.split = Split::cyclic;
    d.block = as_int(*cyclic, w.at("cyclic"));
    if (d.block < 1) bad(w.at("cyclic"), "block size {} must be >= 1", d.block);
  }
  if (const json* p = member(j, "pad_to")) {
    d.pad_to = as_int(*p, w.at("pad_to"));
    if (d.pad_to < 1) bad(w.at("pad_to"), "pad_to {} must be positive", d.pad_to);
  }
  return d;
}

inline void read_mesh(const json& j, Mesh& m, const Where& w) {
  expect_object(j, w);
  check_keys(j, w, {"axes", "first_rank", "ranks"});
  const Where wa = w.at("axes");
  const json& axes = required(j, "axes", w);
  expect_array(axes, wa);
  for (std::size_t i = 0; i < axes.size(); ++i) {
    const json& pair = axes[i];
    if (!pair.is_array() || pair.size() != 2)
      bad(wa.at(i), "expected a [name, size] pair, got {}", describe(pair));
    m.axes.push_back(Axis{as_string(pair[0], wa.at(i).at(std::size_t{0})), as_int(pair[1], wa.at(i).at(std::size_t{1}))});
  }
  const json* first = member(j, "first_rank");
  const json* ranks = member(j, "ranks");
  if (first && ranks)
    bad(w.at("ranks"), "give either 'first_rank' (contiguous ranks) or 'ranks' (an explicit list), not both");
  if (first) m.first_rank = as_int(*first, w.at("first_rank"));
  if (ranks) {
    const Where wr = w.at("ranks");
    expect_array(*ranks, wr);
    if (ranks->empty()) bad(wr, "an explicit rank list must not be empty");
    for (std::size_t i = 0; i < ranks->size(); ++i) m.ranks.push_back(as_int((*ranks)[i], wr.at(i)));
  }
}

inline void read_tensor(const json& j, const Mesh& m, TensorSpec& t, const Where& wt) {
  expect_object(j, wt);
  Where w = wt;
  t.name = as_string(required(j, "name", wt), wt.at("name"));
  if (t.name.empty()) bad(wt.at("name"), "tensor name is empty");
  w.tensor = t.name;
  w.field.clear();
  check_keys(j, w, {"name", "shape", "dtype", "dims", "stage", "quant", "rows_of"});
  const json& shape = required(j, "shape", w);
  expect_array(shape, w.at("shape"));
  for (std::size_t d = 0; d < shape.size(); ++d) t.shape.push_back(as_int(shape[d], w.at("shape").at(d)));
  const auto dtype_name = as_string(required(j, "dtype", w), w.at("dtype"));
  const auto dt = parse_dtype(dtype_name);
  if (!dt) bad(w.at("dtype"), "unknown dtype '{}'; expected one of {}", dtype_name, fmt::join(dtype_names, " "));
  t.dtype = *dt;
  if (const json* dims = member(j, "dims")) {
    expect_array(*dims, w.at("dims"));
    if (dims->size() != shape.size())
      bad(w.at("dims"), "has {} dimspecs for a tensor of {} dims", dims->size(), shape.size());
    for (std::size_t d = 0; d < dims->size(); ++d) t.dims.push_back(read_dimspec((*dims)[d], m, w.at("dims").at(d)));
  }
  if (const json* stage = member(j, "stage")) {
    const Where ws = w.at("stage");
    if (!stage->is_object())
      bad(ws, "expected an object {{axis: coordinate, ...}}, got {}", describe(*stage));
    for (const auto& [axis, coord] : stage->items()) {
      const Where wc = ws.at(axis);
      const int a = axis_by_name(m, axis, wc);
      const std::int64_t c = as_int(coord, wc);
      const auto& ax = m.axes[static_cast<std::size_t>(a)];
      if (c < 0 || c >= ax.size)
        bad(wc, "coordinate {} is outside axis '{}' of size {}", c, ax.name, ax.size);
      t.stage.push_back(StageCoord{a, c});
    }
  }
  if (const json* quant = member(j, "quant")) {
    const Where wq = w.at("quant");
    expect_object(*quant, wq);
    check_keys(*quant, wq, {"scheme", "block", "scale"});
    QuantSpec q;
    const auto scheme = as_string(required(*quant, "scheme", wq), wq.at("scheme"));
    if (scheme == "block") q.scheme = QuantScheme::block;
    else if (scheme == "mx") q.scheme = QuantScheme::mx;
    else bad(wq.at("scheme"), "unknown scheme '{}'; expected block or mx", scheme);
    if (const json* block = member(*quant, "block")) {
      expect_array(*block, wq.at("block"));
      for (std::size_t d = 0; d < block->size(); ++d) q.block.push_back(as_int((*block)[d], wq.at("block").at(d)));
      if (q.block.empty()) bad(wq.at("block"), "block needs at least one extent");
    } else if (q.scheme == QuantScheme::block) {
      bad(wq, "scheme block needs \"block\" (tile extents of the trailing dims, e.g. [128, 128])");
    }
    q.scale = as_string(required(*quant, "scale", wq), wq.at("scale"));
    t.quant = std::move(q);
  }
  if (const json* rows = member(j, "rows_of")) {
    const Where wr = w.at("rows_of");
    expect_object(*rows, wr);
    check_keys(*rows, wr, {"tensor", "start"});
    t.rows_of = as_string(required(*rows, "tensor", wr), wr.at("tensor"));
    if (t.rows_of.empty() || t.rows_of == t.name) bad(wr.at("tensor"), "must name another (checkpoint) tensor");
    t.rows_start = as_int(required(*rows, "start", wr), wr.at("start"));
    if (t.rows_start < 0) bad(wr.at("start"), "must be >= 0, got {}", t.rows_start);
  }
}

inline void read_buffer(const json& j, std::size_t index, const Mesh& m, BufferSpec& b, const Where& wl) {
  const Where wi = wl.at(index);
  expect_object(j, wi);
  b.name = as_string(required(j, "name", wi), wi.at("name"));
  Where w = wl;
  w.field = fmt::format("buffers[{}] '{}'", index, b.name);
  check_keys(j, w, {"name", "parts", "dim", "interleave", "flat"});
  const json& parts = required(j, "parts", w);
  expect_array(parts, w.at("parts"));
  for (std::size_t p = 0; p < parts.size(); ++p) b.parts.push_back(as_string(parts[p], w.at("parts").at(p)));
  const json* flat = member(j, "flat");
  if (flat) {
    for (auto key : {"dim", "interleave"})
      if (member(j, key))
        bad(w.at(key), "a flat buffer has no concat '{}' (remove it, or remove 'flat' for a concat buffer)", key);
    b.kind = BufferKind::flat;
    b.flat = read_dimspec(*flat, m, w.at("flat"));
    return;
  }
  b.kind = BufferKind::concat;
  if (const json* d = member(j, "dim")) {
    const auto v = as_int(*d, w.at("dim"));
    if (v < 0 || v >= kMaxTensorRank) bad(w.at("dim"), "concat dim {} is outside 0..{}", v, kMaxTensorRank - 1);
    b.dim = static_cast<int>(v);
  }
  if (const json* g = member(j, "interleave")) b.interleave = as_int(*g, w.at("interleave"));
}

/// Path segments of the JSON reader, for duplicate-key reports.
using Segment = std::variant<std::string, std::size_t>;

/// Parses JSON text, rejecting duplicate keys (the standard lets the last one
/// win silently, which hides typos and merge accidents).
inline json parse_text(const std::string& text, const std::string& origin) {
  struct Frame {
    bool object = false;
    std::size_t elements = 0;  // arrays: elements started so far
    std::string key;           // objects: current key
    std::set<std::string> keys;
  };
  std::vector<Frame> stack;
  std::vector<Segment> duplicate;  // path of the first repeated key
  auto element_starts = [&] {
    if (!stack.empty() && !stack.back().object) ++stack.back().elements;
  };
  json::parser_callback_t cb = [&](int, json::parse_event_t ev, json& parsed) {
    switch (ev) {
      case json::parse_event_t::object_start:
        element_starts();
        stack.push_back(Frame{true, 0, {}, {}});
        break;
      case json::parse_event_t::array_start:
        element_starts();
        stack.push_back(Frame{false, 0, {}, {}});
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!stack.empty()) stack.pop_back();
        break;
      case json::parse_event_t::key: {
        auto& f = stack.back();
        f.key = parsed.get<std::string>();
        if (!f.keys.insert(f.key).second && duplicate.empty()) {
          for (const auto& fr : stack) {
            if (fr.object) duplicate.emplace_back(fr.key);
            else duplicate.emplace_back(fr.elements - 1);
          }
        }
        break;
      }
      case json::parse_event_t::value: element_starts(); break;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text, cb);
  } catch (const json::exception& e) {
    std::string what = e.what();
    if (auto p = what.find("] "); what.rfind("[json.exception.", 0) == 0 && p != std::string::npos)
      what = what.substr(p + 2);
    layout_fail(ErrorContext{origin, "", ""}, "invalid JSON: {}", what);
  }
  if (!duplicate.empty()) {
    // Name the tensor or buffer when the key sits inside one.
    Where w{origin, "", ""};
    std::size_t from = 0;
    if (duplicate.size() >= 2 && std::holds_alternative<std::string>(duplicate[0]) &&
        std::holds_alternative<std::size_t>(duplicate[1])) {
      const auto& top = std::get<std::string>(duplicate[0]);
      const auto i = std::get<std::size_t>(duplicate[1]);
      const json* list = j.is_object() ? member(j, top) : nullptr;
      const json* item = list && list->is_array() && i < list->size() ? &(*list)[i] : nullptr;
      const json* name = item && item->is_object() ? member(*item, "name") : nullptr;
      if (name && name->is_string() && top == "tensors") {
        w.tensor = name->get<std::string>();
        from = 2;
      } else if (name && name->is_string() && top == "buffers") {
        w.field = fmt::format("buffers[{}] '{}'", i, name->get<std::string>());
        from = 2;
      }
    }
    for (std::size_t s = from; s < duplicate.size(); ++s) {
      if (std::holds_alternative<std::string>(duplicate[s])) w = w.at(std::get<std::string>(duplicate[s]));
      else w = w.at(std::get<std::size_t>(duplicate[s]));
    }
    bad(w, "field appears twice in one object");
  }
  return j;
}

/// A dimspec as JSON, in the shortest form that reads back the same.
inline json dimspec_to_json(const DimSpec& d, const Mesh& m) {
  auto ref = [&](const AxisRef& r) -> json {
    if (r.axis < 0 || r.axis >= static_cast<int>(m.axes.size()))
      fail("layout_to_json: axis index {} is not an axis of the mesh", r.axis);
    const auto& ax = m.axes[static_cast<std::size_t>(r.axis)];
    if (r.stride == 1 && r.size == ax.size) return ax.name;
    return json{{"axis", ax.name}, {"stride", r.stride}, {"size", r.size}};
  };
  json axes = json::array();
  bool whole = true;
  for (const auto& r : d.axes) {
    axes.push_back(ref(r));
    whole = whole && axes.back().is_string();
  }
  if (d.split == Split::even && d.pad_to == 0 && whole) {
    if (d.axes.empty()) return nullptr;
    if (d.axes.size() == 1) return axes[0];
    return axes;
  }
  json o{{"axes", axes}};
  switch (d.split) {
    case Split::even: break;
    case Split::chunk: o["split"] = "chunk"; break;
    case Split::balanced: o["split"] = "balanced"; break;
    case Split::sizes: o["split"] = d.sizes; break;
    case Split::cyclic: o["cyclic"] = d.block; break;
  }
  if (d.pad_to) o["pad_to"] = d.pad_to;
  return o;
}

}  // namespace json_detail

/// Reads one layout (CONTRACT.md §1) from parsed JSON and validates it.
/// `origin` names the source in messages (normally the file name).
inline Layout parse_layout(const nlohmann::json& j, const std::string& origin) {
  using namespace json_detail;
  const Where w{origin, "", ""};
  if (!j.is_object()) bad(w, "a layout file holds one object with 'mesh', 'tensors' and 'buffers'; got {}", describe(j));
  check_keys(j, w, {"mesh", "tensors", "buffers"});
  LayoutSpec L;
  L.origin = origin;
  read_mesh(required(j, "mesh", w), L.mesh, w.at("mesh"));
  // The mesh first: axis names and sizes are needed to read the dimspecs.
  L.mesh.validate(ErrorContext{origin, "", ""});
  const json& tensors = required(j, "tensors", w);
  expect_array(tensors, w.at("tensors"));
  L.tensors.resize(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) read_tensor(tensors[i], L.mesh, L.tensors[i], w.at("tensors").at(i));
  if (const json* buffers = member(j, "buffers")) {
    expect_array(*buffers, w.at("buffers"));
    L.buffers.resize(buffers->size());
    for (std::size_t b = 0; b < buffers->size(); ++b) read_buffer((*buffers)[b], b, L.mesh, L.buffers[b], w.at("buffers"));
  }
  return Layout(std::move(L));
}

/// Reads and validates a layout file. A missing file, unreadable file or
/// malformed JSON (with line and column) is a LayoutError naming the file.
inline Layout read_layout_file(const std::string& path) {
  const ErrorContext where{path, "", ""};
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) layout_fail(where, "is a directory, not a layout file");
  std::ifstream in(path, std::ios::binary);
  if (!in) layout_fail(where, "cannot open the layout file: {}", std::strerror(errno));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) layout_fail(where, "cannot read the layout file: {}", std::strerror(errno));
  return parse_layout(json_detail::parse_text(text, path), path);
}

/// A layout as JSON in the contract's format; parse_layout reads it back to
/// the same layout. Compact forms are used where they mean the same.
inline nlohmann::json layout_to_json(const Layout& L) {
  using nlohmann::json;
  json mesh;
  mesh["axes"] = json::array();
  for (const auto& a : L.mesh.axes) mesh["axes"].push_back(json::array({a.name, a.size}));
  if (L.mesh.ranks.empty()) mesh["first_rank"] = L.mesh.first_rank;
  else mesh["ranks"] = L.mesh.ranks;
  json tensors = json::array();
  for (const auto& t : L.tensors) {
    json o{{"name", t.name}, {"shape", t.shape}, {"dtype", std::string(to_string(t.dtype))}};
    bool any_cut = false;
    json dims = json::array();
    for (const auto& d : t.dims) {
      dims.push_back(json_detail::dimspec_to_json(d, L.mesh));
      any_cut = any_cut || !dims.back().is_null();
    }
    if (any_cut) o["dims"] = dims;
    if (!t.stage.empty()) {
      json stage = json::object();
      for (const auto& s : t.stage) {
        if (s.axis < 0 || s.axis >= static_cast<int>(L.mesh.axes.size()))
          fail("layout_to_json: tensor '{}': stage axis index {} is not an axis of the mesh", t.name, s.axis);
        stage[L.mesh.axes[static_cast<std::size_t>(s.axis)].name] = s.coord;
      }
      o["stage"] = stage;
    }
    if (t.quant) {
      json q{{"scheme", t.quant->scheme == QuantScheme::block ? "block" : "mx"}, {"scale", t.quant->scale}};
      if (t.quant->scheme == QuantScheme::block || !t.quant->block.empty()) q["block"] = t.quant->block;
      o["quant"] = q;
    }
    if (!t.rows_of.empty()) {
      o["rows_of"] = json{{"tensor", t.rows_of}, {"start", t.rows_start}};
    }
    tensors.push_back(std::move(o));
  }
  json buffers = json::array();
  for (const auto& b : L.buffers) {
    json o{{"name", b.name}, {"parts", b.parts}};
    if (b.kind == BufferKind::concat) {
      o["dim"] = b.dim;
      o["interleave"] = b.interleave;
    } else {
      json f = json_detail::dimspec_to_json(b.flat, L.mesh);
      // Always the object form: unambiguous next to concat buffers.
      if (!f.is_object()) {
        json axes = json::array();
        if (f.is_string()) axes.push_back(f);
        else if (f.is_array()) axes = f;
        f = json{{"axes", axes}};
      }
      o["flat"] = f;
    }
    buffers.push_back(std::move(o));
  }
  return json{{"mesh", mesh}, {"tensors", tensors}, {"buffers", buffers}};
}

/// The `stats` object of a schedule; `extended` adds the per-rank maxima,
/// the rank count and the planning time (`reshard-plan --stats`).
inline nlohmann::json stats_json(const ScheduleStats& s, bool extended) {
  nlohmann::json o{{"bytes", s.bytes}, {"local_bytes", s.local_bytes}, {"copies", s.copies}};
  if (extended) {
    o["max_send_bytes"] = s.max_send_bytes;
    o["max_recv_bytes"] = s.max_recv_bytes;
    o["ranks"] = s.ranks;
    o["plan_seconds"] = s.plan_seconds;
  }
  return o;
}

/// `reshard-plan --stats` of a plan of src -> dst (CONTRACT.md §3): the
/// extended stats, and for a whole plan max_send_share_ratio (an extension:
/// the worst source rank's network bytes over its replica share).
inline nlohmann::json plan_stats_json(const Schedule& s, const Layout& src, const Layout& dst) {
  nlohmann::json j = stats_json(s.stats, true);
  if (s.only_rank < 0) j["max_send_share_ratio"] = replica_shares(s, src, dst).worst_ratio;
  return j;
}

namespace detail {
/// The schedule writer behind write_schedule_json and
/// write_staged_schedule_json: `stage` and `from_dst` are null for a plain
/// schedule, else one entry per copy (CONTRACT.md §2's optional "stage" and
/// "src_layout" fields). Everything is checked before the first byte is
/// written, so a bad schedule never leaves a partial document; the stats are
/// recomputed from the copies so the document is self-consistent.
inline void write_schedule_json_impl(std::ostream& os, const Schedule& s, const std::int32_t* stage,
                                     const std::uint8_t* from_dst, std::string_view who) {
  auto names = [](const std::vector<std::string>& v) {
    std::vector<std::string> out;
    out.reserve(v.size());
    for (const auto& n : v) out.push_back(nlohmann::json(n).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    return out;
  };
  const auto src_names = names(s.src_buffers), dst_names = names(s.dst_buffers);
  // A staged copy that reads the destination layout names its source from dst_buffers.
  auto source_names = [&](std::size_t i) -> const std::vector<std::string>& {
    return from_dst && from_dst[i] ? dst_names : src_names;
  };
  std::int64_t bytes = 0, local_bytes = 0;
  for (std::size_t i = 0; i < s.copies.size(); ++i) {
    const Copy& c = s.copies[i];
    if (stage && stage[i] < 0) fail("{}: copy {} has stage {}", who, i, stage[i]);
    const auto& from = source_names(i);
    if (c.src_buffer < 0 || static_cast<std::size_t>(c.src_buffer) >= from.size() || c.dst_buffer < 0 ||
        static_cast<std::size_t>(c.dst_buffer) >= dst_names.size())
      fail("{}: copy {} names buffer ids {} -> {}, outside the schedule's {} source and {} "
           "destination buffers",
           who, i, c.src_buffer, c.dst_buffer, from.size(), dst_names.size());
    if (c.rank < 0 || c.rank > kMaxBoxRank) fail("{}: copy {} has box rank {}", who, i, c.rank);
    std::int64_t b = c.element_bytes;
    for (int d = 0; d < c.rank; ++d)
      if (__builtin_mul_overflow(b, c.extent(d), &b))
        fail("{}: copy {} has a byte count that overflows 64 bits", who, i);
    if (__builtin_add_overflow(c.is_local() ? local_bytes : bytes, b, c.is_local() ? &local_bytes : &bytes))
      fail("{}: the schedule's byte count overflows 64 bits", who);
  }
  // Hand-rolled appends: fmt::format_int is several times faster than a
  // format string per copy, and schedules can run to gigabytes of JSON.
  std::string buf;
  buf.reserve(std::size_t{1} << 21);
  auto put = [&](std::string_view t) { buf.append(t); };
  auto num = [&](std::int64_t v) {
    const fmt::format_int f(v);
    buf.append(f.data(), f.size());
  };
  auto list = [&](const Copy& c, int side) {  // side -1: the extents
    buf.push_back('[');
    for (int d = 0; d < c.rank; ++d) {
      if (d) buf.push_back(',');
      num(side < 0 ? c.extent(d) : c.stride(side, d));
    }
    buf.push_back(']');
  };
  auto flush = [&] {
    os.write(buf.data(), static_cast<std::streamsize>(buf.size()));
    buf.clear();
  };
  put("{\"format\":\"reshard.schedule/1\",\"copies\":[");
  for (std::size_t i = 0; i < s.copies.size(); ++i) {
    const Copy& c = s.copies[i];
    put(i ? ",\n{\"src_rank\":" : "\n{\"src_rank\":");
    num(c.src_rank);
    put(",\"dst_rank\":");
    num(c.dst_rank);
    put(",\"src\":");
    put(source_names(i)[static_cast<std::size_t>(c.src_buffer)]);
    put(",\"dst\":");
    put(dst_names[static_cast<std::size_t>(c.dst_buffer)]);
    put(",\"src_offset\":");
    num(c.src_offset);
    put(",\"dst_offset\":");
    num(c.dst_offset);
    put(",\"extent\":");
    list(c, -1);
    put(",\"src_stride\":");
    list(c, 0);
    put(",\"dst_stride\":");
    list(c, 1);
    put(",\"element_bytes\":");
    num(c.element_bytes);
    if (stage && stage[i] > 0) {
      put(",\"stage\":");
      num(stage[i]);
    }
    if (from_dst && from_dst[i]) put(",\"src_layout\":\"dst\"");
    // docs/fp8.md: where a copy into a quantized tensor is quantized.
    if (c.quant == CopyQuant::sender) put(",\"quantize\":\"sender\"");
    else if (c.quant == CopyQuant::receiver) put(",\"quantize\":\"receiver\"");
    else if (c.quant == CopyQuant::scale) put(",\"quantize\":\"scale\"");
    else if (c.quant == CopyQuant::cast) put(",\"quantize\":\"cast\"");
    buf.push_back('}');
    if (buf.size() > (std::size_t{1} << 20)) flush();
  }
  put(s.copies.empty() ? "],\n\"stats\":{\"bytes\":" : "\n],\n\"stats\":{\"bytes\":");
  num(bytes);
  put(",\"local_bytes\":");
  num(local_bytes);
  put(",\"copies\":");
  num(static_cast<std::int64_t>(s.copies.size()));
  put("}}\n");
  flush();
}
}  // namespace detail

/// Writes a schedule exactly as CONTRACT.md §2, one copy per line, streamed
/// (schedules can hold millions of copies); checked before the first byte.
inline void write_schedule_json(std::ostream& os, const Schedule& s) {
  detail::write_schedule_json_impl(os, s, nullptr, nullptr, "write_schedule_json");
}

// ---------------------------------------------------------------------------
// Staged schedules (CONTRACT.md §2 "Staged schedules"; hierarchical.hpp).
// Added for topology-aware plans; both writers share write_schedule_json_impl. Per
// copy, `stage[i]` (>= 0) and `from_dst[i]` (1: the copy reads its source
// buffer as a destination-layout buffer, named from dst_buffers) become the
// optional fields "stage" (written when > 0) and "src_layout": "dst".
inline void write_staged_schedule_json(std::ostream& os, const Schedule& s, const std::vector<std::int32_t>& stage,
                                       const std::vector<std::uint8_t>& from_dst) {
  if (stage.size() != s.copies.size() || from_dst.size() != s.copies.size())
    fail("write_staged_schedule_json: {} stages and {} source-layout flags for {} copies", stage.size(),
         from_dst.size(), s.copies.size());
  detail::write_schedule_json_impl(os, s, stage.data(), from_dst.data(), "write_staged_schedule_json");
}

}  // namespace reshard
