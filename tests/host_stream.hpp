#pragma once
// Device streams emulated on the CPU, to test stream order without a GPU.
//
//  * HostStream: a worker thread that runs enqueued work in order, like a
//    CUDA stream; HostEvent: a point in one (cudaEvent_t semantics: a wait
//    enqueued before the event is recorded again keeps the earlier point).
//  * HostStreamEngine: a DeviceCopyEngine whose copy stream is a HostStream
//    and whose "kernel" is the CUDA kernel's own body run on the host
//    (emulate_box_copies; quantize batches through the host quantizer,
//    emulate_quant_tiles), each launch after a random delay, so work the
//    executor failed to order (a transport reading a pack that has not run,
//    a caller reading before `done`) shows up as wrong elements.
//  * DeviceStreamLocalTransport: an NCCL-like transport over the in-process
//    world: post() queues, flush() enqueues the batch on its own HostStream
//    (device_stream()), where it runs after whatever the stream was made to
//    wait for; requests complete when the stream has run their batch.
// Buffers are host memory the executor treats as MemoryKind::device.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "reshard/cuda/box_batch.hpp"
#include "reshard/cuda/device_engine.hpp"
#include "reshard/transport/local.hpp"

namespace reshard::test {

class HostEvent {
 public:
  void reach() {
    std::lock_guard lk(m_);
    reached_ = true;
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock lk(m_);
    cv_.wait(lk, [&] { return reached_; });
  }
  bool reached() {
    std::lock_guard lk(m_);
    return reached_;
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool reached_ = false;
};

class HostStream {
 public:
  HostStream() : worker_([this] { loop(); }) {}
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;
  ~HostStream() {
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  void enqueue(std::function<void()> work) {
    {
      std::lock_guard lk(m_);
      queue_.push_back(std::move(work));
    }
    cv_.notify_all();
  }
  /// A new event, reached once everything enqueued before it has run.
  std::shared_ptr<HostEvent> record() {
    auto e = std::make_shared<HostEvent>();
    enqueue([e] { e->reach(); });
    return e;
  }
  /// Later work runs after `e`.
  void wait_for(std::shared_ptr<HostEvent> e) {
    enqueue([e] { e->wait(); });
  }
  /// The host waits until everything enqueued has run.
  void drain() { record()->wait(); }

 private:
  void loop() {
    for (;;) {
      std::function<void()> work;
      {
        std::unique_lock lk(m_);
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      work();
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread worker_;
};

/// Events as DeviceEvent handles: the engine keeps every event it recorded
/// alive (a test records few), so a handle stays valid after its slot is
/// recorded again.
class HostStreamEngine final : public DeviceCopyEngine {
 public:
  /// Each launch sleeps a random 0..max_delay first.
  explicit HostStreamEngine(std::chrono::microseconds max_delay = std::chrono::microseconds(0), std::uint64_t seed = 1)
      : max_delay_(max_delay), rng_(seed) {}
  ~HostStreamEngine() override { copy_.drain(); }

  std::byte* allocate_staging(std::size_t bytes) override {
    std::lock_guard lk(m_);
    auto p = std::make_unique<std::byte[]>(bytes);
    std::byte* raw = p.get();
    blocks_.emplace(raw, std::move(p));
    return raw;
  }
  void free_staging(std::byte* p) noexcept override {
    copy_.drain();
    std::lock_guard lk(m_);
    blocks_.erase(p);
  }
  std::size_t upload(cuda::BoxBatch& batch) override {
    std::lock_guard lk(m_);
    Uploaded u;
    u.launch = batch.finish();
    u.boxes.assign(batch.boxes().begin(), batch.boxes().end());
    batches_.push_back(std::make_shared<Uploaded>(std::move(u)));
    return batches_.size() - 1;
  }
  std::size_t upload(QuantScheme scheme, std::span<const cuda::QuantTile> tiles) override {
    cuda::check_quant_tiles(tiles);
    std::lock_guard lk(m_);
    Uploaded u;
    u.quant = true;
    u.scheme = scheme;
    u.tiles.assign(tiles.begin(), tiles.end());
    batches_.push_back(std::make_shared<Uploaded>(std::move(u)));
    return batches_.size() - 1;
  }
  void release(std::size_t id) noexcept override {
    std::lock_guard lk(m_);
    if (id < batches_.size()) batches_[id].reset();
  }
  void enqueue(std::size_t id) override {
    std::shared_ptr<Uploaded> u;
    std::chrono::microseconds delay{0};
    {
      std::lock_guard lk(m_);
      if (id >= batches_.size() || !batches_[id]) fail("host stream engine: enqueue of batch {}, which is not uploaded", id);
      u = batches_[id];
      if (max_delay_.count() > 0) delay = std::chrono::microseconds(rng_() % static_cast<std::uint64_t>(max_delay_.count() + 1));
      ++launches;
    }
    copy_.enqueue([u, delay] {
      std::this_thread::sleep_for(delay);
      if (u->quant)
        cuda::emulate_quant_tiles(u->scheme, u->tiles);
      else
        cuda::emulate_box_copies(u->boxes, u->launch);
    });
  }
  DeviceEvent record(int /*slot: every record is a new event here*/, DeviceStream stream = nullptr) override {
    auto e = stream_of(stream).record();
    std::lock_guard lk(m_);
    events_.push_back(e);
    return e.get();
  }
  void stream_wait(DeviceEvent e, DeviceStream stream = nullptr) override {
    if (e) stream_of(stream).wait_for(shared(e));
  }
  void host_wait(DeviceEvent e) override {
    ++host_waits;
    if (e) shared(e)->wait();
  }
  void synchronize() override {
    ++host_waits;
    copy_.drain();
  }

  /// An event of another stream (the trainer's, the inference side's), as a
  /// handle the executor can wait for.
  DeviceEvent adopt(std::shared_ptr<HostEvent> e) {
    std::lock_guard lk(m_);
    events_.push_back(e);
    return e.get();
  }
  HostStream& copy_stream() { return copy_; }
  std::int64_t launches = 0;
  std::atomic<std::int64_t> host_waits{0};  ///< host_wait() and synchronize() calls

 private:
  struct Uploaded {
    cuda::BatchLaunch launch{};
    std::vector<cuda::BoxCopy> boxes;
    bool quant = false;  // tiles to quantize instead of boxes
    QuantScheme scheme = QuantScheme::block;
    std::vector<cuda::QuantTile> tiles;
  };
  HostStream& stream_of(DeviceStream s) { return s ? *static_cast<HostStream*>(s) : copy_; }
  std::shared_ptr<HostEvent> shared(DeviceEvent e) {
    std::lock_guard lk(m_);
    for (auto& x : events_)
      if (x.get() == e) return x;
    fail("host stream engine: an event it did not record or adopt");
  }
  std::chrono::microseconds max_delay_;
  std::mt19937_64 rng_;
  std::mutex m_;
  std::map<std::byte*, std::unique_ptr<std::byte[]>> blocks_;
  std::vector<std::shared_ptr<Uploaded>> batches_;
  std::vector<std::shared_ptr<HostEvent>> events_;
  HostStream copy_;  // last: its worker stops first
};

/// The in-process transport taking "device" regions as host memory: a
/// host-driven transport for device-path tests.
class HostAsDevice : public ForwardingTransport<LocalTransport> {
 public:
  explicit HostAsDevice(LocalTransport t) : ForwardingTransport(t) {}
  std::string_view name() const { return "host-as-device"; }
  RegionHandle register_memory(void* p, std::size_t n, MemoryKind kind) {
    if (kind == MemoryKind::device) ++device_regions;
    return inner().register_memory(p, n, MemoryKind::host);
  }
  int device_regions = 0;
};

/// An NCCL-like transport over the in-process world (see the top).
class DeviceStreamLocalTransport {
  struct Pending {
    std::vector<TransferOp> ops;
    HostEvent done;
    std::string error;  // set before done is reached
    bool flushed = false;
  };

 public:
  using request = std::shared_ptr<Pending>;
  explicit DeviceStreamLocalTransport(LocalTransport inner, std::chrono::microseconds max_delay = std::chrono::microseconds(0),
                                      std::uint64_t seed = 7)
      : inner_(inner), max_delay_(max_delay), rng_(seed) {}
  ~DeviceStreamLocalTransport() { stream_.drain(); }

  std::int64_t rank() const { return inner_.rank(); }
  std::span<const std::int64_t> world_ranks() const { return inner_.world_ranks(); }
  std::string_view name() const { return "device-stream-local"; }
  RegionHandle register_memory(void* p, std::size_t n, MemoryKind) { return inner_.register_memory(p, n, MemoryKind::host); }
  void deregister_memory(RegionHandle h) { inner_.deregister_memory(h); }
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> b, Deadline d) { return inner_.all_gather(b, d); }
  void prepare(std::span<const TransferOp> ops, Deadline d) { inner_.prepare(ops, d); }
  void* device_stream() { return &stream_; }

  request post(std::span<const TransferOp> ops) {
    auto p = std::make_shared<Pending>();
    p->ops.assign(ops.begin(), ops.end());
    queued_.push_back(p);
    return p;
  }
  /// The batch runs on the stream: after a random delay, every op goes to
  /// the in-process world and the stream waits for all of them.
  void flush(Deadline deadline) {
    if (queued_.empty()) return;
    auto batch = std::move(queued_);
    queued_.clear();
    for (auto& p : batch) p->flushed = true;
    const auto delay = max_delay_.count() > 0 ? std::chrono::microseconds(rng_() % static_cast<std::uint64_t>(max_delay_.count() + 1))
                                              : std::chrono::microseconds(0);
    ++batches;
    stream_.enqueue([this, batch, deadline, delay] {
      std::this_thread::sleep_for(delay);
      std::string error;
      try {
        std::vector<LocalTransport::request> rs;
        for (auto& p : batch) rs.push_back(inner_.post(p->ops));
        for (auto& r : rs) inner_.wait(r, deadline);
      } catch (const std::exception& e) {
        error = e.what();
      }
      for (auto& p : batch) {
        p->error = error;
        p->done.reach();
      }
    });
  }
  bool test(request& r) {
    ++host_checks;
    if (!r->flushed) flush(Clock::now() + std::chrono::seconds(60));
    if (!r->done.reached()) return false;
    if (!r->error.empty()) throw TransportError(r->error);
    return true;
  }
  void wait(request& r, Deadline deadline) {
    ++host_checks;
    if (!r->flushed) flush(deadline);
    while (!r->done.reached()) {
      if (Clock::now() > deadline) throw TransportError(fmt::format("device-stream-local: rank {}: a batch did not complete by the deadline", rank()));
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (!r->error.empty()) throw TransportError(r->error);
  }
  std::size_t wait_any(std::span<request* const> rs, Deadline deadline) {
    for (;;) {
      for (std::size_t i = 0; i < rs.size(); ++i)
        if (test(*rs[i])) return i;
      if (Clock::now() > deadline) throw TransportError(fmt::format("device-stream-local: rank {}: no batch completed by the deadline", rank()));
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  void abort(std::string_view why) noexcept { inner_.abort(why); }

  std::int64_t batches = 0;
  std::int64_t host_checks = 0;  ///< test() and wait() calls: the host asking whether a batch is done

 private:
  LocalTransport inner_;
  std::chrono::microseconds max_delay_;
  std::mt19937_64 rng_;
  std::vector<request> queued_;
  HostStream stream_;  // last: its worker stops first
};

}  // namespace reshard::test
