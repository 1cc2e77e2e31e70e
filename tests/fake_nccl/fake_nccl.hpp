#pragma once
// A fake NCCL and CUDA runtime, just the calls transport/nccl.hpp makes, so
// the transport's own logic (groups, plans, deadlines, aborts, the borrowed
// communicator, the out-of-band abort) compiles and runs on a CPU. A test
// target puts tests/fake_nccl/ first on its include path: nccl.hpp's
// <cuda_runtime.h> and <nccl.h> are then these.
//
// What it models, as NCCL behaves:
//  * "Device memory" is host memory from cudaMalloc (tracked, so
//    cudaPointerGetAttributes tells it from other memory). Devices are
//    numbers: cudaSetDevice checks the index, and each thread has its current
//    device.
//  * A stream runs its items in order: NCCL plans, event records, async
//    copies and memsets. A plan completes when every one of its sends and
//    receives met its partner; only the plan at the head of a stream takes
//    part in matching. Sends and receives between two ranks of one
//    communicator match in order (NCCL has no tags); the bytes are copied at
//    the match.
//  * ncclGroupEnd splits a group of more than plan_cap ops into plans of at
//    most plan_cap ops, cut from this rank's own op list in posting order,
//    as NCCL splits an oversized group into kernel plans each rank from its
//    own list: ends that cut a pair's messages into different plans hang.
//  * ncclCommAbort ends the communicator's work on this rank (its plans
//    complete without moving data) and is logged; it does not reach the
//    peers (over NVLink a peer's abort never shows in their waits): they see
//    nothing until their deadline.
//  * ncclCommSplit makes a child communicator; the child's rank is `key`
//    (the fake needs no collective for it: nccl.hpp splits with key = rank).
//
// The state is one process-wide Fabric (these are C functions, as NCCL's
// are); a test calls fake_nccl::fabric().reset() first and runs its ranks
// as threads.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace fake_nccl {
struct Stream;
struct Event;
struct Comm;
}  // namespace fake_nccl

// --- CUDA runtime types ---
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorNotReady = 600,
  cudaErrorLaunchTimeout = 702,
};
enum cudaMemoryType { cudaMemoryTypeUnregistered = 0, cudaMemoryTypeHost = 1, cudaMemoryTypeDevice = 2, cudaMemoryTypeManaged = 3 };
struct cudaPointerAttributes {
  cudaMemoryType type = cudaMemoryTypeUnregistered;
  int device = -1;
  void* devicePointer = nullptr;
  void* hostPointer = nullptr;
};
enum cudaMemcpyKind { cudaMemcpyHostToHost = 0, cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2, cudaMemcpyDeviceToDevice = 3, cudaMemcpyDefault = 4 };
inline constexpr unsigned cudaStreamNonBlocking = 1, cudaEventDisableTiming = 2;
typedef fake_nccl::Stream* cudaStream_t;
typedef fake_nccl::Event* cudaEvent_t;

// --- NCCL types ---
enum ncclResult_t {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
};
typedef fake_nccl::Comm* ncclComm_t;
struct ncclUniqueId {
  char internal[128];
};
enum ncclDataType_t { ncclInt8 = 0, ncclUint8 = 1 };
struct ncclConfig_t {
  int blocking = 1;
  int splitShare = 0;
};
#define NCCL_CONFIG_INITIALIZER {}
#define NCCL_SPLIT_NOCOLOR (-1)

namespace fake_nccl {

struct Op {
  bool send = false;
  int peer = -1;
  std::byte* ptr = nullptr;
  std::size_t bytes = 0;
};
struct Plan {
  Comm* comm = nullptr;
  std::vector<Op> ops;
  std::size_t left = 0;
  bool entered = false;
};
struct Item {  // one of: a plan, an event record, host work (async copy / memset / free)
  std::shared_ptr<Plan> plan;
  std::shared_ptr<bool> event_done;
  std::function<void()> work;
};
struct Stream {
  std::deque<Item> items;
};
struct Event {
  std::shared_ptr<bool> done = std::make_shared<bool>(true);
};
struct Comm {
  long clique = 0;
  int rank = 0, nranks = 0, device = 0;
  bool aborted = false, destroyed = false;
  ncclResult_t async = ncclSuccess;
  int splits = 0;  ///< children split from it on this rank
};

struct Fabric {
  struct Half {
    std::shared_ptr<Plan> plan;
    std::size_t op = 0;
  };
  using Key = std::tuple<long, int, int>;  // clique, sender, receiver

  std::mutex m;
  std::condition_variable cv;
  std::size_t plan_cap = 0;  ///< 0: a group is one plan however large
  int device_count = 1;
  long next_clique = 1;
  std::map<std::pair<long, int>, long> split_cliques;  // (parent clique, k-th split) -> child clique
  std::vector<std::unique_ptr<Comm>> comms;            // kept to the end: the logs name them
  std::vector<Comm*> aborted;                          ///< every ncclCommAbort, in order
  std::size_t groups = 0, most_plans = 0;              ///< ncclGroupEnd calls; most plans of one group
  std::set<Stream*> streams;
  std::map<Key, std::deque<Half>> sends, recvs;
  std::map<std::byte*, std::size_t> device_memory;

  void reset() {
    std::lock_guard lk(m);
    plan_cap = 0;
    device_count = 1;
    split_cliques.clear();
    aborted.clear();
    groups = most_plans = 0;
    sends.clear();
    recvs.clear();
    // comms and streams of earlier tests may still be referenced by their objects: keep them
  }
  bool was_aborted(const Comm* c) {
    std::lock_guard lk(m);
    return std::find(aborted.begin(), aborted.end(), c) != aborted.end();
  }
  std::size_t abort_count() {
    std::lock_guard lk(m);
    return aborted.size();
  }

  // m held. Runs every stream as far as it goes.
  void pump() {
    bool moved = true;
    while (moved) {
      moved = false;
      for (Stream* s : streams) moved |= advance(*s);
    }
    cv.notify_all();
  }
  // m held.
  bool advance(Stream& s) {
    bool moved = false;
    while (!s.items.empty()) {
      Item& head = s.items.front();
      if (head.plan) {
        Plan& p = *head.plan;
        if (!p.entered) {
          p.entered = true;
          moved = true;
          if (p.comm->aborted) p.left = 0;
          for (std::size_t i = 0; i < p.ops.size() && !p.comm->aborted; ++i) enter(head.plan, i);
        }
        if (p.left != 0) return moved;
      } else if (head.event_done) {
        *head.event_done = true;
      } else if (head.work) {
        head.work();
      }
      s.items.pop_front();
      moved = true;
    }
    return moved;
  }
  // m held. One op of a plan at the head of its stream meets its partner, or waits.
  void enter(const std::shared_ptr<Plan>& plan, std::size_t i) {
    const Op& op = plan->ops[i];
    const Comm& c = *plan->comm;
    const Key key = op.send ? Key{c.clique, c.rank, op.peer} : Key{c.clique, op.peer, c.rank};
    auto& others = op.send ? recvs[key] : sends[key];
    if (others.empty()) {
      (op.send ? sends[key] : recvs[key]).push_back(Half{plan, i});
      return;
    }
    Half theirs = others.front();
    others.pop_front();
    const Op& o = theirs.plan->ops[theirs.op];
    const Op& s = op.send ? op : o;
    const Op& r = op.send ? o : op;
    if (s.bytes != r.bytes) plan->comm->async = theirs.plan->comm->async = ncclInvalidUsage;
    if (s.bytes && r.bytes) std::memcpy(r.ptr, s.ptr, std::min(s.bytes, r.bytes));
    --plan->left;
    --theirs.plan->left;
  }
  // m held. An aborted communicator's work on this rank ends unmatched.
  void kill(Comm* c) {
    for (auto* q : {&sends, &recvs})
      for (auto& [key, halves] : *q)
        std::erase_if(halves, [&](const Half& h) { return h.plan->comm == c; });
    for (Stream* s : streams)
      for (auto& it : s->items)
        if (it.plan && it.plan->comm == c) it.plan->left = 0;
  }
};

/// The process-wide fabric (see the top of this file).
inline Fabric& fabric() {
  static Fabric f;
  return f;
}

struct ThreadState {
  int device = 0;
  int group_depth = 0;
  std::vector<std::tuple<Comm*, Stream*, Op>> group;
};
inline ThreadState& thread_state() {
  thread_local ThreadState t;
  return t;
}

inline void enqueue(Stream* s, Item item) {
  Fabric& f = fabric();
  std::lock_guard lk(f.m);
  s->items.push_back(std::move(item));
  f.pump();
}

inline ncclResult_t launch_group() {
  Fabric& f = fabric();
  auto& pending = thread_state().group;
  std::lock_guard lk(f.m);
  ++f.groups;
  // One plan list per (communicator, stream), each cut at plan_cap ops.
  std::map<std::pair<Comm*, Stream*>, std::vector<std::shared_ptr<Plan>>> plans;
  for (auto& [c, s, op] : pending) {
    auto& list = plans[{c, s}];
    if (list.empty() || (f.plan_cap && list.back()->ops.size() == f.plan_cap)) {
      list.push_back(std::make_shared<Plan>());
      list.back()->comm = c;
    }
    list.back()->ops.push_back(op);
    ++list.back()->left;
  }
  pending.clear();
  for (auto& [cs, list] : plans) {
    f.most_plans = std::max(f.most_plans, list.size());
    for (auto& p : list) cs.second->items.push_back(Item{p, nullptr, {}});
  }
  f.pump();
  return ncclSuccess;
}

}  // namespace fake_nccl

// --- CUDA runtime calls ---
inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorLaunchTimeout: return "cudaErrorLaunchTimeout";
    default: return "cudaError(fake)";
  }
}
inline const char* cudaGetErrorString(cudaError_t e) { return cudaGetErrorName(e); }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaGetDeviceCount(int* n) {
  std::lock_guard lk(fake_nccl::fabric().m);
  *n = fake_nccl::fabric().device_count;
  return *n ? cudaSuccess : cudaErrorNoDevice;
}
inline cudaError_t cudaGetDevice(int* d) {
  *d = fake_nccl::thread_state().device;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int d) {
  int n = 0;
  (void)cudaGetDeviceCount(&n);
  if (d < 0 || d >= n) return cudaErrorInvalidDevice;
  fake_nccl::thread_state().device = d;
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  auto& f = fake_nccl::fabric();
  std::lock_guard lk(f.m);
  *s = new fake_nccl::Stream;
  f.streams.insert(*s);
  return cudaSuccess;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
  auto& f = fake_nccl::fabric();
  std::lock_guard lk(f.m);
  f.streams.erase(s);
  delete s;
  return cudaSuccess;
}
/// Waits (at most 20 s: a test must not hang) until the stream ran everything.
inline cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  auto& f = fake_nccl::fabric();
  std::unique_lock lk(f.m);
  const bool done = f.cv.wait_for(lk, std::chrono::seconds(20), [&] { return s->items.empty(); });
  return done ? cudaSuccess : cudaErrorLaunchTimeout;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = new fake_nccl::Event;
  return cudaSuccess;
}
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  {
    std::lock_guard lk(fake_nccl::fabric().m);
    e->done = std::make_shared<bool>(false);
  }
  fake_nccl::enqueue(s, fake_nccl::Item{nullptr, e->done, {}});
  return cudaSuccess;
}
inline cudaError_t cudaEventQuery(cudaEvent_t e) {
  std::lock_guard lk(fake_nccl::fabric().m);
  return *e->done ? cudaSuccess : cudaErrorNotReady;
}
inline cudaError_t cudaMalloc(void** p, std::size_t n) {
  auto& f = fake_nccl::fabric();
  auto* b = static_cast<std::byte*>(::operator new(std::max<std::size_t>(n, 1)));
  std::lock_guard lk(f.m);
  f.device_memory[b] = n;
  *p = b;
  return cudaSuccess;
}
inline cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  auto& f = fake_nccl::fabric();
  {
    std::lock_guard lk(f.m);
    f.device_memory.erase(static_cast<std::byte*>(p));
  }
  ::operator delete(p);
  return cudaSuccess;
}
inline cudaError_t cudaMallocAsync(void** p, std::size_t n, cudaStream_t) { return cudaMalloc(p, n); }
inline cudaError_t cudaFreeAsync(void* p, cudaStream_t s) {
  fake_nccl::enqueue(s, fake_nccl::Item{nullptr, nullptr, [p] { ::operator delete(p); }});
  auto& f = fake_nccl::fabric();
  std::lock_guard lk(f.m);
  f.device_memory.erase(static_cast<std::byte*>(p));
  return cudaSuccess;
}
inline cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  auto& f = fake_nccl::fabric();
  std::lock_guard lk(f.m);
  *a = cudaPointerAttributes{};
  const auto* b = static_cast<const std::byte*>(p);
  auto it = f.device_memory.upper_bound(const_cast<std::byte*>(b));
  if (it != f.device_memory.begin()) {
    --it;
    if (b >= it->first && b < it->first + std::max<std::size_t>(it->second, 1)) {
      a->type = cudaMemoryTypeDevice;
      a->device = 0;
      a->devicePointer = const_cast<void*>(p);
    }
  }
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy(void* d, const void* s, std::size_t n, cudaMemcpyKind) {
  if (n) std::memcpy(d, s, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* d, const void* s, std::size_t n, cudaMemcpyKind, cudaStream_t st) {
  fake_nccl::enqueue(st, fake_nccl::Item{nullptr, nullptr, [d, s, n] {
                                            if (n) std::memcpy(d, s, n);
                                          }});
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* d, int v, std::size_t n, cudaStream_t st) {
  fake_nccl::enqueue(st, fake_nccl::Item{nullptr, nullptr, [d, v, n] { std::memset(d, v, n); }});
  return cudaSuccess;
}

// --- NCCL calls ---
inline const char* ncclGetErrorString(ncclResult_t rc) {
  switch (rc) {
    case ncclSuccess: return "no error";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "NCCL error (fake)";
  }
}
inline const char* ncclGetLastError(ncclComm_t) { return ""; }
inline ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  auto& f = fake_nccl::fabric();
  std::lock_guard lk(f.m);
  *id = ncclUniqueId{};
  const long clique = f.next_clique++;
  std::memcpy(id->internal, &clique, sizeof clique);
  return ncclSuccess;
}
inline ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int n, ncclUniqueId id, int rank, ncclConfig_t*) {
  auto& f = fake_nccl::fabric();
  std::lock_guard lk(f.m);
  auto c = std::make_unique<fake_nccl::Comm>();
  std::memcpy(&c->clique, id.internal, sizeof c->clique);
  c->rank = rank;
  c->nranks = n;
  c->device = fake_nccl::thread_state().device;
  *comm = c.get();
  f.comms.push_back(std::move(c));
  return ncclSuccess;
}
inline ncclResult_t ncclCommInitRank(ncclComm_t* comm, int n, ncclUniqueId id, int rank) { return ncclCommInitRankConfig(comm, n, id, rank, nullptr); }
inline ncclResult_t ncclCommSplit(ncclComm_t parent, int color, int key, ncclComm_t* child, ncclConfig_t*) {
  auto& f = fake_nccl::fabric();
  std::lock_guard lk(f.m);
  if (!parent || parent->aborted || parent->destroyed) return ncclInvalidUsage;
  const int k = parent->splits++;
  if (color == NCCL_SPLIT_NOCOLOR) {
    *child = nullptr;
    return ncclSuccess;
  }
  auto [it, fresh] = f.split_cliques.emplace(std::make_pair(parent->clique, k), 0);
  if (fresh) it->second = f.next_clique++;
  auto c = std::make_unique<fake_nccl::Comm>();
  c->clique = it->second;
  c->rank = key;
  c->nranks = parent->nranks;
  c->device = parent->device;
  *child = c.get();
  f.comms.push_back(std::move(c));
  return ncclSuccess;
}
inline ncclResult_t ncclCommCount(ncclComm_t c, int* n) {
  *n = c->nranks;
  return ncclSuccess;
}
inline ncclResult_t ncclCommUserRank(ncclComm_t c, int* r) {
  *r = c->rank;
  return ncclSuccess;
}
inline ncclResult_t ncclCommCuDevice(ncclComm_t c, int* d) {
  *d = c->device;
  return ncclSuccess;
}
inline ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t* state) {
  std::lock_guard lk(fake_nccl::fabric().m);
  *state = c->aborted ? ncclInvalidUsage : c->async;
  return ncclSuccess;
}
inline ncclResult_t ncclCommAbort(ncclComm_t c) {
  if (!c) return ncclSuccess;
  auto& f = fake_nccl::fabric();
  std::lock_guard lk(f.m);
  c->aborted = true;
  f.aborted.push_back(c);
  f.kill(c);
  f.pump();
  return ncclSuccess;
}
inline ncclResult_t ncclCommFinalize(ncclComm_t) { return ncclSuccess; }
inline ncclResult_t ncclCommDestroy(ncclComm_t c) {
  std::lock_guard lk(fake_nccl::fabric().m);
  c->destroyed = true;
  return ncclSuccess;
}
inline ncclResult_t ncclCommRegister(ncclComm_t, void* p, std::size_t, void** handle) {
  *handle = p;
  return ncclSuccess;
}
inline ncclResult_t ncclCommDeregister(ncclComm_t, void*) { return ncclSuccess; }
inline ncclResult_t ncclGroupStart() {
  ++fake_nccl::thread_state().group_depth;
  return ncclSuccess;
}
inline ncclResult_t ncclGroupEnd() {
  auto& t = fake_nccl::thread_state();
  if (t.group_depth == 0) return ncclInvalidUsage;
  if (--t.group_depth > 0) return ncclSuccess;
  return fake_nccl::launch_group();
}
inline ncclResult_t fake_p2p(bool send, void* p, std::size_t count, int peer, ncclComm_t c, cudaStream_t s) {
  if (!c || c->aborted || c->destroyed) return ncclInvalidUsage;
  if (peer < 0 || peer >= c->nranks) return ncclInvalidArgument;
  auto& t = fake_nccl::thread_state();
  t.group.emplace_back(c, s, fake_nccl::Op{send, peer, static_cast<std::byte*>(p), count});
  return t.group_depth == 0 ? fake_nccl::launch_group() : ncclSuccess;
}
inline ncclResult_t ncclSend(const void* p, std::size_t count, ncclDataType_t, int peer, ncclComm_t c, cudaStream_t s) {
  return fake_p2p(true, const_cast<void*>(p), count, peer, c, s);
}
inline ncclResult_t ncclRecv(void* p, std::size_t count, ncclDataType_t, int peer, ncclComm_t c, cudaStream_t s) {
  return fake_p2p(false, p, count, peer, c, s);
}
