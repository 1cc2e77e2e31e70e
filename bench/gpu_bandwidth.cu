// Pack / unpack bandwidth of the CUDA box copy kernels against
// cudaMemcpy device-to-device on the same GPU (bytes read + written per
// second, best of N launches timed with CUDA events; descriptors uploaded
// once, outside the timing). Each case also checks its result once against
// cudaMemcpy2D / the host reference on a sample, so a fast wrong kernel fails.
//
//   gpu-bandwidth [--reps N] [--gib G]    (prints one line per case; exit 1 if a check fails)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "reshard/cuda/copy_kernels.cuh"

using namespace reshard;
using namespace reshard::cuda;

namespace {

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    check_cuda(cudaEventCreate(&a), "cudaEventCreate");
    check_cuda(cudaEventCreate(&b), "cudaEventCreate");
  }
  ~Timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  template <class F>
  double best_seconds(int reps, F&& f) {
    f();  // warm-up
    check_cuda(cudaDeviceSynchronize(), "warm-up");
    double best = 1e30;
    for (int i = 0; i < reps; ++i) {
      check_cuda(cudaEventRecord(a), "cudaEventRecord");
      f();
      check_cuda(cudaEventRecord(b), "cudaEventRecord");
      check_cuda(cudaEventSynchronize(b), "cudaEventSynchronize");
      float ms = 0;
      check_cuda(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
      best = std::min(best, static_cast<double>(ms) / 1e3);
    }
    return best;
  }
};

struct Case {
  std::string name;
  BoxBatch batch;
  bool cast = false;            ///< f32 -> bf16
  std::int64_t moved = 0;       ///< bytes read + written per launch
};

}  // namespace

int main(int argc, char** argv) {
  int reps = 10;
  double gib = 1.0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--gib")) gib = std::atof(argv[i + 1]);
  }
  if (visible_devices() == 0) {
    std::printf("gpu-bandwidth: no GPU visible\n");
    return 2;
  }
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("device: %s, %d SMs, %.1f GiB\n", prop.name, prop.multiProcessorCount, static_cast<double>(prop.totalGlobalMem) / (1 << 30));
  const std::size_t N = static_cast<std::size_t>(gib * (1 << 30)) / 256 * 256;
  std::byte *src = nullptr, *dst = nullptr;
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&src), N + 4096), "cudaMalloc");
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&dst), N + 4096), "cudaMalloc");
  check_cuda(cudaMemset(src, 0x5a, N + 4096), "cudaMemset");
  {
    // A pattern: 32-bit words = their index.
    std::vector<std::uint32_t> h(1 << 20);
    for (std::size_t off = 0; off < N; off += h.size() * 4) {
      for (std::size_t i = 0; i < h.size(); ++i) h[i] = static_cast<std::uint32_t>(off / 4 + i);
      check_cuda(cudaMemcpy(src + off, h.data(), std::min(N - off, h.size() * 4), cudaMemcpyHostToDevice), "cudaMemcpy");
    }
  }
  check_cuda(cudaMemset(dst, 0, N + 4096), "cudaMemset");
  Timer timer;

  const double t_memcpy = timer.best_seconds(reps, [&] { check_cuda(cudaMemcpyAsync(dst, src, N, cudaMemcpyDeviceToDevice), "memcpy"); });
  const double bw_memcpy = 2.0 * static_cast<double>(N) / t_memcpy / 1e9;
  std::printf("cudaMemcpy D2D %.2f GiB: %.1f GB/s (read + write)\n", static_cast<double>(N) / (1 << 30), bw_memcpy);

  std::vector<Case> cases;
  const std::int64_t E = 2;  // bf16
  const std::int64_t n = static_cast<std::int64_t>(N) / E;
  // A case of one bf16 box (extents `ext`, strides `st`, from element
  // `offset`): packed from src into a dense stream in dst, or unpacked from a
  // dense stream in src into the box in dst. Each element is read and written once.
  auto one_box = [&](std::string name, bool unpack, std::int64_t offset, std::vector<std::int64_t> ext,
                     std::vector<std::int64_t> st) {
    const int rank = static_cast<int>(ext.size());
    std::int64_t elements = 1;
    for (auto e : ext) elements *= e;
    Case c{std::move(name), {}, false, 0};
    c.batch.add(unpack ? unpack_copy(dst, offset, rank, ext.data(), st.data(), 0, elements, src, E, E)
                       : pack_copy(src, offset, rank, ext.data(), st.data(), 0, elements, dst, E, E),
                E);
    c.moved = 2 * elements * E;
    cases.push_back(std::move(c));
  };
  // 1. one dense box
  one_box("contiguous bf16 box (rank 1)", false, 0, {n}, {1});
  // 2. half the columns of a [rows, 32768] bf16 matrix (tp=2 column shard): 32 KiB rows at 64 KiB pitch;
  // 3. unpacked into the same column half
  one_box("column half of [R, 32768] bf16 (32 KiB rows)", false, 0, {n / 32768, 16384}, {32768, 1});
  one_box("unpack into column half of [R, 32768] bf16", true, 0, {n / 32768, 16384}, {32768, 1});
  // 4. tp=8 shard of a [R, 4096] bf16 matrix: 1 KiB rows
  one_box("1/8 of the columns of [R, 4096] bf16 (1 KiB rows)", false, 512, {n / 4096, 512}, {4096, 1});
  // 5. rank 3: [A, B/2, C/2] of [A, B, C]
  one_box("rank-3 box [A, 512, 1024] of [A, 1024, 2048] bf16", false, 0, {n / (1024 * 2048), 512, 1024}, {1024 * 2048, 2048, 1});
  {  // 6. 4096 boxes of 32 x 1 KiB rows each (at 2 KiB pitch) in one launch
    Case c{"4096 boxes of 32 x 1 KiB rows in one launch", {}, false, 0};
    const std::int64_t ext[2] = {32, 512}, st[2] = {1024, 1};
    std::int64_t at = 0;
    for (int i = 0; i < 4096; ++i) {
      c.batch.add(pack_copy(src, std::int64_t{i} * 32 * 1024, 2, ext, st, 0, 32 * 512, dst + at, E, E), E);
      at += 32 * 512 * E;
    }
    c.moved = 2 * at;
    cases.push_back(std::move(c));
  }
  // 7. misaligned: an odd element offset forces the scalar path
  one_box("contiguous bf16, odd element offset (scalar path)", false, 1, {n - 8}, {1});
  {  // 8. f32 -> bf16 in flight
    Case c{"f32 -> bf16 cast, contiguous", {}, true, 0};
    const std::int64_t m = static_cast<std::int64_t>(N) / 4;
    const std::int64_t ext[1] = {m}, st[1] = {1};
    c.batch.add(pack_copy(src, 0, 1, ext, st, 0, m, dst, 4, 2), 4);
    c.moved = m * 4 + m * 2;
    cases.push_back(std::move(c));
  }

  int failures = 0;
  BoxCopy* dev = nullptr;
  for (auto& c : cases) {
    const BatchLaunch l = c.cast ? c.batch.finish_cast<F32ToBF16>() : c.batch.finish();
    const auto boxes = c.batch.boxes();
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&dev), boxes.size() * sizeof(BoxCopy)), "cudaMalloc");
    check_cuda(cudaMemcpy(dev, boxes.data(), boxes.size() * sizeof(BoxCopy), cudaMemcpyHostToDevice), "cudaMemcpy");
    check_cuda(cudaMemset(dst, 0, N + 4096), "cudaMemset");
    auto launch = [&] {
      if (c.cast) launch_box_copies<F32ToBF16>(dev, l, nullptr);
      else launch_box_copies(dev, l, nullptr);
    };
    const double t = timer.best_seconds(reps, launch);
    // Check a sample of the result against the host reference of the first and last copy.
    bool ok = true;
    for (std::size_t which : {std::size_t{0}, boxes.size() - 1}) {
      BoxCopy b = boxes[which];
      const std::int64_t ib = l.in_bytes, ob = l.out_bytes;
      // 256 elements spread over the copy, fetched one by one.
      std::vector<std::byte> s(static_cast<std::size_t>(ib)), d(static_cast<std::size_t>(ob)), want(static_cast<std::size_t>(ob));
      std::int64_t idx[kBoxCopyMaxRank];
      for (int j = 0; j < 256 && ok; ++j) {
        const std::int64_t e = b.first + (b.count - 1) * j / 255;
        std::int64_t rem = e, so = 0, dof = 0;
        for (int k = b.rank - 1; k >= 0; --k) {
          idx[k] = rem % b.extent[k];
          rem /= b.extent[k];
        }
        for (int k = 0; k < b.rank; ++k) {
          so += idx[k] * b.src_stride[k];
          dof += idx[k] * b.dst_stride[k];
        }
        check_cuda(cudaMemcpy(s.data(), reinterpret_cast<void*>(b.src + static_cast<std::uint64_t>(so * ib)), static_cast<std::size_t>(ib), cudaMemcpyDeviceToHost), "fetch");
        check_cuda(cudaMemcpy(d.data(), reinterpret_cast<void*>(b.dst + static_cast<std::uint64_t>(dof * ob)), static_cast<std::size_t>(ob), cudaMemcpyDeviceToHost), "fetch");
        if (c.cast) {
          std::uint32_t x;
          std::memcpy(&x, s.data(), 4);
          const std::uint16_t y = F32ToBF16::apply(x);
          std::memcpy(want.data(), &y, 2);
        } else {
          want = s;
        }
        ok = want == d;
      }
    }
    const double bw = static_cast<double>(c.moved) / t / 1e9;
    std::printf("%-52s %8.1f MiB  %7.1f GB/s  ratio %.3f vs cudaMemcpy  (rank %d, %d-byte words, %lld blocks)%s\n", c.name.c_str(),
                static_cast<double>(c.moved) / 2 / (1 << 20), bw, bw / bw_memcpy, l.rank, l.in_bytes, static_cast<long long>(l.blocks),
                ok ? "" : "  WRONG RESULT");
    failures += ok ? 0 : 1;
    cudaFree(dev);
  }
  cudaFree(src);
  cudaFree(dst);
  std::printf("target: pack of large boxes >= 0.90 of cudaMemcpy; %s\n", failures ? "SOME RESULTS WRONG" : "all sampled results match");
  return failures ? 1 : 0;
}
