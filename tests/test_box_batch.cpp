// Batched box copies (cuda/box_batch.hpp) on the CPU: the host reference
// against the executor's host copy kernels (copy_kernels.hpp), and the CUDA
// kernel's body, run block by block and thread by thread on the host,
// against the reference: element sizes, ranks, partial ranges, misaligned
// bases, mixed batches, casts in flight, and the errors for bad input.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "error_of.hpp"
#include "reshard/cuda/box_batch.hpp"
#include "reshard/cuda/device_engine.hpp"
#include "reshard/exec/copy_kernels.hpp"

using namespace reshard;
using namespace reshard::cuda;

namespace {

/// 64-byte aligned host memory, filled with a pattern.
struct Memory {
  explicit Memory(std::size_t n, unsigned seed) : bytes(n + 64) {
    raw.reset(new std::byte[bytes + 64]);
    auto a = reinterpret_cast<std::uintptr_t>(raw.get());
    base = reinterpret_cast<std::byte*>((a + 63) & ~std::uintptr_t{63});
    std::mt19937 g(seed);
    for (std::size_t i = 0; i < bytes; ++i) base[i] = static_cast<std::byte>(g());
  }
  std::unique_ptr<std::byte[]> raw;
  std::size_t bytes;
  std::byte* base;
};

/// A random box inside a padded, permuted enclosing array: injective strides.
struct RandomBox {
  int rank = 1;
  std::int64_t extent[8]{}, stride[8]{};
  std::int64_t offset = 0, span = 0;  ///< elements reachable from the origin
};

/// `friendly` (with inner_unit): rows a multiple of 8 elements, every outer
/// stride a multiple of 16 elements and no offset, so that 16-byte units apply.
RandomBox random_box(std::mt19937& g, int rank, std::int64_t max_extent, bool inner_unit, bool friendly = false) {
  RandomBox b;
  b.rank = rank;
  std::vector<std::int64_t> full(static_cast<std::size_t>(rank));
  for (int k = 0; k < rank; ++k) {
    b.extent[k] = 1 + static_cast<std::int64_t>(g() % static_cast<unsigned>(max_extent));
    if (friendly && k == rank - 1) b.extent[k] = (b.extent[k] + 7) / 8 * 8;
    full[static_cast<std::size_t>(k)] = b.extent[k] + static_cast<std::int64_t>(g() % 3);
    if (friendly && k == rank - 1) full[static_cast<std::size_t>(k)] = (full[static_cast<std::size_t>(k)] + 15) / 16 * 16;
  }
  // Dense strides of the enclosing array in a random dim order (inner dim last when asked).
  std::vector<int> order(static_cast<std::size_t>(rank));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), g);
  if (inner_unit) {
    std::erase(order, rank - 1);
    order.push_back(rank - 1);
  }
  std::int64_t s = 1;
  for (int i = rank - 1; i >= 0; --i) {
    const int k = order[static_cast<std::size_t>(i)];
    b.stride[k] = s;
    s *= full[static_cast<std::size_t>(k)];
  }
  b.offset = friendly ? 0 : static_cast<std::int64_t>(g() % 5);
  b.span = b.offset + s;
  return b;
}

std::int64_t elements(const RandomBox& b) {
  std::int64_t n = 1;
  for (int k = 0; k < b.rank; ++k) n *= b.extent[k];
  return n;
}

using test_util::error_of;

}  // namespace

TEST_CASE("the host reference packs and unpacks like the executor's host kernels") {
  std::mt19937 g(11);
  for (int trial = 0; trial < 300; ++trial) {
    const int rank = 1 + trial % 5;
    const std::int64_t E = std::array<std::int64_t, 7>{1, 2, 4, 8, 3, 6, 16}[static_cast<std::size_t>(trial % 7)];
    const RandomBox b = random_box(g, rank, 6, trial % 2 == 0);
    const std::int64_t n = elements(b);
    const std::int64_t first = static_cast<std::int64_t>(g() % static_cast<unsigned>(n));
    const std::int64_t count = static_cast<std::int64_t>(g() % static_cast<unsigned>(n - first + 1));
    const auto box_bytes = static_cast<std::size_t>(b.span * E), stream_bytes = static_cast<std::size_t>(n * E);
    Memory box(box_bytes, 1u + static_cast<unsigned>(trial));
    Memory s_ref(stream_bytes, 7), s_host(stream_bytes, 7);
    // Pack.
    BoxCopy c = pack_copy(box.base, b.offset, rank, b.extent, b.stride, first, count, s_ref.base, E, E);
    copy_boxes_reference(std::span<const BoxCopy>(&c, 1), E);
    pack_range(static_cast<std::size_t>(E), rank, b.extent, BoxSide{box.base, b.offset, b.stride}, first, count, s_host.base);
    REQUIRE(std::memcmp(s_ref.base, s_host.base, stream_bytes) == 0);
    // Unpack the stream into two copies of another box memory.
    Memory d_ref(box_bytes, 99), d_host(box_bytes, 99);
    BoxCopy u = unpack_copy(d_ref.base, b.offset, rank, b.extent, b.stride, first, count, s_ref.base, E, E);
    copy_boxes_reference(std::span<const BoxCopy>(&u, 1), E);
    unpack_range(static_cast<std::size_t>(E), rank, b.extent, BoxSide{d_host.base, b.offset, b.stride}, first, count, s_ref.base);
    REQUIRE(std::memcmp(d_ref.base, d_host.base, box_bytes) == 0);
  }
}

TEST_CASE("the host reference copies strided boxes like copy_box") {
  std::mt19937 g(12);
  for (int trial = 0; trial < 200; ++trial) {
    const int rank = 1 + trial % 4;
    const std::int64_t E = std::array<std::int64_t, 4>{1, 2, 4, 8}[static_cast<std::size_t>(trial % 4)];
    RandomBox sb = random_box(g, rank, 5, trial % 3 == 0);
    RandomBox db = random_box(g, rank, 5, trial % 3 != 0);
    for (int k = 0; k < rank; ++k) db.extent[k] = sb.extent[k];  // same extents, db strides stay injective (enclosing >= extent)
    std::int64_t dspan = db.offset + 1;
    for (int k = 0; k < rank; ++k) dspan += (db.extent[k] - 1) * db.stride[k];
    Memory src(static_cast<std::size_t>(sb.span * E), 3u + static_cast<unsigned>(trial));
    Memory a(static_cast<std::size_t>((dspan + 64) * E), 5), h(static_cast<std::size_t>((dspan + 64) * E), 5);
    BoxCopy c = box_copy(src.base, sb.offset, sb.stride, a.base, db.offset, db.stride, rank, sb.extent, E, E);
    copy_boxes_reference(std::span<const BoxCopy>(&c, 1), E);
    copy_box(static_cast<std::size_t>(E), rank, sb.extent, BoxSide{src.base, sb.offset, sb.stride}, BoxSide{h.base, db.offset, db.stride});
    REQUIRE(std::memcmp(a.base, h.base, a.bytes) == 0);
  }
}

namespace {

/// One random batch, run twice from the same memory: by the reference on
/// the copies as added, and by the emulated kernel on the finished batch.
struct BatchCase {
  std::vector<BoxCopy> added;
  std::vector<std::int64_t> bytes;
};

void run_batch_case(std::mt19937& g, int copies, bool aligned, int max_rank, std::int64_t max_extent, bool pack) {
  // Destination memory: a stream (pack) or disjoint boxes (unpack); the
  // source: boxes (pack) or the stream.
  const std::size_t arena = std::size_t{1} << 22;
  Memory src(arena, static_cast<unsigned>(g())), dst_ref(arena, 77), dst_kernel(arena, 77);
  BoxBatch ref_batch, k_batch;
  std::vector<std::int64_t> sizes;
  std::size_t src_at = 0, dst_at = 0;
  for (int i = 0; i < copies; ++i) {
    const std::int64_t E = aligned ? std::array<std::int64_t, 3>{2, 4, 8}[g() % 3] : std::array<std::int64_t, 5>{1, 2, 3, 4, 8}[g() % 5];
    const int rank = 1 + static_cast<int>(g() % static_cast<unsigned>(max_rank));
    const RandomBox b = random_box(g, rank, max_extent, aligned || g() % 2 == 0, aligned);
    const std::int64_t n = elements(b);
    const std::int64_t first = aligned ? 0 : static_cast<std::int64_t>(g() % static_cast<unsigned>(n));
    const std::int64_t count = aligned ? n : static_cast<std::int64_t>(g() % static_cast<unsigned>(n - first + 1));
    const std::size_t box_bytes = static_cast<std::size_t>(b.span * E), stream_bytes = static_cast<std::size_t>(count * E);
    auto bump = [&](std::size_t& at, std::size_t bytes) {
      at = aligned ? (at + 15) / 16 * 16 : at + g() % 3;
      const std::size_t here = at;
      at += bytes;
      REQUIRE(at < arena);
      return here;
    };
    const std::size_t box_at = bump(pack ? src_at : dst_at, box_bytes);
    const std::size_t stream_at = bump(pack ? dst_at : src_at, stream_bytes);
    for (Memory* dm : {&dst_ref, &dst_kernel}) {
      BoxCopy c = pack ? pack_copy(src.base + box_at, b.offset, rank, b.extent, b.stride, first, count, dm->base + stream_at, E, E)
                       : unpack_copy(dm->base + box_at, b.offset, rank, b.extent, b.stride, first, count, src.base + stream_at, E, E);
      (dm == &dst_ref ? ref_batch : k_batch).add(c, E);
    }
    sizes.push_back(E);
  }
  // Reference: every copy with its own element size.
  for (std::size_t i = 0; i < ref_batch.size(); ++i) copy_boxes_reference(ref_batch.boxes().subspan(i, 1), sizes[i]);
  const BatchLaunch l = k_batch.finish();
  CHECK(l.copies <= copies);
  if (aligned) {
    CHECK(l.in_bytes >= 2);
    int vec = 0;
    for (const auto& c : k_batch.boxes()) vec += l.in_bytes == 2   ? batch_detail::vectorizable<Identity<2>>(c, c.rank)
                                                 : l.in_bytes == 4 ? batch_detail::vectorizable<Identity<4>>(c, c.rank)
                                                                   : batch_detail::vectorizable<Identity<8>>(c, c.rank);
    CHECK(vec == l.copies);  // friendly boxes: every copy moves in 16-byte units
  }
  emulate_box_copies(k_batch.boxes(), l);
  REQUIRE(std::memcmp(dst_ref.base, dst_kernel.base, arena) == 0);
}

}  // namespace

TEST_CASE("the kernel body matches the reference: aligned batches take the vector path") {
  std::mt19937 g(21);
  for (int trial = 0; trial < 12; ++trial) {
    const int rank = 1 + trial % 5;
    run_batch_case(g, 1 + trial % 4, true, rank, rank <= 2 ? 40 : rank == 3 ? 12 : 6, trial % 2 == 0);
  }
}

TEST_CASE("the kernel body matches the reference: misaligned, partial, mixed element sizes and ranks") {
  std::mt19937 g(22);
  for (int trial = 0; trial < 24; ++trial) run_batch_case(g, 1 + trial % 7, false, 1 + trial % 6, 9, trial % 2 == 1);
}

TEST_CASE("the kernel body: large rows, chunk and row boundaries, tails") {
  // Rows long and short against the block's chunk (256 threads x 8 units x 16 bytes), odd tails.
  const std::int64_t E = 2;
  for (std::int64_t inner : {8, 64, 1000, 4096, 16384 + 8, 40000}) {
    for (std::int64_t rows : {1, 3}) {
      for (std::int64_t tail : {0, 1, 7}) {
        const std::int64_t pitch = inner + 64;
        Memory box(static_cast<std::size_t>((rows * pitch + 16) * E), 5), s_ref(static_cast<std::size_t>(rows * inner * E + 64), 1),
            s_k(static_cast<std::size_t>(rows * inner * E + 64), 1);
        const std::int64_t ext[2] = {rows, inner}, st[2] = {pitch, 1};
        const std::int64_t n = rows * inner, first = tail == 0 ? 0 : 8, count = n - first - tail;
        if (count <= 0) continue;
        BoxCopy c = pack_copy(box.base, 0, 2, ext, st, first, count, s_ref.base, E, E);
        BoxCopy k = pack_copy(box.base, 0, 2, ext, st, first, count, s_k.base, E, E);
        copy_boxes_reference(std::span<const BoxCopy>(&c, 1), E);
        BoxBatch b;
        b.add(k, E);
        const BatchLaunch l = b.finish();
        CHECK(l.in_bytes == 2);
        CHECK(batch_detail::vectorizable<Identity<2>>(b.boxes()[0], b.boxes()[0].rank));
        emulate_box_copies(b.boxes(), l);
        REQUIRE(std::memcmp(s_ref.base, s_k.base, s_ref.bytes) == 0);
      }
    }
  }
}

TEST_CASE("finish() lowers element sizes, collapses dims and pads ranks without changing the copy") {
  // A 3-byte element box against a 4-byte-aligned one: the batch drops to 1-byte words.
  Memory m(1 << 16, 1);
  const std::int64_t ext[3] = {2, 3, 4}, st[3] = {12, 4, 1};
  BoxBatch b;
  b.add(pack_copy(m.base, 0, 3, ext, st, 0, 24, m.base + 4096, 3, 3), 3);
  b.add(pack_copy(m.base + 1024, 0, 3, ext, st, 0, 24, m.base + 8192, 4, 4), 4);
  const BatchLaunch l = b.finish();
  CHECK(l.in_bytes == 1);
  CHECK(l.rank == 1);  // dense boxes collapse to one run
  CHECK(b.boxes()[0].count == 72);
  CHECK(b.boxes()[1].count == 96);
  CHECK(b.boxes()[1].block == 1);
  // A strided inner dim gains a byte dim.
  BoxBatch s;
  const std::int64_t st2[3] = {40, 8, 2};
  s.add(pack_copy(m.base, 0, 3, ext, st2, 0, 24, m.base + 4096, 4, 4), 4);
  s.add(pack_copy(m.base, 0, 1, ext + 2, st + 2, 0, 4, m.base + 8192 + 2, 2, 2), 2);
  const BatchLaunch l2 = s.finish();
  CHECK(l2.in_bytes == 2);
  CHECK(l2.rank == 3);  // [2,3,4] collapses to [2,12] (stride 2), plus a 2-word element dim; the rank-1 copy is padded to 3
  CHECK(s.boxes()[0].extent[2] == 2);
  CHECK(s.boxes()[1].rank == 3);
  CHECK(s.boxes()[1].extent[0] == 1);
}

TEST_CASE("the vector condition: aligned rows vectorize, misaligned ones do not") {
  BoxCopy c;
  c.rank = 2;
  c.extent[0] = 4;
  c.extent[1] = 64;
  c.src_stride[0] = 128;
  c.src_stride[1] = 1;
  c.dst_stride[0] = 64;
  c.dst_stride[1] = 1;
  c.src = 0x1000;
  c.dst = 0x2000;
  c.count = 256;
  CHECK(batch_detail::vectorizable<Identity<2>>(c, 2));
  c.src = 0x1002;
  CHECK_FALSE(batch_detail::vectorizable<Identity<2>>(c, 2));
  c.src = 0x1000;
  c.src_stride[0] = 129;  // a row start off the 16-byte grid
  CHECK_FALSE(batch_detail::vectorizable<Identity<2>>(c, 2));
  c.src_stride[0] = 128;
  c.first = 4;
  CHECK_FALSE(batch_detail::vectorizable<Identity<2>>(c, 2));
  c.first = 8;
  CHECK(batch_detail::vectorizable<Identity<2>>(c, 2));
  c.src_stride[1] = 2;
  CHECK_FALSE(batch_detail::vectorizable<Identity<2>>(c, 2));
}

namespace {
std::uint16_t bf16_of(float f) {
  std::uint32_t x;
  std::memcpy(&x, &f, 4);
  return F32ToBF16::apply(x);
}
}  // namespace

TEST_CASE("f32 -> bf16 rounds to nearest even; bf16 -> f32 is exact") {
  CHECK(bf16_of(1.0f) == 0x3F80);
  CHECK(bf16_of(-2.0f) == 0xC000);
  CHECK(F32ToBF16::apply(0x3F808000u) == 0x3F80);  // tie, even stays
  CHECK(F32ToBF16::apply(0x3F818000u) == 0x3F82);  // tie, odd rounds up
  CHECK(F32ToBF16::apply(0x3F808001u) == 0x3F81);  // above the tie
  CHECK(F32ToBF16::apply(0x7F7FFFFFu) == 0x7F80);  // largest finite rounds to inf
  CHECK(F32ToBF16::apply(0x7F800000u) == 0x7F80);  // inf stays inf
  const std::uint16_t nan = F32ToBF16::apply(0x7F800001u);
  CHECK((nan & 0x7F80) == 0x7F80);
  CHECK((nan & 0x007F) != 0);  // still a NaN, not inf
  CHECK(BF16ToF32::apply(0x3F80) == 0x3F800000u);
  // Against float arithmetic: the rounded value is within half a bf16 ulp.
  std::mt19937 g(5);
  for (int i = 0; i < 10000; ++i) {
    const float f = std::ldexp(static_cast<float>(g() % 1000000) / 1000000.0f + 1.0f, static_cast<int>(g() % 40) - 20);
    std::uint32_t back = BF16ToF32::apply(bf16_of(f));
    float r;
    std::memcpy(&r, &back, 4);
    REQUIRE(std::fabs(r - f) <= std::ldexp(1.0f, std::ilogb(f) - 8));
  }
}

TEST_CASE("the kernel body casts in flight like the reference (f32 -> bf16 pack, bf16 -> f32 unpack)") {
  std::mt19937 g(31);
  for (int trial = 0; trial < 10; ++trial) {
    const bool aligned = trial % 2 == 0;
    const int rank = 1 + trial % 4;
    const RandomBox b = random_box(g, rank, aligned ? 48 : 9, true, aligned);
    const std::int64_t n = elements(b);
    Memory box(static_cast<std::size_t>(b.span * 4 + 64), 3u + static_cast<unsigned>(trial));
    Memory s_ref(static_cast<std::size_t>(n * 2 + 64), 9), s_k(static_cast<std::size_t>(n * 2 + 64), 9);
    const std::int64_t first = aligned ? 0 : 1, count = n - first;
    std::byte* sb = box.base + (aligned ? 0 : 4);
    BoxCopy c = pack_copy(sb, b.offset, rank, b.extent, b.stride, first, count, s_ref.base + (aligned ? 0 : 2), 4, 2);
    copy_boxes_reference<F32ToBF16>(std::span<const BoxCopy>(&c, 1));
    BoxBatch k;
    k.add(pack_copy(sb, b.offset, rank, b.extent, b.stride, first, count, s_k.base + (aligned ? 0 : 2), 4, 2), 4);
    const BatchLaunch l = k.finish_cast<F32ToBF16>();
    CHECK(l.in_bytes == 4);
    CHECK(l.out_bytes == 2);
    emulate_box_copies<F32ToBF16>(k.boxes(), l);
    REQUIRE(std::memcmp(s_ref.base, s_k.base, s_ref.bytes) == 0);
    // Back: bf16 stream -> f32 box.
    Memory d_ref(box.bytes, 4), d_k(box.bytes, 4);
    BoxCopy u = unpack_copy(d_ref.base, b.offset, rank, b.extent, b.stride, first, count, s_ref.base + (aligned ? 0 : 2), 2, 4);
    copy_boxes_reference<BF16ToF32>(std::span<const BoxCopy>(&u, 1));
    BoxBatch ku;
    ku.add(unpack_copy(d_k.base, b.offset, rank, b.extent, b.stride, first, count, s_ref.base + (aligned ? 0 : 2), 2, 4), 2);
    emulate_box_copies<BF16ToF32>(ku.boxes(), ku.finish_cast<BF16ToF32>());
    REQUIRE(std::memcmp(d_ref.base, d_k.base, d_ref.bytes) == 0);
  }
}

TEST_CASE("bad batches are clear errors") {
  Memory m(4096, 1);
  const std::int64_t ext[2] = {4, 4}, st[2] = {4, 1};
  BoxBatch b;
  CHECK(error_of([&] { b.add(pack_copy(m.base, 0, 2, ext, st, 10, 7, m.base + 1024, 4, 4), 4); }).find("outside a box of 16") !=
        std::string::npos);
  CHECK(error_of([&] { pack_copy(m.base, 0, 11, ext, st, 0, 1, m.base, 4, 4); }).find("box rank 11") != std::string::npos);
  CHECK(error_of([&] { b.add(pack_copy(m.base, 0, 2, ext, st, 0, 16, m.base + 1024, 4, 4), 0); }).find("element size 0") !=
        std::string::npos);
  BoxBatch c;
  c.add(pack_copy(m.base + 2, 0, 2, ext, st, 0, 16, m.base + 1024, 4, 2), 4);
  CHECK(error_of([&] { c.finish_cast<F32ToBF16>(); }).find("aligned to 4 bytes") != std::string::npos);
  BoxBatch d;
  d.add(pack_copy(m.base, 0, 2, ext, st, 0, 16, m.base + 1024, 2, 2), 2);
  CHECK(error_of([&] { d.finish_cast<F32ToBF16>(); }).find("from 4-byte elements got a copy of 2-byte") != std::string::npos);
  d.finish();
  CHECK(error_of([&] { d.add(pack_copy(m.base, 0, 2, ext, st, 0, 16, m.base + 1024, 2, 2), 2); }).find("after finish") !=
        std::string::npos);
}

// --- the executor's device path, on the CPU ---------------------------------
// A DeviceCopyEngine whose "kernel" is the CUDA kernel's body run on the host
// (emulate_box_copies), over a transport that takes MemoryKind::device
// regions as host memory: full refits then run the executor's device code
// (device staging, batches uploaded at setup, one pack per wave, batched
// local copies, stream order)
// exactly as on a GPU, and every destination element is checked.

#include <atomic>
#include <map>
#include <mutex>

#include "host_stream.hpp"
#include "refit_util.hpp"

namespace {

using EmulatedEngine = reshard::test::HostStreamEngine;
using reshard::test::HostAsDevice;

using refit_test::cut;
using refit_test::one_axis;
using refit_test::tensor;
std::vector<TensorSpec> model(std::int64_t tp, bool second) {
  return {tensor("w", {64, 96}, {second ? DimSpec{} : cut(tp), second ? cut(tp) : DimSpec{}}, DType::f32),
          tensor("b", {1000}, {cut(tp)}, DType::bf16),
          tensor("e", {12, 10, 8}, {{}, {}, cut(tp)}, DType::bf16),
          tensor("big", {512, 256}, {cut(tp), {}}, DType::f32),
          tensor("emb", {300, 24}, {{}, cut(tp)}, DType::u8)};
}

struct EmuOutcome : refit_test::DeviceOutcome {
  std::int64_t device_regions = 0;
};

EmuOutcome run_emulated(const Layout& src, const Layout& dst, int refits, ResharderOptions opt = {}) {
  using namespace refit_test;
  EmuOutcome out;
  std::mutex m;
  LocalWorld world(world_of(src, dst));
  world.run([&](LocalTransport& lt) {
    HostAsDevice t(lt);
    RankMemory mem(src, dst, t.rank(), true);
    SideMemory &sm = mem.src, &dm = mem.dst;
    auto engine = std::make_shared<EmulatedEngine>();
    ResharderOptions o = opt;
    o.executor.device = engine;
    Resharder<Layout, HostAsDevice> r(src, dst, mem.bufs, t, o);
    for (int k = 0; k < refits; ++k) {
      if (k > 0) {
        write_side(src, sm, true, static_cast<std::uint64_t>(k));
        write_side(dst, dm, false, static_cast<std::uint64_t>(k));
      }
      out.add(m, k, r.refit(), dst, dm, t.rank());
    }
    std::lock_guard lk(m);
    out.launches += engine->launches;
    out.device_regions += t.device_regions;
  });
  return out;
}

}  // namespace

TEST_CASE("executor with device buffers (emulated kernels): tp=2 -> tp=4, disaggregated") {
  const Layout src = one_axis("tp", 2, 0, model(2, false)), dst = one_axis("tp", 4, 2, model(4, true));
  const auto o = run_emulated(src, dst, 2);
  INFO(o.first_wrong);
  CHECK(o.wrong == 0);
  CHECK(o.packed > 0);
  CHECK(o.zero_copy > 0);
  CHECK(o.launches > 0);
  CHECK(o.device_regions > 0);  // staging and buffers registered as device memory
}

TEST_CASE("executor with device buffers (emulated kernels): colocated, local copies, many small waves") {
  const Layout src = one_axis("tp", 2, 0, model(2, false)), dst = one_axis("tp", 2, 0, model(2, true));
  ResharderOptions opt;
  opt.executor.staging_budget = 4096;
  opt.executor.pipeline = 2;
  const auto o = run_emulated(src, dst, 2, opt);
  INFO(o.first_wrong);
  CHECK(o.wrong == 0);
  CHECK(o.local > 0);
  CHECK(o.packed > 0);
}

TEST_CASE("device buffers without a device engine, or mixed with host buffers, are clear errors") {
  using namespace refit_test;
  const Layout src = one_axis("tp", 1, 0, model(1, false)), dst = one_axis("tp", 1, 0, model(1, true));
  LocalWorld world({0});
  std::string e1, e2;
  world.run([&](LocalTransport& lt) {
    HostAsDevice t(lt);
    SideMemory sm = make_side(src, 0, true, 0), dm = make_side(dst, 0, false, 0);
    LocalBuffers bufs;
    bufs.src = views(src, sm);
    bufs.dst = views(dst, dm);
    bufs.src.begin()->second.memory = MemoryKind::device;
    e1 = error_of([&] { Resharder<Layout, HostAsDevice> r(src, dst, bufs, t); });
    ResharderOptions o;
    o.executor.device = std::make_shared<EmulatedEngine>();
    e2 = error_of([&] { Resharder<Layout, HostAsDevice> r(src, dst, bufs, t, o); });
  });
  CHECK(e1.find("is device memory: set ResharderOptions::executor.device") != std::string::npos);
  CHECK(e2.find("is host memory and buffer") != std::string::npos);
  CHECK(e2.find("device memory: a rank's buffers must all be one or the other") != std::string::npos);
}
