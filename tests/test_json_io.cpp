// The JSON layer: every dimspec form reads into the right DimSpec, layouts
// round-trip through layout_to_json, errors name file/tensor/field, and the
// schedule JSON of every example pair is checked element by element against
// tagged buffers (the contract's correctness and minimality rules, §2).
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include "reshard/json_io.hpp"
#include "reshard/layout/storage.hpp"
#include "reshard/plan/plan.hpp"

using namespace reshard;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

const fs::path kRepo = fs::path(__FILE__).parent_path().parent_path();

Layout parse(const std::string& text, const std::string& origin = "mem.json") {
  return parse_layout(json::parse(text), origin);
}

/// The LayoutError a layout text raises (fails the test when none).
LayoutError rejection(const std::string& text) {
  try {
    parse(text);
  } catch (const LayoutError& e) {
    return e;
  }
  FAIL("the layout was accepted: " << text);
  return LayoutError({}, "");
}

std::string schedule_text(const Schedule& s) {
  std::ostringstream os;
  write_schedule_json(os, s);
  return os.str();
}

std::vector<std::string> example_pairs() {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(kRepo / "examples"))
    if (fs::exists(e.path() / "train.json") && fs::exists(e.path() / "infer.json")) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

// ---- tagged buffers: the oracle ------------------------------------------

using Tag = std::int64_t;
constexpr Tag kPadding = -1, kUnwritten = -2;
constexpr int kTagShift = 40;  // tag = tensor id << 40 | row-major global index

/// For every position and local buffer of L: the tag each slot holds (the
/// tensor element stored there, or kPadding). Tensor ids come from `ids`, so
/// both sides of a plan tag the same element alike. Checks that no slot holds
/// two elements and every slot lies inside its buffer.
std::vector<std::vector<std::vector<Tag>>> tag_buffers(const Layout& L, const Layout& ids,
                                                        std::vector<std::string>& errors) {
  std::vector<std::vector<std::vector<Tag>>> out(static_cast<std::size_t>(L.mesh.size()));
  for (std::int64_t pos = 0; pos < L.mesh.size(); ++pos) {
    auto& bufs = out[static_cast<std::size_t>(pos)];
    for (std::size_t b = 0; b < L.local_buffers().size(); ++b) {
      const auto size = static_cast<std::size_t>(buffer_elements(L, pos, static_cast<int>(b)));
      bufs.emplace_back(size, kPadding);
      std::vector<bool> mapped(size, false);
      for (int t : L.local_buffers()[b].tensors) {
        const auto& ts = L.tensors[static_cast<std::size_t>(t)];
        const int id = ids.find_tensor(ts.name) >= 0 ? ids.find_tensor(ts.name) : 1000 + t;
        const TensorStorage st = tensor_storage(L, pos, t);
        const int n = ts.rank();
        for (const auto& box : st.boxes) {
          std::vector<std::int64_t> j(box.lo.begin(), box.lo.begin() + n);
          if (box.elements() == 0) continue;
          while (true) {
            std::int64_t slot = box.base, lin = 0;
            bool pad = false;
            for (int d = 0; d < n; ++d) {
              const auto ud = static_cast<std::size_t>(d);
              slot += j[ud] * box.stride[ud];
              const std::int64_t g = st.parts[ud].global(j[ud]);
              pad = pad || g >= ts.shape[ud];
              lin = lin * ts.shape[ud] + g;
            }
            if (slot < 0 || static_cast<std::size_t>(slot) >= size) {
              errors.push_back(fmt::format("{}: storage of '{}' on position {} maps outside its buffer", L.origin,
                                           ts.name, pos));
              return out;
            }
            if (mapped[static_cast<std::size_t>(slot)]) {
              errors.push_back(fmt::format("{}: slot {} of buffer '{}' on position {} holds two elements", L.origin,
                                           slot, L.local_buffers()[b].name, pos));
              return out;
            }
            mapped[static_cast<std::size_t>(slot)] = true;
            if (!pad) bufs.back()[static_cast<std::size_t>(slot)] = (Tag{id} << kTagShift) | lin;
            int d = n - 1;
            for (; d >= 0; --d) {
              const auto ud = static_cast<std::size_t>(d);
              if (++j[ud] < box.hi[ud]) break;
              j[ud] = box.lo[ud];
            }
            if (d < 0) break;
          }
        }
      }
    }
  }
  return out;
}

struct OracleResult {
  std::vector<std::string> errors;
  std::int64_t bytes = 0, local_bytes = 0, copies = 0, elements_written = 0;
};

/// Replays a schedule document (as parsed from JSON) on tagged buffers and
/// checks CONTRACT.md §2: in bounds, never reading or writing padding, every
/// destination element written exactly once with the right element, and
/// nothing sent over the network that the destination rank already holds.
OracleResult replay(const Layout& src, const Layout& dst, const json& doc) {
  OracleResult r;
  auto& errors = r.errors;
  auto err = [&](std::string s) {
    if (errors.size() < 10) errors.push_back(std::move(s));
  };
  const auto held = tag_buffers(src, dst, errors);
  const auto want = tag_buffers(dst, dst, errors);
  if (!errors.empty()) return r;
  auto got = want;
  for (auto& bufs : got)
    for (auto& b : bufs) std::fill(b.begin(), b.end(), kUnwritten);
  // What each source position holds, to check minimality.
  std::vector<std::unordered_set<Tag>> holds(held.size());
  for (std::size_t p = 0; p < held.size(); ++p)
    for (const auto& b : held[p])
      for (Tag t : b)
        if (t >= 0) holds[p].insert(t);

  if (doc.at("format") != "reshard.schedule/1") err("format is not reshard.schedule/1");
  for (const auto& c : doc.at("copies")) {
    ++r.copies;
    const auto srank = c.at("src_rank").get<std::int64_t>(), drank = c.at("dst_rank").get<std::int64_t>();
    const auto spos = src.mesh.position_of(srank), dpos = dst.mesh.position_of(drank);
    const int sb = src.find_buffer(c.at("src").get<std::string>());
    const int db = dst.find_buffer(c.at("dst").get<std::string>());
    if (!spos || !dpos || sb < 0 || db < 0) {
      err(fmt::format("copy {}: unknown rank or buffer", c.dump()));
      continue;
    }
    const auto& S = held[static_cast<std::size_t>(*spos)][static_cast<std::size_t>(sb)];
    const auto& W = want[static_cast<std::size_t>(*dpos)][static_cast<std::size_t>(db)];
    auto& G = got[static_cast<std::size_t>(*dpos)][static_cast<std::size_t>(db)];
    const auto ext = c.at("extent").get<std::vector<std::int64_t>>();
    const auto ss = c.at("src_stride").get<std::vector<std::int64_t>>();
    const auto ds = c.at("dst_stride").get<std::vector<std::int64_t>>();
    const auto eb = c.at("element_bytes").get<std::int64_t>();
    if (ss.size() != ext.size() || ds.size() != ext.size()) {
      err(fmt::format("copy {}: stride and extent ranks differ", c.dump()));
      continue;
    }
    if (eb != element_bytes(src.tensors[static_cast<std::size_t>(src.local_buffers()[static_cast<std::size_t>(sb)].tensors[0])].dtype))
      err(fmt::format("copy {}: element_bytes does not match the buffer's dtype", c.dump()));
    std::int64_t n = 1;
    for (auto e : ext) n *= e;
    (srank == drank ? r.local_bytes : r.bytes) += n * eb;
    if (n == 0) continue;
    std::vector<std::int64_t> i(ext.size(), 0);
    const auto so0 = c.at("src_offset").get<std::int64_t>(), do0 = c.at("dst_offset").get<std::int64_t>();
    while (true) {
      std::int64_t so = so0, dof = do0;
      for (std::size_t k = 0; k < ext.size(); ++k) {
        so += i[k] * ss[k];
        dof += i[k] * ds[k];
      }
      if (so < 0 || static_cast<std::size_t>(so) >= S.size() || dof < 0 || static_cast<std::size_t>(dof) >= W.size()) {
        err(fmt::format("copy {}: element out of bounds (src {} of {}, dst {} of {})", c.dump(), so, S.size(), dof,
                        W.size()));
        break;
      }
      const Tag t = S[static_cast<std::size_t>(so)], w = W[static_cast<std::size_t>(dof)];
      Tag& g = G[static_cast<std::size_t>(dof)];
      if (t == kPadding) err(fmt::format("copy {}: reads padding at src slot {}", c.dump(), so));
      else if (w == kPadding) err(fmt::format("copy {}: writes padding at dst slot {}", c.dump(), dof));
      else if (g != kUnwritten) err(fmt::format("copy {}: dst slot {} written twice", c.dump(), dof));
      else if (t != w) err(fmt::format("copy {}: dst slot {} gets tag {:#x}, want {:#x}", c.dump(), dof, t, w));
      else {
        g = t;
        ++r.elements_written;
        if (srank != drank) {
          if (auto hp = src.mesh.position_of(drank); hp && holds[static_cast<std::size_t>(*hp)].count(t))
            err(fmt::format("copy {}: sends an element rank {} already holds", c.dump(), drank));
        }
      }
      int k = static_cast<int>(ext.size()) - 1;
      for (; k >= 0; --k) {
        if (++i[static_cast<std::size_t>(k)] < ext[static_cast<std::size_t>(k)]) break;
        i[static_cast<std::size_t>(k)] = 0;
      }
      if (k < 0) break;
    }
  }
  for (std::size_t p = 0; p < want.size(); ++p)
    for (std::size_t b = 0; b < want[p].size(); ++b)
      for (std::size_t s = 0; s < want[p][b].size(); ++s)
        if (want[p][b][s] >= 0 && got[p][b][s] == kUnwritten) {
          err(fmt::format("rank {} buffer '{}' slot {} is never written", dst.mesh.global_rank(static_cast<std::int64_t>(p)),
                          dst.local_buffers()[b].name, s));
          break;
        }
  return r;
}

std::multiset<std::string> canonical(const json& doc) {
  std::multiset<std::string> out;
  for (const auto& c : doc.at("copies")) out.insert(c.dump());
  return out;
}

}  // namespace

TEST_CASE("every dimspec form reads into the DimSpec it means") {
  const auto L = parse(R"({
    "mesh": {"axes": [["ep", 2], ["tp", 4]]},
    "tensors": [
      {"name": "a", "shape": [8, 8, 8], "dtype": "f32", "dims": [null, "tp", null]},
      {"name": "a2", "shape": [8], "dtype": "f32", "dims": [["ep", {"axis": "tp", "stride": 2}]]},
      {"name": "b", "shape": [8, 9], "dtype": "f32", "dims": [{"axes": [{"axis": "tp", "size": 2}]},
                                                            {"axes": [{"axis": "tp", "stride": 2}], "split": "chunk"}]},
      {"name": "c", "shape": [10, 10], "dtype": "i8", "dims": [{"axes": ["tp"], "split": "balanced"},
                                                            {"axes": ["ep"], "split": [3, 7]}]},
      {"name": "d", "shape": [16, 10], "dtype": "u8", "dims": [{"axes": ["tp"], "cyclic": 2},
                                                            {"axes": ["ep"], "pad_to": 12}]},
      {"name": "e", "shape": [10], "dtype": "fp8e4m3", "dims": [{"pad_to": 12}]}
    ]})");
  CHECK(L.mesh.first_rank == 0);
  CHECK(L.mesh.ranks.empty());
  const auto& a = L.tensors[0].dims;
  CHECK(a[0].axes.empty());
  REQUIRE(a[1].axes.size() == 1);
  CHECK(a[1].axes[0] == AxisRef{1, 1, 4});
  CHECK(a[1].split == Split::even);
  CHECK(a[2].axes.empty());
  const auto& a2 = L.tensors[1].dims;
  REQUIRE(a2[0].axes.size() == 2);
  CHECK(a2[0].axes[0] == AxisRef{0, 1, 2});
  CHECK(a2[0].axes[1] == AxisRef{1, 2, 2});  // size defaults to 4 / 2
  const auto& b = L.tensors[2].dims;
  CHECK(b[0].axes[0] == AxisRef{1, 1, 2});
  CHECK(b[1].axes[0] == AxisRef{1, 2, 2});
  CHECK(b[1].split == Split::chunk);
  const auto& c = L.tensors[3].dims;
  CHECK(c[0].split == Split::balanced);
  CHECK(c[1].split == Split::sizes);
  CHECK(c[1].sizes == std::vector<std::int64_t>{3, 7});
  CHECK(L.tensors[3].dtype == DType::i8);
  const auto& d = L.tensors[4].dims;
  CHECK(d[0].split == Split::cyclic);
  CHECK(d[0].block == 2);
  CHECK(d[1].pad_to == 12);
  CHECK(L.tensors[5].dims[0].axes.empty());
  CHECK(L.tensors[5].dims[0].pad_to == 12);
  CHECK(L.tensors[5].dtype == DType::fp8e4m3);
  // Resolved cuts show the semantics arrived: chunk of 9 over 2 = 5,4;
  // balanced 10 over 4 = 3,3,2,2.
  CHECK(L.tensors[2].cuts[1].cuts == std::vector<std::int64_t>{0, 5, 9});
  CHECK(L.tensors[3].cuts[0].cuts == std::vector<std::int64_t>{0, 3, 6, 8, 10});
}

TEST_CASE("mesh ranks, stages and buffers read as written") {
  const auto L = parse(R"({
    "mesh": {"axes": [["pp", 2], ["tp", 2]], "ranks": [7, 5, 6, 4]},
    "tensors": [
      {"name": "q", "shape": [8, 4], "dtype": "bf16", "dims": ["tp", null], "stage": {"pp": 1}},
      {"name": "k", "shape": [4, 4], "dtype": "bf16", "dims": ["tp", null], "stage": {"pp": 1}},
      {"name": "x", "shape": [6], "dtype": "f64"},
      {"name": "y", "shape": [3, 2], "dtype": "f64"}
    ],
    "buffers": [
      {"name": "qk", "parts": ["q", "k"], "interleave": 2},
      {"name": "flat", "parts": ["x", "y"], "flat": {"axes": ["pp"], "split": "balanced"}}
    ]})");
  CHECK(L.mesh.ranks == std::vector<std::int64_t>{7, 5, 6, 4});
  CHECK(L.mesh.position_of(6) == 2);
  REQUIRE(L.tensors[0].stage.size() == 1);
  CHECK(L.tensors[0].stage[0].axis == 0);
  CHECK(L.tensors[0].stage[0].coord == 1);
  const auto& qk = L.buffers[0];
  CHECK(qk.kind == BufferKind::concat);
  CHECK(qk.dim == 0);
  CHECK(qk.interleave == 2);
  const auto& flat = L.buffers[1];
  CHECK(flat.kind == BufferKind::flat);
  CHECK(flat.flat.split == Split::balanced);
  REQUIRE(flat.flat.axes.size() == 1);
  CHECK(flat.flat.axes[0].axis == 0);
  CHECK(L.find_buffer("qk") >= 0);
  CHECK(L.find_buffer("q") < 0);  // q lives in qk
  // The flat sequence x ++ y (12 elements) is cut 6/6 over pp.
  CHECK(buffer_elements(L, 0, L.find_buffer("flat")) == 6);
}

TEST_CASE("an optional field set to null is the same as leaving it out") {
  const auto L = parse(R"({
    "mesh": {"axes": [["tp", 2]], "first_rank": null, "ranks": null},
    "tensors": [
      {"name": "w", "shape": [4, 2], "dtype": "f32", "dims": null, "stage": null},
      {"name": "v", "shape": [4], "dtype": "f32", "dims": [{"axes": ["tp"], "split": null, "cyclic": 2, "pad_to": null}]}
    ],
    "buffers": null})");
  CHECK(L.mesh.first_rank == 0);
  CHECK(L.tensors[0].dims.size() == 2);
  CHECK(!L.tensors[0].dims[0].is_cut());
  CHECK(L.tensors[1].dims[0].split == Split::cyclic);
  CHECK(L.tensors[1].dims[0].pad_to == 0);
  // Required fields stay required: null is no name.
  const LayoutError e = rejection(R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [{"name": null, "shape": [4], "dtype": "f32"}]})");
  CHECK(e.context.field == "tensors[0].name");
  CHECK(std::string(e.what()).find("expected a string, got null") != std::string::npos);
}

TEST_CASE("layout_to_json reads back to the same layout") {
  const std::string text = R"({
    "mesh": {"axes": [["dp", 2], ["tp", 4]], "first_rank": 3},
    "tensors": [
      {"name": "a", "shape": [8, 8], "dtype": "bf16", "dims": [["dp", {"axis": "tp", "stride": 2}], {"axes": [{"axis": "tp", "size": 2}], "split": "chunk"}]},
      {"name": "b", "shape": [10, 3], "dtype": "f16", "dims": [{"axes": ["tp"], "split": [1, 2, 3, 4]}, null]},
      {"name": "c", "shape": [9], "dtype": "i32", "dims": [{"axes": ["tp"], "cyclic": 2, "pad_to": 12}]},
      {"name": "d", "shape": [4], "dtype": "u32"},
      {"name": "e", "shape": [6], "dtype": "u32", "dims": [{"axes": [], "pad_to": 8}]},
      {"name": "g", "shape": [8, 4], "dtype": "bf16", "dims": ["tp", null]},
      {"name": "u", "shape": [8, 4], "dtype": "bf16", "dims": ["tp", null]},
      {"name": "qkv[0:8]", "shape": [8, 4], "dtype": "bf16", "dims": ["tp", null], "rows_of": {"tensor": "qkv", "start": 0}},
      {"name": "qkv[8:12]", "shape": [4, 4], "dtype": "bf16", "dims": ["tp", null], "rows_of": {"tensor": "qkv", "start": 8}}
    ],
    "buffers": [
      {"name": "gu", "parts": ["g", "u"], "dim": 0, "interleave": 2},
      {"name": "qkv", "parts": ["qkv[0:8]", "qkv[8:12]"]},
      {"name": "bucket", "parts": ["d", "e"], "flat": {"axes": ["dp"], "split": "chunk"}}
    ]})";
  const auto L1 = parse(text);
  const json j1 = layout_to_json(L1);
  const auto L2 = parse_layout(j1, "again.json");
  const json j2 = layout_to_json(L2);
  CHECK(j1 == j2);
  CHECK(j1.at("tensors").at(3).find("dims") == j1.at("tensors").at(3).end());  // all null: left out
  CHECK(j1.at("tensors").at(5).at("dims").at(0) == "tp");                      // compact form
  CHECK(j1.at("tensors").at(8).at("rows_of") == json{{"tensor", "qkv"}, {"start", 8}});
  // Same layout: the same plan against a third layout.
  const auto other = parse(R"({"mesh": {"axes": [["tp", 3]], "first_rank": 20},
    "tensors": [{"name": "a", "shape": [8, 8], "dtype": "bf16", "dims": [null, {"axes": ["tp"], "split": "balanced"}]},
                {"name": "c", "shape": [9], "dtype": "i32", "dims": ["tp"]},
                {"name": "e", "shape": [6], "dtype": "u32", "dims": [{"axes": ["tp"], "split": "chunk"}]},
                {"name": "u", "shape": [8, 4], "dtype": "bf16"}]})");
  CHECK(schedule_text(plan(L1, other)) == schedule_text(plan(L2, other)));
}

TEST_CASE("rejections name the file, the tensor and the field") {
  struct Case {
    const char* text;
    const char* tensor;
    const char* field;
    const char* words;
  };
  const Case cases[] = {
      {R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [{"name": "w", "shape": [4], "dtype": "f32", "dims": ["tq"]}]})",
       "w", "dims[0].axes[0]", "no axis named 'tq'"},
      {R"({"mesh": {"axes": [["tp", 3]]}, "tensors": [{"name": "w", "shape": [10], "dtype": "f32", "dims": ["tp"]}]})",
       "w", "dims[0]", "even split of extent 10 into 3 parts does not divide"},
      {R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [{"name": "w", "shape": [4], "dtype": "f32", "dims": [{"axes": ["tp"], "split": "even", "cyclic": 1}]}]})",
       "w", "dims[0].cyclic", "exclude each other"},
      {R"({"mesh": {"axes": [["tp", 4]]}, "tensors": [{"name": "w", "shape": [4], "dtype": "f32", "dims": [{"axes": [{"axis": "tp", "stride": 2, "size": 4}]}]}]})",
       "w", "dims[0].axes[0]", "does not divide the axis size 4"},
      {R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [{"name": "w", "shape": [4], "dtype": "f32", "stage": {"tp": 0}, "dims": ["tp"]}]})",
       "w", "dims[0].axes[0]", "referenced more than once"},
      {R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [{"name": "w", "shape": [4], "dtype": "f32", "dims": [{"axes": "tp"}]}]})",
       "w", "dims[0].axes", "expected an array, got a string"},
      {R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [{"name": "w", "shape": [4], "dtype": "f32", "dims": [{"axes": ["tp"], "split": 2}]}]})",
       "w", "dims[0].split", "got an integer (2)"},
      {R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [{"name": "w", "shape": [4], "dtype": "f32", "dims": [{"axes": ["tp"], "pad_to": -3}]}]})",
       "w", "dims[0].pad_to", "must be positive"},
      {R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [{"name": "w", "shape": [4], "dtype": "f32", "dims": [{"axes": [{"stride": 1}]}]}]})",
       "w", "dims[0].axes[0].axis", "missing required field"},
      {R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [{"name": "w", "shape": [4], "dtype": 2}]})", "w", "dtype",
       "expected a string, got an integer"},
      {R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [{"name": "", "shape": [4], "dtype": "f32"}]})", "",
       "tensors[0].name", "tensor name is empty"},
      {R"({"mesh": {"axes": [["tp", 2]], "rank": [0, 1]}, "tensors": []})", "", "mesh.rank", "unknown field"},
      {R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [{"name": "w", "shape": [4], "dtype": "f32", "rows_of": {"tensor": "w", "start": 0}}]})",
       "w", "rows_of.tensor", "must name another (checkpoint) tensor"},
      {R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [{"name": "w", "shape": [4], "dtype": "f32", "rows_of": {"tensor": "x", "start": -1}}]})",
       "w", "rows_of.start", "must be >= 0"},
      {R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [{"name": "w", "shape": [4], "dtype": "f32", "rows_of": {"tensor": "x", "begin": 1}}]})",
       "w", "rows_of.begin", "unknown field"},
      {R"({"mesh": {"axes": [["tp", 2]], "ranks": []}, "tensors": []})", "", "mesh.ranks", "must not be empty"},
      {R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [], "buffers": [{"name": "b", "parts": []}]})", "",
       "buffers[0] 'b'.parts", "at least one part"},
      {R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [], "buffers": [{"parts": []}]})", "", "buffers[0].name",
       "missing required field"},
      {R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [{"name": "a", "shape": [4], "dtype": "f32"}], "buffers": [{"name": "b", "parts": ["a"], "flat": {"axes": ["tp"], "splt": "chunk"}}]})",
       "", "buffers[0] 'b'.flat.splt", "unknown field"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.text);
    const LayoutError e = rejection(c.text);
    CHECK(e.context.file == "mem.json");
    CHECK(e.context.tensor == c.tensor);
    CHECK(e.context.field == c.field);
    CHECK(std::string(e.what()).find(c.words) != std::string::npos);
    CHECK(std::string(e.what()).rfind("mem.json: ", 0) == 0);
  }
}

TEST_CASE("read_layout_file: missing files, directories, bad JSON and repeated keys") {
  const fs::path dir = fs::temp_directory_path() / fmt::format("reshard_json_io_{}", ::getpid());
  fs::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text) {
    const auto p = (dir / name).string();
    std::ofstream(p) << text;
    return p;
  };
  auto message = [](const std::string& path) -> std::string {
    try {
      read_layout_file(path);
    } catch (const LayoutError& e) {
      CHECK(e.context.file == path);
      return e.what();
    }
    FAIL("accepted " << path);
    return "";
  };
  const auto missing = (dir / "nope.json").string();
  CHECK(message(missing).find("cannot open") != std::string::npos);
  CHECK(message(dir.string()).find("is a directory") != std::string::npos);
  const auto bad = write("bad.json", "{\"mesh\": {\"axes\": [[\"tp\", 2]]},\n \"tensors\": [,]}\n");
  const auto m = message(bad);
  CHECK(m.find("invalid JSON") != std::string::npos);
  CHECK(m.find("line 2, column") != std::string::npos);
  CHECK(m.find("[json.exception") == std::string::npos);
  const auto dup = write("dup.json", R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [
    {"name": "a", "shape": [4], "dtype": "f32"},
    {"name": "b", "shape": [4], "dtype": "f32", "dims": [{"axes": ["tp"], "pad_to": 4, "pad_to": 6}]}]})");
  try {
    read_layout_file(dup);
    FAIL("a repeated key was accepted");
  } catch (const LayoutError& e) {
    CHECK(e.context.tensor == "b");
    CHECK(e.context.field == "dims[0].pad_to");
  }
  const auto dup_top = write("dup_top.json", R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [], "tensors": []})");
  CHECK(message(dup_top).find("tensors: field appears twice") != std::string::npos);
  // Repeated keys in different objects are fine.
  const auto ok = write("ok.json", R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [
    {"name": "a", "shape": [4], "dtype": "f32", "dims": ["tp"]}, {"name": "b", "shape": [4], "dtype": "f32", "dims": ["tp"]}]})");
  CHECK(read_layout_file(ok).tensors.size() == 2);
  fs::remove_all(dir);
}

TEST_CASE("write_schedule_json escapes names, keeps 64-bit integers and writes nothing on error") {
  Schedule s;
  s.src_buffers = {"plain", "quo\"te\\back\nline", "\xc3\xa9t\xc3\xa9"};
  s.dst_buffers = {"dst"};
  Copy c;
  c.src_rank = 3;
  c.dst_rank = 9;
  c.src_buffer = 1;
  c.dst_buffer = 0;
  c.element_bytes = 2;
  c.src_offset = (std::int64_t{1} << 53) + 1;
  c.dst_offset = 5;
  const std::int64_t extent[] = {3, 4}, src_stride[] = {10, 1}, dst_stride[] = {4, 1};
  c.assign(2, extent, src_stride, dst_stride);
  s.copies.push_back(c);
  c.src_buffer = 2;
  c.dst_rank = 3;  // local
  c.rank = 1;
  s.copies.push_back(c);
  const json doc = json::parse(schedule_text(s));
  CHECK(doc.at("format") == "reshard.schedule/1");
  REQUIRE(doc.at("copies").size() == 2);
  const auto& j0 = doc.at("copies")[0];
  CHECK(j0.size() == 10);
  CHECK(j0.at("src") == "quo\"te\\back\nline");
  CHECK(j0.at("dst") == "dst");
  CHECK(j0.at("src_offset").get<std::int64_t>() == (std::int64_t{1} << 53) + 1);
  CHECK(j0.at("extent") == json::array({3, 4}));
  CHECK(j0.at("src_stride") == json::array({10, 1}));
  CHECK(j0.at("dst_stride") == json::array({4, 1}));
  CHECK(j0.at("element_bytes") == 2);
  CHECK(doc.at("copies")[1].at("src") == "\xc3\xa9t\xc3\xa9");
  CHECK(doc.at("stats") == json{{"bytes", 24}, {"local_bytes", 6}, {"copies", 2}});

  Schedule empty;
  CHECK(json::parse(schedule_text(empty)) ==
        json{{"format", "reshard.schedule/1"}, {"copies", json::array()}, {"stats", {{"bytes", 0}, {"local_bytes", 0}, {"copies", 0}}}});

  s.copies[1].dst_buffer = 4;  // no such buffer
  std::ostringstream os;
  CHECK_THROWS_AS(write_schedule_json(os, s), Error);
  CHECK(os.str().empty());
}

TEST_CASE("stats_json: the contract's three fields, and the extended ones for --stats") {
  const ScheduleStats st{.bytes = 10, .local_bytes = 4, .copies = 3, .max_send_bytes = 7, .max_recv_bytes = 8,
                         .ranks = 12, .plan_seconds = 0.5};
  CHECK(stats_json(st, false) == json{{"bytes", 10}, {"local_bytes", 4}, {"copies", 3}});
  const json e = stats_json(st, true);
  CHECK(e.size() == 7);
  CHECK(e.at("max_send_bytes") == 7);
  CHECK(e.at("max_recv_bytes") == 8);
  CHECK(e.at("ranks") == 12);
  CHECK(e.at("plan_seconds") == 0.5);
}

TEST_CASE("the oracle catches a wrong schedule") {
  const auto src = read_layout_file((kRepo / "examples/llama-block/train.json").string());
  const auto dst = read_layout_file((kRepo / "examples/llama-block/infer.json").string());
  const json good = json::parse(schedule_text(plan(src, dst)));
  REQUIRE(replay(src, dst, good).errors.empty());
  auto mutate = [&](auto&& f) {
    json doc = good;
    f(doc);
    return replay(src, dst, doc).errors;
  };
  CHECK(!mutate([](json& d) { d["copies"][0]["dst_offset"] = d["copies"][0]["dst_offset"].get<std::int64_t>() + 1; }).empty());
  CHECK(!mutate([](json& d) { d["copies"].erase(d["copies"].begin()); }).empty());
  CHECK(!mutate([](json& d) { d["copies"].push_back(d["copies"][0]); }).empty());
  CHECK(!mutate([](json& d) { d["copies"][3]["src_rank"] = d["copies"][3]["src_rank"].get<std::int64_t>() ^ 1; }).empty());
  CHECK(!mutate([](json& d) { d["copies"][5]["extent"][0] = d["copies"][5]["extent"][0].get<std::int64_t>() + 1; }).empty());
}

TEST_CASE("every example pair: valid files, round trip, and a correct, minimal schedule") {
  const auto pairs = example_pairs();
  REQUIRE(pairs.size() >= 5);
  for (const auto& dir : pairs) {
    CAPTURE(dir);
    const auto src = read_layout_file(dir + "/train.json");
    const auto dst = read_layout_file(dir + "/infer.json");
    // Round trip through layout_to_json plans the same schedule.
    const auto src2 = parse_layout(layout_to_json(src), src.origin);
    const auto dst2 = parse_layout(layout_to_json(dst), dst.origin);
    CHECK(layout_to_json(src2) == layout_to_json(src));
    const Schedule s = plan(src, dst);
    const std::string text = schedule_text(s);
    CHECK(schedule_text(plan(src2, dst2)) == text);

    const json doc = json::parse(text);
    const OracleResult r = replay(src, dst, doc);
    for (const auto& e : r.errors) FAIL_CHECK(e);
    CHECK(r.copies == static_cast<std::int64_t>(s.copies.size()));
    CHECK(doc.at("stats").at("bytes") == r.bytes);
    CHECK(doc.at("stats").at("local_bytes") == r.local_bytes);
    CHECK(doc.at("stats").at("copies") == r.copies);
    CHECK(stats_json(s.stats, false) == doc.at("stats"));
    CHECK(r.elements_written > 0);

    // --rank R plans exactly the full schedule's copies R sends or receives.
    std::set<std::int64_t> ranks;
    for (auto g : src.mesh.global_ranks()) ranks.insert(g);
    for (auto g : dst.mesh.global_ranks()) ranks.insert(g);
    const auto full = doc.at("copies");
    for (auto rank : ranks) {
      PlanOptions opt;
      opt.only_rank = rank;
      const json one = json::parse(schedule_text(plan(src, dst, opt)));
      std::multiset<std::string> want;
      for (const auto& c : full)
        if (c.at("src_rank") == rank || c.at("dst_rank") == rank) want.insert(c.dump());
      CHECK_MESSAGE(canonical(one) == want, "rank " << rank);
    }
  }
}
