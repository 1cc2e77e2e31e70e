#pragma once
// The executor's hook for buffers in GPU memory: when a rank's buffers are
// MemoryKind::device, the executor stages in memory this engine allocates
// and packs, unpacks and copies locally through it. Plain C++: the executor
// never needs nvcc; the CUDA implementation is reshard::cuda::CudaCopyEngine
// (device_engine.cuh), constructed in a TU that nvcc compiles.
//
//   ExecutorOptions opt;
//   opt.device = std::make_shared<reshard::cuda::CudaCopyEngine>();
//
// Stream order. The engine owns one copy stream. The executor builds every
// copy batch once, at setup, and uploads its descriptors (upload()); a refit
// only enqueues them (one pack batch per wave across all peers, one unpack
// batch per received message group, one batch of local copies; FP8 refits
// add a batch of tiles the senders quantize and one the receivers do,
// quant_refit.hpp) and orders
// the streams with events, so nothing inside a refit waits on the host for
// a copy, except where a transport driven by the host (UCX, the in-process
// one) must read packed bytes: there the host waits once per wave, after
// that wave's pack. A transport with a device stream of its own (NCCL,
// DeviceStreamTransport in transport.hpp) is ordered on the device instead.
#include <cstddef>

#include <span>

#include "box_batch.hpp"
#include "quant_tile.hpp"

namespace reshard {

/// A point in a device stream's work, opaque to plain C++ (a cudaEvent_t
/// with CUDA). nullptr: no event (nothing to wait for).
using DeviceEvent = void*;
/// A device stream, opaque to plain C++ (a cudaStream_t with CUDA).
using DeviceStream = void*;

/// The caller's side of stream order, for device buffers: what a refit waits
/// for before it touches memory, and whether it returns before its copies
/// end (Executor::run, Resharder::refit).
struct StreamOrder {
  /// The sources are final once this event is reached (the trainer records
  /// it after the optimizer step). nullptr: they are final now.
  DeviceEvent sources_final = nullptr;
  /// Nothing reads the destination this refit writes once this event is
  /// reached. Double-buffered: record it on the inference stream after the
  /// last work that reads the set served before the last swap (the set this
  /// refit overwrites). nullptr: nothing reads it now.
  DeviceEvent destination_free = nullptr;
  /// true: return after every copy of the refit is done. false: return once
  /// the transport has moved everything and the copies are enqueued; the
  /// event ExecutorStats::done (RefitReport::done) marks their end, and the
  /// inference stream waits for it (stream_wait) before it reads.
  bool wait = true;
};

class DeviceCopyEngine {
 public:
  virtual ~DeviceCopyEngine() = default;
  /// Staging memory the transport can move (registered as MemoryKind::device).
  virtual std::byte* allocate_staging(std::size_t bytes) = 0;
  virtual void free_staging(std::byte* p) noexcept = 0;

  /// At setup: finishes `batch` and keeps its descriptors in device memory
  /// for every later enqueue(); returns its id. Empty batches are allowed.
  virtual std::size_t upload(cuda::BoxBatch& batch) = 0;
  /// At setup: keeps the descriptors of tiles to quantize (quant_tile.hpp;
  /// device addresses) with `scheme` in device memory; returns a batch id
  /// of the same kind as upload()'s: enqueue() runs it (one launch).
  virtual std::size_t upload(QuantScheme scheme, std::span<const cuda::QuantTile> tiles) = 0;
  /// Frees an uploaded batch (after the work that used it has finished).
  virtual void release(std::size_t id) noexcept = 0;
  /// Enqueues every copy of an uploaded batch on the copy stream (one
  /// launch) and returns at once.
  virtual void enqueue(std::size_t id) = 0;

  /// Records the work enqueued so far on `stream` (nullptr: the copy stream)
  /// in the engine's event number `slot` and returns that event. Recording
  /// a slot again replaces the point it marks; waits already enqueued keep
  /// the earlier one (CUDA's cudaStreamWaitEvent semantics).
  virtual DeviceEvent record(int slot, DeviceStream stream = nullptr) = 0;
  /// Later work on `stream` (nullptr: the copy stream) runs after `e`; the
  /// host does not wait. A null event is nothing to wait for.
  virtual void stream_wait(DeviceEvent e, DeviceStream stream = nullptr) = 0;
  /// The host waits until `e` is reached (null: returns at once).
  virtual void host_wait(DeviceEvent e) = 0;
  /// The host waits until everything enqueued on the copy stream is done.
  virtual void synchronize() = 0;
};

}  // namespace reshard
