// reshard._core: the Python binding of the header-only library (nanobind).
// Thin by design: layouts, plans, bound buffers, the in-process world and the
// UCX transport are the C++ library's; this file only converts between
// Python objects (DLPack tensors, dicts, a key-value store) and its types.
//
//  * Tensors arrive through DLPack (nb::ndarray): host memory, or CUDA memory
//    where the module was built with nvcc (RESHARD_PYTHON_CUDA: the CUDA copy
//    engine of tools/cuda_copy_engine.cu, one per rank on its tensors' GPU),
//    checked against the layout (dtype, element count, or shape and
//    strides), and handed to the executors as BufferViews over the tensor's
//    own memory: no copy is ever made.
//  * CUDA tensors are ordered with the caller's streams (CallerOrder): a
//    refit starts after the work enqueued so far on the caller's stream (or
//    after the caller's events) and that stream waits for its last copy.
//  * Every C++ wait runs with the GIL released; the store bootstrap
//    re-acquires it only around each call into the Python store.
//  * reshard::Error and its subclasses become reshard.Error and its
//    subclasses (python/reshard/__init__.py re-exports them), message intact.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "reshard/exec/binding.hpp"
#include "reshard/json_io.hpp"
#include "reshard/layout/rank_buffers.hpp"
#include "reshard/layout/storage.hpp"
#include "reshard/plan/plan.hpp"
#include "reshard/presets/presets.hpp"
#include "reshard/resharder.hpp"
#include "reshard/transport/bootstrap.hpp"
#include "reshard/transport/local.hpp"
#ifdef RESHARD_HAVE_UCX
#include "reshard/transport/ucx.hpp"
#endif
#ifdef RESHARD_PYTHON_CUDA
#include "reshard/cuda/device_guard.hpp"
#include "reshard/cuda/local_device.hpp"
#include "reshard/cuda/runtime.hpp"
/// tools/cuda_copy_engine.cu (nvcc): the CUDA copy engine on the current device.
std::shared_ptr<reshard::DeviceCopyEngine> make_cuda_copy_engine();
#endif

namespace nb = nanobind;
using namespace nb::literals;
using namespace reshard;

namespace {

// --- exceptions ------------------------------------------------------------

PyObject* g_error = nullptr;          // reshard.Error
PyObject* g_layout_error = nullptr;   // reshard.LayoutError(Error)
PyObject* g_transport_error = nullptr;  // reshard.TransportError(Error)
PyObject* g_not_committed = nullptr;  // reshard.RefitNotCommitted(TransportError)

/// RefitNotCommitted with its .written, .partial and .untouched (lists of
/// this rank's destination buffer names; CONTRACT.md §5).
void raise_not_committed(const RefitNotCommitted& e) {
  PyObject* exc = PyObject_CallFunction(g_not_committed, "s", e.what());
  if (!exc) return;  // (the call's own error is set)
  auto names = [](const std::vector<std::string>& v) {
    PyObject* l = PyList_New(static_cast<Py_ssize_t>(v.size()));
    for (std::size_t i = 0; l && i < v.size(); ++i) PyList_SET_ITEM(l, static_cast<Py_ssize_t>(i), PyUnicode_FromString(v[i].c_str()));
    return l;
  };
  const DestinationWrites& w = e.writes();
  for (auto [attr, v] : {std::pair{"written", &w.written}, std::pair{"partial", &w.partial}, std::pair{"untouched", &w.untouched}}) {
    PyObject* l = names(*v);
    if (l) PyObject_SetAttrString(exc, attr, l);
    Py_XDECREF(l);
  }
  PyErr_SetObject(g_not_committed, exc);
  Py_DECREF(exc);
}

void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const RefitNotCommitted& e) {
    raise_not_committed(e);
  } catch (const TransportError& e) {
    PyErr_SetString(g_transport_error, e.what());
  } catch (const LayoutError& e) {
    PyErr_SetString(g_layout_error, e.what());
  } catch (const Error& e) {
    PyErr_SetString(g_error, e.what());
  }
  // Anything else goes on to nanobind's own translators.
}

// --- dtypes ------------------------------------------------------------------

namespace dl = nb::dlpack;

/// The DLPack type of a layout dtype.
dl::dtype dl_of(DType d) {
  auto t = [](dl::dtype_code c, int bits) { return dl::dtype{static_cast<std::uint8_t>(c), static_cast<std::uint8_t>(bits), 1}; };
  switch (d) {
    case DType::f64: return t(dl::dtype_code::Float, 64);
    case DType::f32: return t(dl::dtype_code::Float, 32);
    case DType::bf16: return t(dl::dtype_code::Bfloat, 16);
    case DType::f16: return t(dl::dtype_code::Float, 16);
    case DType::fp8e4m3: return t(dl::dtype_code::Float8_E4M3FN, 8);
    case DType::fp8e5m2: return t(dl::dtype_code::Float8_E5M2, 8);
    case DType::i64: return t(dl::dtype_code::Int, 64);
    case DType::i32: return t(dl::dtype_code::Int, 32);
    case DType::u32: return t(dl::dtype_code::UInt, 32);
    case DType::i8: return t(dl::dtype_code::Int, 8);
    case DType::u8: return t(dl::dtype_code::UInt, 8);
  }
  return {};
}

std::string dl_name(dl::dtype t) {
  const auto c = static_cast<dl::dtype_code>(t.code);
  std::string base;
  switch (c) {
    case dl::dtype_code::Int: base = fmt::format("i{}", t.bits); break;
    case dl::dtype_code::UInt: base = fmt::format("u{}", t.bits); break;
    case dl::dtype_code::Float: base = fmt::format("f{}", t.bits); break;
    case dl::dtype_code::Bfloat: base = fmt::format("bf{}", t.bits); break;
    case dl::dtype_code::Bool: base = "bool"; break;
    case dl::dtype_code::Complex: base = fmt::format("complex{}", t.bits); break;
    case dl::dtype_code::Float8_E4M3FN: base = "fp8e4m3"; break;
    case dl::dtype_code::Float8_E5M2: base = "fp8e5m2"; break;
    default: base = fmt::format("DLPack type code {} ({} bits)", t.code, t.bits);
  }
  if (t.lanes != 1) base += fmt::format(" x{} lanes", t.lanes);
  return base;
}

/// The tensor's dtype is the layout's; FP8 buffers also take u8 tensors
/// (a byte carrier: numpy and some torch versions export no FP8 through DLPack).
bool dtype_ok(DType d, dl::dtype t) {
  if (t == dl_of(d)) return true;
  if ((d == DType::fp8e4m3 || d == DType::fp8e5m2) && t == dl_of(DType::u8)) return true;
  return false;
}

const char* device_name(int type) {
  switch (type) {
    case 1: return "cpu";
    case 2: return "cuda";
    case 3: return "cuda pinned host";
    case 4: return "opencl";
    case 7: return "vulkan";
    case 8: return "metal";
    case 10: return "rocm";
    case 13: return "cuda managed";
    default: return "an unknown device";
  }
}

// --- layouts -------------------------------------------------------------------

Layout layout_from_text(const std::string& text, const std::string& origin) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    layout_fail(ErrorContext{origin, "", ""}, "malformed JSON: {}", e.what());
  }
  return parse_layout(j, origin);
}

std::string layout_repr(const Layout& L) {
  std::vector<std::string> axes;
  for (const auto& a : L.mesh.axes) axes.push_back(fmt::format("{}={}", a.name, a.size));
  const auto ranks = L.mesh.global_ranks();
  std::string rs;
  if (!L.mesh.ranks.empty()) rs = ranks.size() <= 8 ? fmt::format("[{}]", fmt::join(ranks, ", ")) : fmt::format("[{}, ...]", ranks.front());
  else rs = ranks.size() == 1 ? fmt::format("{}", ranks.front()) : fmt::format("{}-{}", ranks.front(), ranks.back());
  return fmt::format("<reshard.Layout '{}': mesh {} (ranks {}), {} tensors, {} buffers>", L.origin, fmt::join(axes, " x "), rs,
                     L.tensors.size(), L.local_buffers().size());
}

/// This rank's buffers under L (what a caller allocates): name, shape,
/// elements, dtype, the tensors in it.
nb::list list_buffers(const Layout& L, std::int64_t rank) {
  nb::list out;
  for (const auto& b : rank_buffers(L, rank)) {
    nb::dict d;
    d["name"] = b.name;
    d["shape"] = nb::tuple(nb::cast(b.shape));
    d["elements"] = b.elements;
    d["dtype"] = std::string(to_string(b.dtype));
    d["bytes"] = b.bytes;
    std::vector<std::string> parts;
    for (const auto& p : b.parts) parts.push_back(p.name);
    d["tensors"] = parts;
    out.append(d);
  }
  return out;
}

/// The slot runs of one buffer of a rank: (first slot, count, tensor index or
/// -1 for padding, global row-major index of the first element), each run
/// that continues the one before it (the next slots and the same tensor's
/// next elements, or padding after padding) merged into it: a whole tensor
/// is one run, not one per row.
std::vector<std::int64_t> runs_of(const Layout& L, const RankBuffer& b) {
  std::vector<std::int64_t> runs;
  nb::gil_scoped_release nogil;
  for_each_slot_run(L, b, [&](std::int64_t at, std::int64_t n, int t, std::int64_t g) {
    const std::size_t k = runs.size();
    if (k >= 4 && runs[k - 4] + runs[k - 3] == at && runs[k - 2] == t && (t < 0 || runs[k - 1] + runs[k - 3] == g)) {
      runs[k - 3] += n;
      return;
    }
    runs.insert(runs.end(), {at, n, std::int64_t{t}, g});
  });
  return runs;
}

/// Runs as one (runs, 4) int64 numpy array that owns them.
nb::object run_columns(std::vector<std::int64_t>&& v) {
  auto* runs = new std::vector<std::int64_t>(std::move(v));
  nb::capsule owner(runs, [](void* p) noexcept { delete static_cast<std::vector<std::int64_t>*>(p); });
  const std::size_t shape[2] = {runs->size() / 4, 4};
  return nb::cast(nb::ndarray<nb::numpy, std::int64_t>(runs->data(), 2, shape, owner));
}

/// Where each slot of a rank's buffer comes from: runs of (first slot, count,
/// tensor name or None for padding, global row-major index of the first
/// element). For checking a layout against memory a framework filled
/// (reshard.engines traces vLLM's loaders). With `columns`, one (runs, 4)
/// int64 numpy array instead, the tensor as its index in `Layout.tensors`
/// (-1: padding): a traced layout of a large model has millions of runs.
/// Without a buffer name, a dict of every buffer of the rank (columns only).
nb::object slot_runs(const Layout& L, std::int64_t rank, std::optional<std::string> buffer, bool columns) {
  if (!buffer) {
    if (!columns) fail("{}: slot_runs of all buffers of a rank: give columns=True", L.origin);
    nb::dict all;
    for (const auto& b : rank_buffers(L, rank)) all[nb::cast(b.name)] = run_columns(runs_of(L, b));
    return all;
  }
  for (const auto& b : rank_buffers(L, rank)) {
    if (b.name != *buffer) continue;
    auto runs = runs_of(L, b);
    if (columns) return run_columns(std::move(runs));
    nb::list out;
    for (std::size_t i = 0; i < runs.size(); i += 4) {
      const auto t = runs[i + 2];
      nb::object name = t < 0 ? nb::none() : nb::cast(L.tensors[static_cast<std::size_t>(t)].name);
      out.append(nb::make_tuple(runs[i], runs[i + 1], name, runs[i + 3]));
    }
    return out;
  }
  throw LayoutError(ErrorContext{L.origin, "", "buffers"}, fmt::format("rank {} holds no buffer '{}'", rank, *buffer));
}

// --- buffers -------------------------------------------------------------------

/// Tensors are kept alive (a reference to the caller's object) while C++ uses their memory.
using Keep = std::vector<nb::object>;
/// One side of one rank: which buffers the layout gives it.
struct Expected {
  std::string name;
  std::vector<std::int64_t> shape;
  DType dtype;
};

std::vector<Expected> expected_buffers(const Layout& L, std::int64_t rank) {
  std::vector<Expected> out;
  for (auto& b : rank_buffers(L, rank)) out.push_back({std::move(b.name), std::move(b.shape), b.dtype});
  return out;
}

const Expected* find_expected(const std::vector<Expected>& v, const std::string& name) {
  for (const auto& e : v)
    if (e.name == name) return &e;
  return nullptr;
}

std::string names_of(const std::vector<Expected>& v) {
  if (v.empty()) return "none";
  std::vector<std::string> n;
  for (const auto& e : v) n.push_back(e.name);
  return fmt::format("{}", fmt::join(n, ", "));
}

constexpr bool has_cuda() {
#ifdef RESHARD_PYTHON_CUDA
  return true;
#else
  return false;
#endif
}

/// Where a tensor's memory is: host (CPU or CUDA pinned host memory) or a
/// GPU (CUDA device or managed memory); anything else is refused by name.
MemoryKind memory_of(int device_type, int device_id, const std::string& what, const std::string& expect) {
  if (device_type == nb::device::cpu::value || device_type == nb::device::cuda_host::value) return MemoryKind::host;
  if (device_type == nb::device::cuda::value || device_type == nb::device::cuda_managed::value) {
#ifdef RESHARD_PYTHON_CUDA
    return MemoryKind::device;
#else
    fail("{}: the tensor is in {} memory (device {}): this build of reshard moves host memory only (nvcc was not found when it "
         "was built, so it has no CUDA copy engine: reinstall it where the CUDA toolkit is, reshard.has_cuda says which); expected a "
         "CPU tensor ({})",
         what, device_name(device_type), device_id, expect);
#endif
  }
  fail("{}: the tensor is in {} memory (DLPack device type {}, id {}): reshard moves host{} memory; expected {}", what,
       device_name(device_type), device_type, device_id, has_cuda() ? " and CUDA" : "", expect);
}

/// Checks one tensor against the buffer the layout gives this rank and
/// returns a view of the tensor's own memory. Accepted: a contiguous tensor
/// of the buffer's dtype and element count (any shape), or a strided tensor
/// of exactly the buffer's shape (non-negative strides). Requires the GIL.
template <class A>
BufferView view_of_array(const A& a, const Expected& e, const std::string& what) {
  const std::int64_t need = product(e.shape);
  const std::string expect = fmt::format("{} elements of {}, shape [{}]", need, to_string(e.dtype), fmt::join(e.shape, ", "));
  const MemoryKind memory = memory_of(a.device_type(), a.device_id(), what, expect);
  if (!dtype_ok(e.dtype, a.dtype()))
    fail("{}: dtype {} but the layout stores {} (expected {})", what, dl_name(a.dtype()), to_string(e.dtype), expect);
  const std::size_t nd = a.ndim();
  std::vector<std::int64_t> shape(nd), strides(nd);
  for (std::size_t i = 0; i < nd; ++i) {
    shape[i] = static_cast<std::int64_t>(a.shape(i));
    strides[i] = a.stride(i);
  }
  const auto size = static_cast<std::int64_t>(a.size());
  bool contiguous = true;
  {
    std::int64_t s = 1;
    for (std::size_t i = nd; i-- > 0;) {
      if (shape[i] != 1 && strides[i] != s) contiguous = false;
      s *= shape[i];
    }
  }
  const auto eb = element_bytes(e.dtype);
  auto* data = const_cast<void*>(static_cast<const void*>(a.data()));
  const std::string got = fmt::format("shape [{}], strides [{}] ({} elements{})", fmt::join(shape, ", "), fmt::join(strides, ", "), size,
                                      contiguous ? ", contiguous" : ", not contiguous");
  BufferView v;
  v.data = data;
  v.element_bytes = eb;
  v.memory = memory;
  if (contiguous) {
    if (size != need) fail("{}: {} elements but the layout gives this rank {}; got {}", what, size, expect, got);
    v.elements = size;
    return v;
  }
  if (shape != e.shape)
    fail("{}: a tensor that is not contiguous must have the buffer's shape exactly (expected {}); got {}", what, expect, got);
  for (auto s : strides)
    if (s < 0) fail("{}: negative strides are not supported; got {}", what, got);
  v.shape = shape;
  v.strides = strides;
  return v;  // bind_buffers checks that the strides map no two elements to one place
}

struct RankViews {
  LocalBuffers views;
  Keep keep;  ///< the tensors, alive while their memory is used
  int device = -1;    ///< the GPU of the rank's CUDA tensors; -1: host memory
  std::string first;  ///< the first buffer seen and where it is (for errors)
};

/// A rank's tensors are all host memory or all on one GPU (one copy engine a rank).
void note_device(RankViews& out, const BufferView& v, int device_id, const std::string& what) {
  const int device = v.memory == MemoryKind::device ? device_id : -1;
  const std::string where = device < 0 ? std::string("host memory") : fmt::format("cuda:{}", device);
  if (out.first.empty()) {
    out.device = device;
    out.first = fmt::format("{} is in {}", what, where);
  } else if (device != out.device) {
    fail("{} is in {}, but {}: a rank's tensors must all be in host memory or all on one GPU", what, where, out.first);
  }
}

BufferView view_of_tensor(nb::handle obj, const Expected& e, std::int64_t rank, const char* side, bool writable, RankViews& out) {
  const std::string what = fmt::format("rank {}: {} buffer '{}'", rank, side, e.name);
  nb::ndarray<nb::ro> ro;
  const bool any = nb::try_cast(obj, ro, false);
  if (!any)
    fail("{}: expected a tensor ({} elements of {}) through DLPack (torch.Tensor, numpy.ndarray, ...); got a {}", what, product(e.shape),
         to_string(e.dtype), nb::inst_name(obj).c_str());
  BufferView v;
  if (writable) {
    nb::ndarray<> w;
    if (!nb::try_cast(obj, w, false)) {
      v = view_of_array(ro, e, what);  // the dtype and shape errors first, if any
      fail("{}: the tensor is read-only; a destination buffer is written in place", what);
    }
    v = view_of_array(w, e, what);
  } else {
    v = view_of_array(ro, e, what);
  }
  note_device(out, v, ro.device_id(), what);
  out.keep.push_back(nb::borrow(obj));
  return v;
}

/// One rank's buffers: `plain` maps names to tensors (each name is a source
/// or a destination buffer of this rank, never both), or `src` / `dst` give
/// the two sides apart. Requires the GIL.
void add_side(RankViews& out, const Layout& L, std::int64_t rank, nb::handle dict, bool dst, bool back = false) {
  const char* side = back ? "back destination" : dst ? "destination" : "source";
  if (!nb::isinstance<nb::dict>(dict)) fail("rank {}: {} buffers must be a dict of buffer name -> tensor; got a {}", rank, side, nb::inst_name(dict).c_str());
  const auto exp = expected_buffers(L, rank);
  for (auto [k, v] : nb::borrow<nb::dict>(dict)) {
    if (!nb::isinstance<nb::str>(k)) fail("rank {}: {} buffer names must be str; got a {}", rank, side, nb::inst_name(k).c_str());
    const std::string name = nb::cast<std::string>(k);
    const Expected* e = find_expected(exp, name);
    if (!e)
      fail("rank {}: {} buffer '{}' is not a buffer {} gives this rank (it has: {})", rank, side, name, L.origin, names_of(exp));
    (back ? out.views.dst_back : dst ? out.views.dst : out.views.src)[name] = view_of_tensor(v, *e, rank, side, dst, out);
  }
}

RankViews rank_views(const Layout& src, const Layout& dst, std::int64_t rank, nb::handle given) {
  RankViews out;
  if (!nb::isinstance<nb::dict>(given)) fail("rank {}: buffers must be a dict of buffer name -> tensor; got a {}", rank, nb::inst_name(given).c_str());
  nb::dict d = nb::borrow<nb::dict>(given);
  // The split form {"src": {...}, "dst": {...}} (an extension: colocated
  // ranks may have a buffer of the same name on both sides).
  if (d.size() > 0 && d.size() <= 2) {
    bool split = true;
    for (auto [k, v] : d)
      if (!nb::isinstance<nb::str>(k) || !nb::isinstance<nb::dict>(v) || (nb::cast<std::string>(k) != "src" && nb::cast<std::string>(k) != "dst"))
        split = false;
    if (split) {
      if (d.contains("src")) add_side(out, src, rank, d["src"], false);
      if (d.contains("dst")) add_side(out, dst, rank, d["dst"], true);
      return out;
    }
  }
  const auto es = expected_buffers(src, rank), ed = expected_buffers(dst, rank);
  nb::dict s, t;
  for (auto [k, v] : d) {
    if (!nb::isinstance<nb::str>(k)) fail("rank {}: buffer names must be str; got a {}", rank, nb::inst_name(k).c_str());
    const std::string name = nb::cast<std::string>(k);
    const bool in_s = find_expected(es, name) != nullptr, in_d = find_expected(ed, name) != nullptr;
    if (in_s && in_d)
      fail("rank {}: buffer '{}' is a source buffer ({}) and a destination buffer ({}) of this rank: give the two apart as "
           "{{'src': {{...}}, 'dst': {{...}}}}",
           rank, name, src.origin, dst.origin);
    if (!in_s && !in_d)
      fail("rank {}: buffer '{}' is neither a source buffer of {} (this rank has: {}) nor a destination buffer of {} (this rank has: {})", rank,
           name, src.origin, names_of(es), dst.origin, names_of(ed));
    (in_s ? s : t)[k] = v;
  }
  add_side(out, src, rank, s, false);
  add_side(out, dst, rank, t, true);
  return out;
}

// --- CUDA streams ---------------------------------------------------------------

/// The caller's side of a refit of CUDA tensors, as raw handles from Python
/// (reshard/__init__.py takes them from torch.cuda streams and events).
struct CallerOrder {
  std::uintptr_t stream = 0;            ///< the caller's stream; 0: the legacy default stream (torch's default stream)
  std::uintptr_t sources_final = 0;     ///< an event after which the sources are final; 0: recorded on `stream` now
  std::uintptr_t destination_free = 0;  ///< an event after which nothing reads the destination; 0: sources_final
  bool wait = false;                    ///< the host waits for every copy before the refit returns
  bool given() const { return stream || sources_final || destination_free || wait; }
};

/// A copy engine on `device` for a rank whose tensors are there; nullptr for host memory.
std::shared_ptr<DeviceCopyEngine> engine_for(int device) {
  if (device < 0) return nullptr;
#ifdef RESHARD_PYTHON_CUDA
  if (cuda::visible_devices() <= device)
    fail("CUDA tensors on cuda:{}, but this process sees {} CUDA device(s)", device, cuda::visible_devices());
  const cuda::DeviceGuard guard(device);
  return make_cuda_copy_engine();
#else
  fail("CUDA tensors, but this build of reshard has no CUDA copy engine");
#endif
}

/// One refit ordered with the caller's stream: it starts after the work
/// enqueued on that stream so far (or the caller's events), and the stream
/// waits for its last copy, so the caller's next kernels read the new
/// weights without a host wait. Host buffers: a plain refit.
template <class R>
RefitReport refit_in_order(R& r, DeviceCopyEngine* engine, std::optional<std::uint64_t> version, const CallerOrder& o,
                           std::int64_t rank) {
  if (!engine) {
    if (o.given())
      fail("rank {}: a stream, events or wait=True order CUDA tensors, but this rank's tensors are host memory: nothing would "
           "wait for them",
           rank);
    return version ? r.refit(*version) : r.refit();
  }
#ifdef RESHARD_PYTHON_CUDA
  // Handle 0 is the legacy default stream for CUDA, but "the copy stream" for the engine.
  const auto stream = o.stream ? reinterpret_cast<DeviceStream>(o.stream) : static_cast<DeviceStream>(cudaStreamLegacy);
  StreamOrder so;
  so.sources_final = o.sources_final ? reinterpret_cast<DeviceEvent>(o.sources_final) : engine->record(exec_detail::kCallerSlot, stream);
  so.destination_free = o.destination_free ? reinterpret_cast<DeviceEvent>(o.destination_free) : so.sources_final;
  so.wait = o.wait;
  RefitReport rep = version ? r.refit(*version, so) : r.refit(so);
  engine->stream_wait(rep.done, stream);
  return rep;
#else
  (void)version;
  (void)o;
  fail("rank {}: CUDA tensors, but this build of reshard has no CUDA copy engine", rank);
#endif
}

// --- schedules -----------------------------------------------------------------

struct PySchedule {
  std::shared_ptr<const Schedule> s;
  std::shared_ptr<const Layout> src, dst;  ///< what it was planned from (the stats' replica shares)
  std::string src_origin, dst_origin;
};

std::string schedule_json(const Schedule& s) {
  std::ostringstream os;
  write_schedule_json(os, s);
  return os.str();
}

PySchedule make_plan(const Layout& src, const Layout& dst, std::optional<std::int64_t> rank, int threads, bool cast) {
  PlanOptions po;
  po.only_rank = rank ? *rank : -1;
  po.threads = threads;
  po.cast = cast;
  if (rank && *rank < 0) fail("plan: rank {} is negative", *rank);
  Schedule s;
  {
    nb::gil_scoped_release nogil;
    s = plan(src, dst, po);
  }
  return PySchedule{std::make_shared<const Schedule>(std::move(s)), std::make_shared<const Layout>(src), std::make_shared<const Layout>(dst),
                    src.origin, dst.origin};
}

// --- reports -------------------------------------------------------------------

nb::dict report_dict(const RefitReport& r) {
  nb::dict d;
  d["bytes_moved"] = r.bytes_sent;
  d["bytes_sent"] = r.bytes_sent;
  d["bytes_received"] = r.bytes_received;
  d["local_bytes"] = r.local_bytes;
  d["messages_sent"] = r.messages_sent;
  d["messages_received"] = r.messages_received;
  d["messages"] = r.messages_sent;
  d["waves"] = r.waves;
  d["peak_staging_bytes"] = r.peak_staging_bytes;
  d["seconds"] = r.seconds;
  d["plan_bytes_sent"] = r.plan_bytes_sent;
  d["plan_bytes_received"] = r.plan_bytes_received;
  d["plan_local_bytes"] = r.plan_local_bytes;
  d["version"] = r.version;
  d["refit_index"] = r.refit_index;
  return d;
}

std::vector<std::int64_t> world_of(const Layout& src, const Layout& dst) {
  std::set<std::int64_t> w;
  for (auto r : src.mesh.global_ranks()) w.insert(r);
  for (auto r : dst.mesh.global_ranks()) w.insert(r);
  return {w.begin(), w.end()};
}

ExecutorOptions executor_options(double timeout_s, std::optional<std::int64_t> staging_budget) {
  ExecutorOptions eo;
  if (!(timeout_s > 0)) fail("timeout must be positive (seconds); got {}", timeout_s);
  eo.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000));
  if (staging_budget) {
    if (*staging_budget <= 0) fail("staging_budget must be positive (bytes); got {}", *staging_budget);
    eo.staging_budget = *staging_budget;
  }
  return eo;
}

/// Every rank of both layouts as a thread of this process (LocalWorld).
nb::dict refit_local(const Layout& src, const Layout& dst, nb::handle buffers, int iterations, double timeout_s,
                     std::optional<std::int64_t> staging_budget, bool cast, const CallerOrder& order) {
  if (!nb::isinstance<nb::dict>(buffers)) fail("refit_local: buffers must be a dict of global rank -> {{buffer name: tensor}}");
  if (iterations < 1) fail("refit_local: iterations must be at least 1; got {}", iterations);
  const auto ranks = world_of(src, dst);
  std::map<std::int64_t, RankViews> views;
  for (auto [k, v] : nb::borrow<nb::dict>(buffers)) {
    if (!nb::isinstance<nb::int_>(k)) fail("refit_local: buffers are keyed by global rank (int); got a {} key", nb::inst_name(k).c_str());
    const auto r = nb::cast<std::int64_t>(k);
    if (!std::binary_search(ranks.begin(), ranks.end(), r))
      fail("refit_local: rank {} is in neither layout ({} has ranks {}; {} has ranks {})", r, src.origin, fmt::join(src.mesh.global_ranks(), ","),
           dst.origin, fmt::join(dst.mesh.global_ranks(), ","));
    views.emplace(r, rank_views(src, dst, r, v));
  }
  // Each rank's own check first, so a bad buffer is named before any thread starts.
  for (auto r : ranks) {
    static const std::map<std::string, BufferView> none;
    auto it = views.find(r);
    const bool gpu = it != views.end() && it->second.device >= 0;
    auto s = bind_buffers(src, r, it == views.end() ? none : it->second.views.src, "source", gpu);
    auto d = bind_buffers(dst, r, it == views.end() ? none : it->second.views.dst, "destination", gpu);
    check_no_overlap(r, {&s}, {&d});
  }
  // CUDA tensors: the world moves bytes with cudaMemcpy, each such rank has a copy engine on its GPU.
  bool any_gpu = false;
  for (const auto& [r, v] : views) any_gpu = any_gpu || v.device >= 0;
  ResharderOptions ro;
  ro.executor = executor_options(timeout_s, staging_budget);
  ro.plan.cast = cast;
  std::vector<RefitReport> reports(ranks.size());
  std::vector<std::vector<Clock::time_point>> t0(ranks.size()), t1(ranks.size());
  double plan_seconds = 0;
  std::int64_t transport_bytes = 0;
  {
    nb::gil_scoped_release nogil;
    PlanOptions po = ro.plan;
    po.threads = 0;
    ro.schedule = std::make_shared<const Schedule>(plan(src, dst, po));
    plan_seconds = ro.schedule->stats.plan_seconds;
    auto run_rank = [&]<class T>(T& t) {
      const auto i = static_cast<std::size_t>(std::lower_bound(ranks.begin(), ranks.end(), t.rank()) - ranks.begin());
      static const LocalBuffers none;
      auto it = views.find(t.rank());
      ResharderOptions mine = ro;
      mine.executor.device = engine_for(it == views.end() ? -1 : it->second.device);
      Resharder<Layout, T> r(src, dst, it == views.end() ? none : it->second.views, t, mine);
      for (int k = 0; k < iterations; ++k) {
        t.all_gather({}, Clock::now() + ro.executor.timeout);
        t0[i].push_back(Clock::now());
        // Synchronous, as its timing says: GPU ranks wait for their copies; host ranks have no streams.
        CallerOrder o = order;
        o.wait = true;
        reports[i] = refit_in_order(r, mine.executor.device.get(), std::nullopt, mine.executor.device ? o : CallerOrder{}, t.rank());
        t1[i].push_back(Clock::now());
      }
    };
    if (any_gpu) {
#ifdef RESHARD_PYTHON_CUDA
      LocalWorld world(ranks, cuda::device_world_options());
      world.run([&](LocalTransport& lt) {
        cuda::LocalDeviceTransport t(lt);
        run_rank(t);
      });
      transport_bytes = world.total_stats().bytes_sent;
#endif
    } else {
      LocalWorld world(ranks);
      world.run([&](LocalTransport& t) { run_rank(t); });
      transport_bytes = world.total_stats().bytes_sent;
    }
  }
  RefitReport sum;
  std::int64_t max_rank = 0;
  for (const auto& r : reports) {
    sum.bytes_sent += r.bytes_sent;
    sum.bytes_received += r.bytes_received;
    sum.local_bytes += r.local_bytes;
    sum.messages_sent += r.messages_sent;
    sum.plan_bytes_sent += r.plan_bytes_sent;
    sum.waves = std::max(sum.waves, r.waves);
    sum.peak_staging_bytes = std::max(sum.peak_staging_bytes, r.peak_staging_bytes);
    max_rank = std::max({max_rank, r.bytes_sent, r.bytes_received});
  }
  std::vector<double> secs;
  for (int k = 0; k < iterations; ++k) {
    auto a = Clock::time_point::max(), b = Clock::time_point::min();
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      a = std::min(a, t0[i][static_cast<std::size_t>(k)]);
      b = std::max(b, t1[i][static_cast<std::size_t>(k)]);
    }
    secs.push_back(std::chrono::duration<double>(b - a).count());
  }
  auto sorted = secs;
  std::sort(sorted.begin(), sorted.end());
  const auto n = sorted.size();
  nb::dict d;
  d["transport"] = "local";
  d["bytes_moved"] = sum.bytes_sent;
  d["local_bytes"] = sum.local_bytes;
  d["plan_bytes"] = sum.plan_bytes_sent;
  d["messages"] = sum.messages_sent;
  d["waves"] = sum.waves;
  d["peak_staging_bytes"] = sum.peak_staging_bytes;
  d["max_rank_bytes"] = max_rank;
  d["seconds"] = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  d["iteration_seconds"] = secs;
  d["plan_seconds"] = plan_seconds;
  d["ranks"] = ranks;
  d["src_ranks"] = src.mesh.size();
  d["dst_ranks"] = dst.mesh.size();
  d["transport_bytes"] = transport_bytes;
  d["version"] = reports.empty() ? 0 : reports.front().version;
  return d;
}

// --- the UCX endpoint with a key-value store bootstrap -------------------------

#ifdef RESHARD_HAVE_UCX
/// The all-gather over a store, through the Python adapter
/// (reshard._StoreAdapter: set(key, bytes), poll(keys) -> [bytes | None],
/// delete(key)). Keys: "{prefix}/{round}/{rank}". Waits with the GIL
/// released, calling the transport's idle callback, until the deadline;
/// then a TransportError naming the ranks that never arrived.
struct StoreGather {
  nb::handle adapter;  ///< borrowed: the owning PyResharder holds the reference
  std::string prefix;
  std::int64_t me = -1;
  std::vector<std::int64_t> ranks;
  std::uint64_t round = 0;

  std::string key(std::uint64_t r, std::int64_t rank) const { return fmt::format("{}/{}/{}", prefix, r, rank); }

  Blobs operator()(std::span<const std::byte> mine, Deadline deadline, const Bootstrap::Idle& idle) {
    const std::uint64_t r = round++;
    const auto start = Clock::now();
    const std::size_t n = ranks.size();
    Blobs out(n);
    std::vector<char> have(n, 0);
    auto absent = [&] {
      std::vector<std::int64_t> a;
      for (std::size_t i = 0; i < n; ++i)
        if (!have[i]) a.push_back(ranks[i]);
      return a;
    };
    auto python = [&](auto&& fn) {
      nb::gil_scoped_acquire gil;
      try {
        fn();
      } catch (nb::python_error& e) {
        // The exception's type and first line (torch appends its C++ stack).
        std::string text = nb::str(e.value()).c_str();
        text = text.substr(0, text.find('\n'));
        const auto a = absent();
        throw TransportError(fmt::format("store bootstrap: rank {}: round {}: the store failed ({}: {}){}", me, r,
                                         nb::inst_name(e.value()).c_str(), text,
                                         a.empty() ? std::string() : fmt::format(" while rank{} {} had not arrived", a.size() == 1 ? "" : "s",
                                                                                 fmt::join(a, ", "))));
      }
    };
    python([&] {
      adapter.attr("set")(key(r, me), nb::bytes(reinterpret_cast<const char*>(mine.data()), mine.size()));
      // Every rank has read round r - 2 once it posts round r - 1, which this rank read.
      if (r >= 2) adapter.attr("delete")(key(r - 2, me));
    });
    long sleep_us = 50;
    while (true) {
      std::vector<std::size_t> missing;
      for (std::size_t i = 0; i < n; ++i)
        if (!have[i]) missing.push_back(i);
      if (missing.empty()) break;
      python([&] {
        nb::list keys;
        for (auto i : missing) keys.append(key(r, ranks[i]));
        nb::object got = adapter.attr("poll")(keys);
        std::size_t j = 0;
        for (nb::handle v : got) {
          if (j >= missing.size()) break;
          const auto i = missing[j++];
          if (v.is_none()) continue;
          nb::bytes b = nb::borrow<nb::bytes>(v);
          const auto* p = reinterpret_cast<const std::byte*>(b.c_str());
          out[i].assign(p, p + b.size());
          have[i] = 1;
        }
      });
      if (std::all_of(have.begin(), have.end(), [](char c) { return c != 0; })) break;
      if (idle) idle();
      if (Clock::now() >= deadline) {
        const auto missing_ranks = absent();
        throw TransportError(fmt::format(
            "store bootstrap: rank {}: round {} timed out after {:.1f} s: rank{} {} never arrived (dead, stuck, or not running the same "
            "program with the same store prefix '{}')",
            me, r, std::chrono::duration<double>(Clock::now() - start).count(), missing_ranks.size() == 1 ? "" : "s",
            fmt::join(missing_ranks, ", "),
            prefix));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      sleep_us = std::min<long>(sleep_us * 2, 5'000);
    }
    return out;
  }
};

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

class PyResharder {
 public:
  PyResharder(Layout src, Layout dst, std::int64_t rank, nb::handle buffers, nb::object adapter, std::string prefix, double timeout_s,
              double stall_s, std::string protocol, std::vector<std::pair<std::string, std::string>> ucx_config,
              std::optional<std::int64_t> staging_budget, bool fast_data_endpoint, bool double_buffered, nb::handle back_buffers,
              bool delta, std::optional<std::int64_t> shadow_budget, std::optional<double> dense_above, bool cast)
      : src_(std::move(src)), dst_(std::move(dst)), rank_(rank), adapter_(std::move(adapter)) {
    ranks_ = world_of(src_, dst_);
    if (!std::binary_search(ranks_.begin(), ranks_.end(), rank))
      fail("Resharder: rank {} is in neither layout ({} has ranks {}; {} has ranks {})", rank, src_.origin, fmt::join(src_.mesh.global_ranks(), ","),
           dst_.origin, fmt::join(dst_.mesh.global_ranks(), ","));
    // A bad buffer here fails every rank's constructor, after the bootstrap
    // (the others would otherwise wait for this rank until their deadline).
    std::string bad;
    try {
      views_ = rank_views(src_, dst_, rank, buffers);
      if (!back_buffers.is_none()) {
        if (!double_buffered) fail("rank {}: back_buffers were given but double_buffered is off", rank);
        add_side(views_, dst_, rank, back_buffers, true, true);
      }
      engine_ = engine_for(views_.device);
    } catch (const Error& e) {
      bad = e.what();
    }
    ResharderOptions ro;
    ro.executor = executor_options(timeout_s, staging_budget);
    ro.executor.device = engine_;
    ro.double_buffered = double_buffered;
    ro.plan.cast = cast;
    if (!delta && (shadow_budget || dense_above)) fail("Resharder: shadow_budget and dense_above apply to delta refits; delta is off");
    ro.delta.enabled = delta_ = delta;
    double_buffered_ = double_buffered;
    if (shadow_budget) {
      if (*shadow_budget < 0) fail("Resharder: shadow_budget must be >= 0 (bytes); got {}", *shadow_budget);
      ro.delta.shadow_budget = *shadow_budget;
    }
    if (dense_above) {
      if (!(*dense_above >= 0 && *dense_above <= 1)) fail("Resharder: dense_above must be a fraction in [0, 1]; got {}", *dense_above);
      ro.delta.dense_above = *dense_above;
    }
    UcxOptions uo;
    uo.protocol = parse_ucx_protocol(protocol);
    if (!(stall_s > 0)) fail("Resharder: stall_timeout must be positive (seconds); got {}", stall_s);
    uo.stall_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(stall_s * 1000));
    uo.ucx_config = std::move(ucx_config);
    uo.fast_data_endpoint = fast_data_endpoint;
    StoreGather g{adapter_, std::move(prefix), rank, ranks_};
    nb::gil_scoped_release nogil;
    t_ = std::make_unique<UcxTransport>(make_bootstrap(rank, ranks_, std::move(g), "store"), uo);
    try {
      const auto* p = reinterpret_cast<const std::byte*>(bad.data());
      const Blobs verdicts = t_->all_gather(std::span<const std::byte>(p, bad.size()), Clock::now() + uo.stall_timeout);
      if (!bad.empty()) throw Error(bad);
      for (std::size_t i = 0; i < verdicts.size(); ++i)
        if (!verdicts[i].empty())
          throw Error(fmt::format("rank {}: Resharder: rank {} failed to set up: {}", rank, ranks_[i],
                                  std::string(reinterpret_cast<const char*>(verdicts[i].data()), verdicts[i].size())));
      r_ = std::make_unique<Resharder<Layout, UcxTransport>>(src_, dst_, views_.views, *t_, ro);
    } catch (...) {
      t_.reset();
      throw;
    }
  }
  /// Dropped without close(): no barrier; the transport goes at once (its
  /// destructor progresses UCX for up to about 2 s while busy peers do not
  /// answer) with the GIL released, so the other Python threads run
  /// meanwhile. At interpreter exit the GIL is kept (releasing it there
  /// would end this thread).
  ~PyResharder() {
    if (!t_) return;
    if (interpreter_finalizing()) {
      r_.reset();
      t_.reset();
      return;
    }
    nb::gil_scoped_release nogil;
    r_.reset();
    t_.reset();
  }

  nb::dict refit(std::optional<std::uint64_t> version, const CallerOrder& order) {
    if (!r_) fail("Resharder (rank {}): closed", rank_);
    RefitReport rep;
    {
      nb::gil_scoped_release nogil;
      rep = refit_in_order(*r_, engine_.get(), version, order, rank_);
    }
    nb::dict d = report_dict(rep);
    d["transport"] = "ucx";
    d["rank"] = rank_;
    d["device"] = views_.device >= 0 ? nb::cast(fmt::format("cuda:{}", views_.device)) : nb::cast("cpu");
    if (delta_) {
      // The set this refit wrote, now served.
      const DeltaExecutor<UcxTransport>& ex = r_->delta_executor(double_buffered_ ? r_->serving_set() : 0);
      const DeltaStats& s = ex.last_delta();
      nb::dict x;
      x["mode"] = s.mode;
      x["changed_fraction"] = s.mode == "prime" || s.mode == "streak" ? nb::none() : nb::cast(s.changed_fraction());
      x["changed"] = s.changed;
      x["compared"] = s.compared;
      x["payload_bytes"] = s.payload_bytes;
      x["diff_seconds"] = s.diff_seconds;
      x["scatter_seconds"] = s.scatter_seconds;
      x["shadow_bytes"] = ex.shadow_bytes();
      x["staging_bytes"] = ex.staging_bytes();
      d["delta"] = x;
    }
    return d;
  }

  void invalidate_delta_base() {
    if (!r_) fail("Resharder (rank {}): closed", rank_);
    r_->invalidate_delta_base();
  }

  /// Collective: the ranks agree they are done, then the transport goes.
  void close(bool barrier) {
    if (!t_) return;
    nb::gil_scoped_release nogil;  // the transport's destructor progresses UCX for a while
    if (barrier) {
      try {
        t_->all_gather({}, Clock::now() + std::chrono::seconds(30));
      } catch (...) {
        r_.reset();
        t_.reset();
        throw;
      }
    }
    r_.reset();
    t_.reset();
  }

  std::int64_t rank() const { return rank_; }
  int device() const { return views_.device; }
  const std::vector<std::int64_t>& world() const { return ranks_; }
  std::uint64_t last_good_version() const { return r_ ? r_->last_good_version() : 0; }
  std::string state() const { return r_ ? to_string(r_->state()) : "closed"; }
  int serving_set() const { return r_ ? r_->serving_set() : 0; }
  const Layout& src() const { return src_; }
  const Layout& dst() const { return dst_; }
  PySchedule schedule() const {
    if (!r_) fail("Resharder (rank {}): closed", rank_);
    return PySchedule{std::make_shared<const Schedule>(r_->schedule()), std::make_shared<const Layout>(src_),
                      std::make_shared<const Layout>(dst_), src_.origin, dst_.origin};
  }

 private:
  Layout src_, dst_;
  std::int64_t rank_;
  std::vector<std::int64_t> ranks_;
  nb::object adapter_;
  RankViews views_;
  std::shared_ptr<DeviceCopyEngine> engine_;  ///< CUDA tensors: the copy engine on their GPU
  std::unique_ptr<UcxTransport> t_;
  std::unique_ptr<Resharder<Layout, UcxTransport>> r_;
  bool delta_ = false, double_buffered_ = false;
};
#endif

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "reshard's C++ core (see the package reshard for the documented API)";
  g_error = PyErr_NewException("reshard.Error", PyExc_RuntimeError, nullptr);
  g_layout_error = PyErr_NewException("reshard.LayoutError", g_error, nullptr);
  g_transport_error = PyErr_NewException("reshard.TransportError", g_error, nullptr);
  {
    // Class defaults: an instance raised from Python (not from a refit) names no buffers.
    nb::dict attrs;
    for (const char* k : {"written", "partial", "untouched"}) attrs[k] = nb::tuple();
    g_not_committed = PyErr_NewException("reshard.RefitNotCommitted", g_transport_error, attrs.ptr());
  }
  m.attr("Error") = nb::handle(g_error);
  m.attr("LayoutError") = nb::handle(g_layout_error);
  m.attr("TransportError") = nb::handle(g_transport_error);
  m.attr("RefitNotCommitted") = nb::handle(g_not_committed);
  nb::register_exception_translator(translate);
#ifdef RESHARD_HAVE_UCX
  m.attr("has_ucx") = true;
  m.def("ucx_info", [] {
    const auto u = cuda::probe_ucx_memory();
    nb::dict d;
    d["version"] = u.version;
    d["host"] = u.host;
    d["cuda"] = u.cuda;
    d["cuda_managed"] = u.cuda_managed;
    d["summary"] = u.summary();
    return d;
  });
#else
  m.attr("has_ucx") = false;
#endif

  nb::class_<Layout>(m, "Layout")
      .def_prop_ro("origin", [](const Layout& L) { return L.origin; })
      .def_prop_ro("ranks", [](const Layout& L) { return L.mesh.global_ranks(); })
      .def_prop_ro("mesh",
                   [](const Layout& L) {
                     std::vector<std::pair<std::string, std::int64_t>> a;
                     for (const auto& x : L.mesh.axes) a.emplace_back(x.name, x.size);
                     return a;
                   })
      .def_prop_ro("tensors",
                   [](const Layout& L) {
                     std::vector<std::string> n;
                     for (const auto& t : L.tensors) n.push_back(t.name);
                     return n;
                   })
      .def("tensor",
           [](const Layout& L, const std::string& name) {
             const int t = L.find_tensor(name);
             if (t < 0) fail("{}: no tensor named '{}'", L.origin, name);
             const auto& ts = L.tensors[static_cast<std::size_t>(t)];
             nb::dict d;
             d["name"] = ts.name;
             d["shape"] = nb::tuple(nb::cast(ts.shape));
             d["dtype"] = std::string(to_string(ts.dtype));
             d["buffer"] = ts.buffer >= 0 ? nb::cast(L.buffers[static_cast<std::size_t>(ts.buffer)].name) : nb::none();
             if (!ts.rows_of.empty()) d["rows_of"] = nb::make_tuple(ts.rows_of, ts.rows_start);
             return d;
           },
           "name"_a)
      .def("buffers", &list_buffers, "rank"_a)
      .def("slot_runs", &slot_runs, "rank"_a, "buffer"_a = nb::none(), "columns"_a = false)
      .def("to_json", [](const Layout& L) { return layout_to_json(L).dump(1); })
      .def("__repr__", &layout_repr);

  m.def("read_layout", [](const std::string& path) {
    nb::gil_scoped_release nogil;
    return read_layout_file(path);
  }, "path"_a);
  m.def("layout_from_json", &layout_from_text, "text"_a, "origin"_a = "<json>");
  // The two presets take the same arguments: a config, a parallel spec (named `what` in errors), a first rank.
  auto def_preset = [&m](const char* name, auto preset, const char* what) {
    m.def(
        name,
        [preset, what](const std::string& config, const std::string& spec, std::int64_t first_rank, bool group_experts) {
          nb::gil_scoped_release nogil;
          return preset(presets::model_manifest(config, group_experts), presets::parse_parallel_spec(spec, what), first_rank);
        },
        "config_path"_a, "spec"_a, "first_rank"_a = 0, "group_experts"_a = false);
  };
  def_preset("megatron_layout", [](const auto&... a) { return presets::megatron_layout(a...); }, "train spec");
  def_preset("vllm_layout", [](const auto&... a) { return presets::vllm_layout(a...); }, "infer spec");

  nb::class_<PySchedule>(m, "Schedule")
      .def_prop_ro("stats_json", [](const PySchedule& s) { return plan_stats_json(*s.s, *s.src, *s.dst).dump(); })
      .def("to_json", [](const PySchedule& s) { return schedule_json(*s.s); })
      .def_prop_ro("copies", [](const PySchedule& s) { return s.s->copies.size(); })
      .def_prop_ro("only_rank", [](const PySchedule& s) -> std::optional<std::int64_t> {
        if (s.s->only_rank < 0) return std::nullopt;
        return s.s->only_rank;
      })
      .def_ro("src_origin", &PySchedule::src_origin)
      .def_ro("dst_origin", &PySchedule::dst_origin);
  m.def("plan", &make_plan, "src"_a, "dst"_a, "rank"_a = nb::none(), "threads"_a = 0, "cast"_a = false);

  nb::class_<CallerOrder>(m, "CallerOrder")
      .def(nb::init<>())
      .def_rw("stream", &CallerOrder::stream)
      .def_rw("sources_final", &CallerOrder::sources_final)
      .def_rw("destination_free", &CallerOrder::destination_free)
      .def_rw("wait", &CallerOrder::wait);
  m.attr("has_cuda") = has_cuda();

  m.def("refit_local", &refit_local, "src"_a, "dst"_a, "buffers"_a, "iterations"_a = 1, "timeout"_a = 300.0,
        "staging_budget"_a = nb::none(), "cast"_a = false, "order"_a = CallerOrder{});

#ifdef RESHARD_HAVE_UCX
  nb::class_<PyResharder>(m, "UcxResharder")
      .def(nb::init<Layout, Layout, std::int64_t, nb::handle, nb::object, std::string, double, double, std::string,
                    std::vector<std::pair<std::string, std::string>>, std::optional<std::int64_t>, bool, bool, nb::handle, bool,
                    std::optional<std::int64_t>, std::optional<double>, bool>(),
           "src"_a, "dst"_a, "rank"_a, "buffers"_a, "adapter"_a, "prefix"_a, "timeout"_a, "stall_timeout"_a, "protocol"_a, "ucx_config"_a,
           "staging_budget"_a = nb::none(), "fast_data_endpoint"_a = false, "double_buffered"_a = false,
           "back_buffers"_a = nb::none(), "delta"_a = false, "shadow_budget"_a = nb::none(), "dense_above"_a = nb::none(),
           "cast"_a = false)
      .def("refit", &PyResharder::refit, "version"_a = nb::none(), "order"_a = CallerOrder{})
      .def("close", &PyResharder::close, "barrier"_a = true)
      .def("invalidate_delta_base", &PyResharder::invalidate_delta_base)
      .def_prop_ro("rank", &PyResharder::rank)
      .def_prop_ro("device", &PyResharder::device)
      .def_prop_ro("world", &PyResharder::world)
      .def_prop_ro("last_good_version", &PyResharder::last_good_version)
      .def_prop_ro("state", &PyResharder::state)
      .def_prop_ro("serving_set", &PyResharder::serving_set)
      .def_prop_ro("src", &PyResharder::src)
      .def_prop_ro("dst", &PyResharder::dst)
      .def("schedule", &PyResharder::schedule);
#endif
}
