// Refits with the weights in GPU memory: ranks as threads sharing one GPU
// (cuda::LocalDeviceTransport, whose world moves bytes with cudaMemcpy), the
// executor staging in device memory and packing / unpacking / copying
// locally with the CUDA kernels (cuda::CudaCopyEngine). Buffers are plain
// cudaMalloc memory (host code touching them would fault, not pass), filled
// and read back with explicit copies; every destination element is checked
// after every refit (tests/refit_util.hpp's tags). Suite "gpu": skipped
// without a GPU (tests/cuda_test_main.cpp).
//
// Host code, compiled by g++: only the engine comes from nvcc
// (test_cuda_refit.cu), the way an application keeps its refit code out of
// nvcc (whose front end crashes on some of this TU's host code).
#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <mutex>
#include <string>
#include <vector>

#include "refit_util.hpp"
#include "reshard/cuda/device_engine.hpp"
#include "reshard/cuda/local_device.hpp"
#include "reshard/cuda/runtime.hpp"

using namespace reshard;
using namespace refit_test;

/// test_cuda_refit.cu (nvcc): a CudaCopyEngine with cudaMalloc staging.
std::shared_ptr<DeviceCopyEngine> make_copy_engine();
std::int64_t copy_engine_launches(const DeviceCopyEngine& e);

namespace {

using refit_test::cut;
using refit_test::one_axis;
using refit_test::tensor;

using refit_test::DeviceOutcome;

/// A host function on a stream: the trainer's step, late.
void CUDART_CB late_step(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(20)); }

/// run_refits (refit_util.hpp) with every buffer copied into device memory
/// and bound as MemoryKind::device. With `streams`, the caller's contract
/// (StreamOrder): each version's sources are written on a trainer stream
/// after a 20 ms host function, the refit gets the trainer's event and
/// returns without waiting for its copies, and the destination is read
/// back on an inference stream that waits for RefitReport::done.
DeviceOutcome run_device_refits(const Layout& src, const Layout& dst, int refits, ResharderOptions opt = {}, bool streams = false) {
  DeviceOutcome out;
  const auto ranks = world_of(src, dst);
  std::mutex m;
  LocalWorld world(ranks, cuda::device_world_options());
  world.run([&](LocalTransport& lt) {
    cuda::LocalDeviceTransport t(lt);
    SideMemory sm = make_side(src, t.rank(), true, 0), dm = make_side(dst, t.rank(), false, 0);
    std::vector<std::byte*> owned;
    auto bind = [&](const Layout& L, SideMemory& mem, std::vector<std::byte*>& ptrs) {
      std::map<std::string, BufferView> v;
      ptrs.assign(mem.data.size(), nullptr);
      for (std::size_t b = 0; b < mem.data.size(); ++b) {
        if (!mem.present[b]) continue;
        cuda::check_cuda(cudaMalloc(reinterpret_cast<void**>(&ptrs[b]), std::max<std::size_t>(mem.data[b].size(), 1)), "cudaMalloc");
        owned.push_back(ptrs[b]);
        BufferView bv = bytes_view(ptrs[b], mem.data[b].size(), static_cast<std::int64_t>(mem.element_bytes[b]));
        bv.memory = MemoryKind::device;
        v[L.local_buffers()[b].name] = bv;
      }
      return v;
    };
    auto upload = [](SideMemory& mem, std::vector<std::byte*>& ptrs) {
      for (std::size_t b = 0; b < ptrs.size(); ++b)
        if (ptrs[b]) cuda::check_cuda(cudaMemcpy(ptrs[b], mem.data[b].data(), mem.data[b].size(), cudaMemcpyHostToDevice), "cudaMemcpy up");
    };
    std::vector<std::byte*> sp, dp;
    LocalBuffers bufs;
    bufs.src = bind(src, sm, sp);
    bufs.dst = bind(dst, dm, dp);
    upload(sm, sp);
    upload(dm, dp);
    auto engine = make_copy_engine();
    ResharderOptions o = opt;
    o.executor.device = engine;
    cudaStream_t trainer = nullptr, inference = nullptr;
    cudaEvent_t step_done = nullptr;
    std::vector<std::byte*> pinned;
    if (streams) {
      cuda::check_cuda(cudaStreamCreateWithFlags(&trainer, cudaStreamNonBlocking), "cudaStreamCreate");
      cuda::check_cuda(cudaStreamCreateWithFlags(&inference, cudaStreamNonBlocking), "cudaStreamCreate");
      cuda::check_cuda(cudaEventCreateWithFlags(&step_done, cudaEventDisableTiming), "cudaEventCreate");
    }
    {
      Resharder<Layout, cuda::LocalDeviceTransport> r(src, dst, bufs, t, o);
      for (int k = 0; k < refits; ++k) {
        StreamOrder order;
        if (k > 0) {
          write_side(src, sm, true, static_cast<std::uint64_t>(k));
          write_side(dst, dm, false, static_cast<std::uint64_t>(k));
          upload(dm, dp);
          if (!streams) {
            upload(sm, sp);
          } else {
            // From pinned memory: a pageable copy would make the host wait for the stream.
            cuda::check_cuda(cudaStreamSynchronize(trainer), "cudaStreamSynchronize");  // the last version's pinned copies are done
            for (auto* p : pinned) cudaFreeHost(p);
            pinned.assign(sp.size(), nullptr);
            cuda::check_cuda(cudaLaunchHostFunc(trainer, late_step, nullptr), "cudaLaunchHostFunc");
            for (std::size_t b = 0; b < sp.size(); ++b)
              if (sp[b]) {
                cuda::check_cuda(cudaMallocHost(reinterpret_cast<void**>(&pinned[b]), sm.data[b].size()), "cudaMallocHost");
                std::memcpy(pinned[b], sm.data[b].data(), sm.data[b].size());
                cuda::check_cuda(cudaMemcpyAsync(sp[b], pinned[b], sm.data[b].size(), cudaMemcpyHostToDevice, trainer),
                                 "cudaMemcpyAsync of the sources on the trainer stream");
              }
            cuda::check_cuda(cudaEventRecord(step_done, trainer), "cudaEventRecord");
            order.sources_final = step_done;
            order.wait = false;
          }
        }
        const RefitReport rep = r.refit(order);
        if (streams) {
          REQUIRE(rep.done != nullptr);
          cuda::check_cuda(cudaStreamWaitEvent(inference, static_cast<cudaEvent_t>(rep.done), 0), "cudaStreamWaitEvent");
        }
        for (std::size_t b = 0; b < dp.size(); ++b)
          if (dp[b])
            cuda::check_cuda(cudaMemcpyAsync(dm.data[b].data(), dp[b], dm.data[b].size(), cudaMemcpyDeviceToHost, inference), "cudaMemcpyAsync down");
        cuda::check_cuda(cudaStreamSynchronize(inference), "cudaStreamSynchronize");
        out.add(m, k, rep, dst, dm, t.rank());
      }
    }
    if (streams) {
      cudaStreamSynchronize(trainer);
      for (auto* p : pinned) cudaFreeHost(p);
      cudaEventDestroy(step_done);
      cudaStreamDestroy(trainer);
      cudaStreamDestroy(inference);
    }
    {
      std::lock_guard lk(m);
      out.launches += copy_engine_launches(*engine);
    }
    for (auto* p : owned) cudaFree(p);
  });
  return out;
}

std::vector<TensorSpec> model(bool split_second) {
  return {tensor("w", {64, 96}, {cut(2), {}}, DType::f32),
          tensor("b", {1000}, {cut(2)}, DType::bf16),
          tensor("e", {12, 10, 8}, {{}, {}, split_second ? cut(2) : DimSpec{}}, DType::bf16),
          tensor("big", {512, 256}, {cut(2), {}}, DType::f32),
          tensor("emb", {300, 24}, {{}, cut(2)}, DType::u8)};
}

}  // namespace

TEST_CASE("device refit tp=2 -> tp=4 (disaggregated): packed, zero-copy and half-staged pieces on the GPU" * doctest::test_suite("gpu")) {
  auto dst_t = model(true);
  for (auto& t : dst_t)
    for (auto& d : t.dims)
      if (!d.axes.empty()) d.axes[0].size = 4;
  // Destination cuts the other dim of w and big: every piece strided on one side.
  dst_t[0].dims = {{}, cut(4)};
  dst_t[3].dims = {cut(4), {}};
  const Layout src = one_axis("tp", 2, 0, model(true)), dst = one_axis("tp", 4, 2, dst_t);
  const auto o = run_device_refits(src, dst, 3);
  INFO(o.first_wrong);
  CHECK(o.wrong == 0);
  CHECK(o.packed > 0);
  CHECK(o.zero_copy > 0);  // big: contiguous row blocks of 128 KiB
  CHECK(o.launches > 0);
}

// (One line: tests/cuda.cmake finds the "gpu" cases by their TEST_CASE line.)
TEST_CASE("device refit, stream order: trainer's event, no wait, the inference stream waits for done" * doctest::test_suite("gpu")) {
  auto dst_t = model(true);
  for (auto& t : dst_t)
    for (auto& d : t.dims)
      if (!d.axes.empty()) d.axes[0].size = 4;
  const Layout src = one_axis("tp", 2, 0, model(true)), dst = one_axis("tp", 4, 0, dst_t);  // colocated: local copies too
  ResharderOptions opt;
  opt.executor.staging_budget = 8192;
  const auto o = run_device_refits(src, dst, 4, opt, true);
  INFO(o.first_wrong);
  CHECK(o.wrong == 0);
  CHECK(o.packed > 0);
  CHECK(o.local > 0);
}

TEST_CASE("device refit, colocated: local copies run as one kernel batch" * doctest::test_suite("gpu")) {
  auto dst_t = model(false);
  dst_t[0].dims = {{}, cut(2)};
  const Layout src = one_axis("tp", 2, 0, model(true)), dst = one_axis("tp", 2, 0, dst_t);
  ResharderOptions opt;
  opt.executor.staging_budget = 4096;  // many waves through small device staging
  const auto o = run_device_refits(src, dst, 2, opt);
  INFO(o.first_wrong);
  CHECK(o.wrong == 0);
  CHECK(o.local > 0);
}
