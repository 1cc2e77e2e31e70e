#pragma once
// The in-process transport: every rank of both sides is a thread of one
// process, each over its own memory. A LocalTransport is one rank's endpoint
// and models reshard::Transport exactly as a networked backend does: the
// executor registers memory, posts sends and receives of byte ranges, and
// waits. The "network" is the LocalWorld: it matches a send with the receive
// of the same (sender, receiver, tag), in posting order, and then copies the
// bytes from the sender's registered range into the receiver's (one memcpy,
// like an RDMA write into a posted buffer). Nothing else crosses ranks.
//
// Copies are cut into tasks (task_bytes) that any thread blocked in a wait
// executes, at most copy_threads at once (default: the hardware threads), so
// many rank threads on few cores share the copying instead of spinning; idle
// threads sleep until their deadline, each on its own condition variable, and
// are woken only when something they may wait for changes (a transfer of
// theirs matched or completed, copy work left undone, an abort): one shared
// condition variable woke every rank thread on every completion, and with
// many ranks on two cores the wake-ups cost more than the copies.
//
//   LocalWorld world(ranks);
//   world.run([&](LocalTransport& t) { /* one thread per rank */ });
#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "../base/error.hpp"
#include "transport.hpp"

namespace reshard {

struct LocalWorldOptions {
  /// Threads copying at once; 0 = std::thread::hardware_concurrency().
  int copy_threads = 0;
  /// Largest piece of one message copied as one task.
  std::size_t task_bytes = 2u << 20;
  /// How the world moves a task's bytes; nullptr = std::memcpy (host memory).
  /// A world of ranks sharing one GPU passes a device copy (cuda/local_device.hpp).
  void (*copy)(void* to, const void* from, std::size_t bytes) = nullptr;
};

/// Bytes and messages the world moved for one rank.
struct LocalTrafficStats {
  std::int64_t bytes_sent = 0, bytes_received = 0, messages_sent = 0, messages_received = 0;
};

class LocalTransport;

class LocalWorld {
 public:
  explicit LocalWorld(std::vector<std::int64_t> ranks, LocalWorldOptions opt = {}) : ranks_(std::move(ranks)), opt_(opt) {
    if (ranks_.empty()) fail("LocalWorld: needs at least one rank");
    std::vector<std::int64_t> sorted = ranks_;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
      fail("LocalWorld: a rank appears twice in the rank list");
    for (std::size_t i = 0; i < ranks_.size(); ++i) index_.emplace(ranks_[i], i);
    if (opt_.copy_threads <= 0) opt_.copy_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    if (opt_.task_bytes == 0) opt_.task_bytes = 2u << 20;
    if (!opt_.copy) opt_.copy = copy_host;
    endpoints_.resize(ranks_.size());
    wake_ = std::make_unique<std::condition_variable[]>(ranks_.size());
    asleep_.assign(ranks_.size(), 0);
    left_.assign(ranks_.size(), 0);
    gather_slots_.resize(ranks_.size());
    gather_seen_.assign(ranks_.size(), 0);
  }
  LocalWorld(const LocalWorld&) = delete;
  LocalWorld& operator=(const LocalWorld&) = delete;

  const std::vector<std::int64_t>& ranks() const { return ranks_; }
  std::size_t size() const { return ranks_.size(); }
  inline LocalTransport endpoint(std::int64_t rank);

  /// Runs fn(LocalTransport&) on one thread per rank and joins them. When a
  /// rank throws, the world is aborted (so the others fail instead of waiting
  /// for it) and the first failure is rethrown. When a rank's fn returns, it
  /// has left: a wait for an op with it that is still unmatched, or an
  /// all_gather it did not join, fails at once, naming it (it never will).
  template <class F>
  void run(F&& fn);

  /// Traffic the world moved for a rank since the start (or since reset_stats).
  LocalTrafficStats stats(std::int64_t rank) const {
    std::lock_guard lk(m_);
    return endpoints_[slot(rank)].traffic;
  }
  LocalTrafficStats total_stats() const {
    std::lock_guard lk(m_);
    LocalTrafficStats t;
    for (const auto& e : endpoints_) {
      t.bytes_sent += e.traffic.bytes_sent;
      t.bytes_received += e.traffic.bytes_received;
      t.messages_sent += e.traffic.messages_sent;
      t.messages_received += e.traffic.messages_received;
    }
    return t;
  }
  void reset_stats() {
    std::lock_guard lk(m_);
    for (auto& e : endpoints_) e.traffic = {};
  }
  bool aborted() const {
    std::lock_guard lk(m_);
    return aborted_;
  }
  const LocalWorldOptions& options() const { return opt_; }

 private:
  friend class LocalTransport;

  struct Region {
    std::byte* ptr = nullptr;
    std::size_t bytes = 0;
    bool live = false;
  };
  /// One post(): its ops and which of them are done.
  struct Group {
    std::int64_t rank = -1;
    std::vector<TransferOp> ops;
    std::vector<char> done;
    std::size_t left = 0;
    std::string error;
  };
  struct Pending {
    std::shared_ptr<Group> group;
    std::size_t op = 0;
    std::byte* ptr = nullptr;
  };
  struct Transfer {
    Pending send, recv;
    std::size_t bytes = 0;
    std::size_t tasks_left = 0;  // guarded by m_
    bool cancelled = false;      // guarded by m_: a side's region was deregistered (both sides completed with an error)
  };
  struct Task {
    std::shared_ptr<Transfer> transfer;
    std::size_t offset = 0, bytes = 0;
  };
  struct Endpoint {
    std::vector<Region> regions;
    LocalTrafficStats traffic;
  };
  using Key = std::tuple<std::int64_t, std::int64_t, std::uint64_t>;  // sender, receiver, tag

  std::size_t slot(std::int64_t rank) const {
    auto it = index_.find(rank);
    if (it == index_.end()) fail("local transport: rank {} is not in this world", rank);
    return it->second;
  }

  static void copy_host(void* to, const void* from, std::size_t bytes) { std::memcpy(to, from, bytes); }

  RegionHandle register_memory(std::size_t me, void* p, std::size_t bytes) {
    std::lock_guard lk(m_);
    auto& regs = endpoints_[me].regions;
    regs.push_back(Region{static_cast<std::byte*>(p), bytes, true});
    return RegionHandle{static_cast<std::uint32_t>(regs.size() - 1)};
  }
  /// Once it returns, no thread reads or writes the region any more: its
  /// ops still queued are dropped, transfers over it that are matched but
  /// not done fail on both sides (the peer's wait throws, naming this), and
  /// copies of them already running are waited for. A rank whose refit
  /// failed drops its requests unwaited and frees its staging right after.
  void deregister_memory(std::size_t me, RegionHandle h) {
    std::unique_lock lk(m_);
    auto& regs = endpoints_[me].regions;
    if (h.id >= regs.size() || !regs[h.id].live) return;
    regs[h.id].live = false;
    const std::int64_t rank = ranks_[me];
    auto on_region = [&](const Pending& p) { return p.group->rank == rank && p.group->ops[p.op].region.id == h.id; };
    for (auto* queues : {&sends_, &recvs_})
      for (auto it = queues->begin(); it != queues->end();) {
        std::erase_if(it->second, on_region);
        it = it->second.empty() ? queues->erase(it) : std::next(it);
      }
    auto touches = [&](const Transfer& t) { return on_region(t.send) || on_region(t.recv); };
    Wakeups wake;
    auto cancel = [&](Transfer& t) {
      if (t.cancelled) return;
      t.cancelled = true;
      const Pending& mine = on_region(t.send) ? t.send : t.recv;
      const auto msg = fmt::format("local transport: rank {} deregistered region {} while its {} was in flight", rank, h.id,
                                   describe(mine.group->ops[mine.op], rank));
      for (Pending* p : {&t.send, &t.recv}) {
        if (p->group->error.empty()) p->group->error = msg;
        complete(*p);
      }
      wake.parties(t, *this);
    };
    for (Transfer* t : copying_)
      if (touches(*t)) cancel(*t);
    std::erase_if(tasks_, [&](const Task& task) {
      if (!touches(*task.transfer)) return false;
      cancel(*task.transfer);
      return true;
    });
    copy_end_.wait(lk, [&] { return std::none_of(copying_.begin(), copying_.end(), [&](Transfer* t) { return touches(*t); }); });
    lk.unlock();
    wake.notify(*this, me);
  }
  std::vector<std::span<const std::byte>> registered(std::size_t me) const {
    std::lock_guard lk(m_);
    std::vector<std::span<const std::byte>> out;
    for (const Region& r : endpoints_[me].regions)
      if (r.live) out.emplace_back(r.ptr, r.bytes);
    return out;
  }

  std::string describe(const TransferOp& op, std::int64_t me) const {
    return op.kind == OpKind::send ? fmt::format("send of {} bytes from rank {} to rank {} (tag {:#x})", op.bytes, me, op.peer, op.tag)
                                   : fmt::format("receive of {} bytes from rank {} at rank {} (tag {:#x})", op.bytes, op.peer, me, op.tag);
  }

  std::shared_ptr<Group> post(std::size_t me, std::span<const TransferOp> ops) {
    auto g = std::make_shared<Group>();
    g->rank = ranks_[me];
    g->ops.assign(ops.begin(), ops.end());
    g->done.assign(ops.size(), 0);
    g->left = ops.size();
    std::unique_lock lk(m_);
    if (aborted_) throw TransportError(abort_reason_);
    // Check every op before matching any, so a bad group posts nothing.
    std::vector<std::byte*> ptrs(ops.size());
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const auto& op = ops[i];
      if (!index_.count(op.peer))
        throw TransportError(fmt::format("local transport: rank {} posts a {} with peer {}, which is not in this world",
                                         g->rank, op.kind == OpKind::send ? "send" : "receive", op.peer));
      const auto& regs = endpoints_[me].regions;
      if (op.region.id >= regs.size() || !regs[op.region.id].live)
        throw TransportError(fmt::format("local transport: rank {}: {} uses region {} which is not registered",
                                         g->rank, describe(op, g->rank), op.region.id));
      const Region& r = regs[op.region.id];
      if (op.offset > r.bytes || op.bytes > r.bytes - op.offset)
        throw TransportError(fmt::format("local transport: rank {}: {} covers bytes [{}, {}) of a region of {} bytes",
                                         g->rank, describe(op, g->rank), op.offset, op.offset + op.bytes, r.bytes));
      ptrs[i] = r.ptr + op.offset;
    }
    Wakeups wake;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const auto& op = ops[i];
      Pending mine{g, i, ptrs[i]};
      const bool send = op.kind == OpKind::send;
      const Key key = send ? Key{g->rank, op.peer, op.tag} : Key{op.peer, g->rank, op.tag};
      auto& other = send ? recvs_ : sends_;
      auto it = other.find(key);
      if (it == other.end() || it->second.empty()) {
        (send ? sends_ : recvs_)[key].push_back(std::move(mine));
        continue;
      }
      Pending theirs = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) other.erase(it);
      auto t = std::make_shared<Transfer>();
      t->send = send ? std::move(mine) : std::move(theirs);
      t->recv = send ? std::move(theirs) : std::move(mine);
      const auto& sop = t->send.group->ops[t->send.op];
      const auto& rop = t->recv.group->ops[t->recv.op];
      if (sop.bytes != rop.bytes) {
        const auto msg = fmt::format("local transport: size mismatch: rank {} sends {} bytes to rank {} with tag {:#x}, "
                                     "but rank {} posted a receive of {} bytes",
                                     t->send.group->rank, sop.bytes, sop.peer, sop.tag, sop.peer, rop.bytes);
        t->send.group->error = msg;
        t->recv.group->error = msg;
        complete(t->send);
        complete(t->recv);
        wake.parties(*t, *this);
        continue;
      }
      t->bytes = sop.bytes;
      if (t->bytes == 0) {
        finish_transfer(*t);
        wake.parties(*t, *this);
        continue;
      }
      t->tasks_left = (t->bytes + opt_.task_bytes - 1) / opt_.task_bytes;
      for (std::size_t off = 0; off < t->bytes; off += opt_.task_bytes)
        tasks_.push_back(Task{t, off, std::min(opt_.task_bytes, t->bytes - off)});
      wake.parties(*t, *this);  // the peer copies if it is waiting; this rank does when it waits
    }
    lk.unlock();
    wake.notify(*this, me);
    return g;
  }

  /// Rank threads to wake once m_ is released (at most the two parties of
  /// each transfer a call touched, or one sleeper to take copy work). Kept
  /// in place up to kInline slots: post() and wait_until() are the
  /// transport's hot path and should not allocate per call.
  struct Wakeups {
    static constexpr std::size_t kInline = 8;
    std::array<std::size_t, kInline> first{};
    std::size_t n = 0;
    std::vector<std::size_t> more;  ///< only when a post() touches more than kInline / 2 transfers
    void add(std::size_t s) {
      if (n < kInline)
        first[n++] = s;
      else
        more.push_back(s);
    }
    void parties(const Transfer& t, const LocalWorld& w) {
      add(w.slot(t.send.group->rank));
      add(w.slot(t.recv.group->rank));
    }
    void notify(LocalWorld& w, std::size_t me) {
      auto wake = [&](std::size_t* b, std::size_t* e) {
        std::sort(b, e);
        for (auto* it = b, *last = std::unique(b, e); it != last; ++it)
          if (*it != me) w.wake_[*it].notify_one();
      };
      if (more.empty()) {
        wake(first.data(), first.data() + n);
      } else {
        more.insert(more.end(), first.begin(), first.begin() + static_cast<std::ptrdiff_t>(n));
        wake(more.data(), more.data() + more.size());
        more.clear();
      }
      n = 0;
    }
  };

  // --- completion (m_ held) ---
  void complete(Pending& p) {
    auto& g = *p.group;
    if (!g.done[p.op]) {
      g.done[p.op] = 1;
      --g.left;
    }
  }
  void finish_transfer(Transfer& t) {
    auto& s = endpoints_[slot(t.send.group->rank)].traffic;
    auto& r = endpoints_[slot(t.recv.group->rank)].traffic;
    s.bytes_sent += static_cast<std::int64_t>(t.bytes);
    s.messages_sent += 1;
    r.bytes_received += static_cast<std::int64_t>(t.bytes);
    r.messages_received += 1;
    complete(t.send);
    complete(t.recv);
  }

  /// Blocks until done() holds, executing copy tasks while waiting. Throws on
  /// abort or at the deadline (what() names what is pending).
  template <class Done, class Pend, class Stranded>
  void wait_until(std::size_t me, Done&& done, Pend&& pending, Stranded&& stranded, Deadline deadline) {
    std::unique_lock lk(m_);
    Wakeups wake;
    while (true) {
      if (done()) {
        // Copy work this rank leaves behind goes to a sleeper (it may have
        // found every copy slot taken when it went to sleep).
        if (!tasks_.empty() && active_copiers_ < opt_.copy_threads) wake_one_sleeper(me, wake);
        lk.unlock();
        wake.notify(*this, me);
        return;
      }
      if (aborted_) throw TransportError(abort_reason_);
      if (const std::string why = stranded(); !why.empty())
        throw TransportError(fmt::format("local transport: rank {} waits in vain: {}", ranks_[me], why));
      if (!tasks_.empty() && active_copiers_ < opt_.copy_threads) {
        Task task = std::move(tasks_.front());
        tasks_.pop_front();
        ++active_copiers_;
        copying_.push_back(task.transfer.get());
        lk.unlock();
        opt_.copy(task.transfer->recv.ptr + task.offset, task.transfer->send.ptr + task.offset, task.bytes);
        lk.lock();
        --active_copiers_;
        copying_.erase(std::find(copying_.begin(), copying_.end(), task.transfer.get()));
        if (task.transfer->cancelled) {
          copy_end_.notify_all();  // a deregistration waits for this copy
          continue;
        }
        if (--task.transfer->tasks_left == 0) {
          finish_transfer(*task.transfer);
          wake.parties(*task.transfer, *this);
          lk.unlock();
          wake.notify(*this, me);
          lk.lock();
        }
        continue;
      }
      asleep_[me] = 1;
      const auto st = wake_[me].wait_until(lk, deadline);
      asleep_[me] = 0;
      if (st == std::cv_status::timeout && !done() && !aborted_) {
        throw TransportError(fmt::format("local transport: rank {} timed out waiting for {}", ranks_[me], pending()));
      }
    }
  }
  void wake_one_sleeper(std::size_t me, Wakeups& wake) const {
    for (std::size_t s = 0; s < asleep_.size(); ++s)
      if (s != me && asleep_[s]) {
        wake.add(s);
        return;
      }
  }
  void wake_all() {
    for (std::size_t s = 0; s < ranks_.size(); ++s) wake_[s].notify_all();
    gather_cv_.notify_all();
  }

  std::string pending_ops(const std::vector<Group*>& groups) const {
    std::string s;
    int shown = 0, total = 0;
    for (const Group* g : groups)
      for (std::size_t i = 0; i < g->ops.size(); ++i)
        if (!g->done[i]) {
          ++total;
          if (shown < 4) {
            s += (shown ? "; " : "") + describe(g->ops[i], g->rank);
            ++shown;
          }
        }
    if (total > shown) s += fmt::format("; and {} more", total - shown);
    return s.empty() ? "nothing" : s;
  }

  /// A rank's fn returned: whoever waits for it is told.
  void leave(std::size_t slot) {
    {
      std::lock_guard lk(m_);
      left_[slot] = 1;
    }
    wake_all();
  }
  /// m_ held. "" or which op of `groups` waits for a rank that left: one not
  /// yet matched (still queued), whose peer's fn returned.
  std::string stranded(const std::vector<Group*>& groups) const {
    for (const Group* g : groups)
      for (std::size_t i = 0; i < g->ops.size(); ++i) {
        const TransferOp& op = g->ops[i];
        const auto peer = index_.find(op.peer);
        if (g->done[i] || peer == index_.end() || !left_[peer->second]) continue;
        const bool send = op.kind == OpKind::send;
        const auto& queues = send ? sends_ : recvs_;
        const auto it = queues.find(send ? Key{g->rank, op.peer, op.tag} : Key{op.peer, g->rank, op.tag});
        if (it == queues.end()) continue;
        for (const Pending& p : it->second)
          if (p.group.get() == g && p.op == i)
            return fmt::format("rank {} left the world (its thread returned), so this never matches: {}", op.peer, describe(op, g->rank));
      }
    return {};
  }

  void abort(std::string_view why) noexcept {
    try {
      {
        std::lock_guard lk(m_);
        if (!aborted_) {
          aborted_ = true;
          abort_reason_ = fmt::format("local transport: aborted: {}", why);
        }
      }
      wake_all();
    } catch (...) {
      // Formatting failed (out of memory): still wake everyone.
      {
        std::lock_guard lk(m_);
        aborted_ = true;
      }
      wake_all();
    }
  }

  std::vector<std::vector<std::byte>> all_gather(std::size_t me, std::span<const std::byte> blob, Deadline deadline) {
    std::unique_lock lk(m_);
    if (aborted_) throw TransportError(abort_reason_);
    const std::uint64_t gen = gather_gen_;
    gather_slots_[me].assign(blob.begin(), blob.end());
    gather_seen_[me] = gen + 1;
    if (++gather_arrived_ == ranks_.size()) {
      gather_result_ = gather_slots_;
      gather_arrived_ = 0;
      ++gather_gen_;
      lk.unlock();
      gather_cv_.notify_all();
      lk.lock();
      return gather_result_;
    }
    while (gather_gen_ == gen) {
      if (aborted_) throw TransportError(abort_reason_);
      for (std::size_t i = 0; i < ranks_.size(); ++i)
        if (left_[i] && gather_seen_[i] != gen + 1)
          throw TransportError(fmt::format("local transport: rank {} waits in vain in the bootstrap all_gather: rank {} left the world (its "
                                           "thread returned) without joining it", ranks_[me], ranks_[i]));
      if (gather_cv_.wait_until(lk, deadline) == std::cv_status::timeout && gather_gen_ == gen)
      {
        std::vector<std::int64_t> absent;
        for (std::size_t i = 0; i < ranks_.size(); ++i)
          if (gather_seen_[i] != gen + 1) absent.push_back(ranks_[i]);
        throw TransportError(fmt::format("local transport: rank {} timed out in the bootstrap all_gather ({} of {} ranks arrived; "
                                         "missing rank{} {})",
                                         ranks_[me], gather_arrived_, ranks_.size(), absent.size() == 1 ? "" : "s", fmt::join(absent, ", ")));
      }
    }
    return gather_result_;
  }

  std::vector<std::vector<std::byte>> exchange(std::size_t me, std::span<const PeerBlob> out, Deadline deadline) {
    std::unique_lock lk(m_);
    if (aborted_) throw TransportError(abort_reason_);
    std::vector<std::size_t> from(out.size());
    for (std::size_t i = 0; i < out.size(); ++i) {
      auto it = index_.find(out[i].peer);
      if (it == index_.end() || it->second == me)
        throw TransportError(fmt::format("local transport: rank {} exchanges with rank {}, which is {}", ranks_[me], out[i].peer,
                                         it == index_.end() ? "not in the world" : "itself"));
      from[i] = it->second;
    }
    for (std::size_t i = 0; i < out.size(); ++i) mail_[{me, from[i]}].push_back(out[i].bytes);
    gather_cv_.notify_all();
    auto missing = [&] {
      std::vector<std::int64_t> m;
      for (std::size_t i = 0; i < out.size(); ++i) {
        // A peer listed twice needs two blobs.
        const auto need = static_cast<std::size_t>(std::count(from.begin(), from.begin() + static_cast<std::ptrdiff_t>(i) + 1, from[i]));
        auto it = mail_.find({from[i], me});
        if (it == mail_.end() || it->second.size() < need) m.push_back(ranks_[from[i]]);
      }
      return m;
    };
    for (auto m = missing(); !m.empty(); m = missing()) {
      if (aborted_) throw TransportError(abort_reason_);
      for (auto r : m)
        if (left_[index_.at(r)])
          throw TransportError(fmt::format("local transport: rank {} waits in vain in a pairwise exchange: rank {} left the world (its "
                                           "thread returned) without sending to it", ranks_[me], r));
      if (gather_cv_.wait_until(lk, deadline) == std::cv_status::timeout && !missing().empty())
        throw TransportError(fmt::format("local transport: rank {} timed out in a pairwise exchange: nothing from rank{} {}", ranks_[me],
                                         missing().size() == 1 ? "" : "s", fmt::join(missing(), ", ")));
    }
    std::vector<std::vector<std::byte>> got(out.size());
    for (std::size_t i = 0; i < out.size(); ++i) {
      auto& box = mail_[{from[i], me}];
      got[i] = std::move(box.front());
      box.pop_front();
    }
    return got;
  }

  std::vector<std::int64_t> ranks_;
  std::map<std::int64_t, std::size_t> index_;
  LocalWorldOptions opt_;

  mutable std::mutex m_;
  std::unique_ptr<std::condition_variable[]> wake_;  ///< per rank slot: its thread sleeps on it in wait_until
  std::vector<char> asleep_;                         ///< per rank slot, guarded by m_
  std::vector<char> left_;                           ///< per rank slot, guarded by m_: its fn returned
  std::condition_variable gather_cv_;                ///< all_gather's arrivals
  std::vector<Endpoint> endpoints_;
  std::map<Key, std::deque<Pending>> sends_, recvs_;
  std::deque<Task> tasks_;
  std::vector<Transfer*> copying_;       ///< the transfer of each task being copied now (outside m_)
  std::condition_variable copy_end_;     ///< a copy of a cancelled transfer ended
  int active_copiers_ = 0;
  bool aborted_ = false;
  std::string abort_reason_;
  std::vector<std::vector<std::byte>> gather_slots_, gather_result_;
  std::map<std::pair<std::size_t, std::size_t>, std::deque<std::vector<std::byte>>> mail_;  ///< (from, to) slot: pairwise blobs
  std::vector<std::uint64_t> gather_seen_;  ///< per rank: generation + 1 of its last arrival
  std::size_t gather_arrived_ = 0;
  std::uint64_t gather_gen_ = 0;
  LifetimeToken token_;  ///< its endpoints' registrations live here
};

/// One rank's endpoint of a LocalWorld (a cheap handle; the world outlives it).
class LocalTransport {
 public:
  using request = std::shared_ptr<LocalWorld::Group>;

  LocalTransport(LocalWorld& w, std::int64_t rank) : w_(&w), me_(w.slot(rank)) {}

  std::int64_t rank() const { return w_->ranks_[me_]; }
  std::span<const std::int64_t> world_ranks() const { return w_->ranks_; }
  std::string_view name() const { return "local"; }
  LocalWorld& world() const { return *w_; }

  RegionHandle register_memory(void* p, std::size_t bytes, MemoryKind kind) {
    if (kind != MemoryKind::host) fail("local transport: only host memory can be registered (rank {})", rank());
    if (!p && bytes) fail("local transport: rank {} registers a null pointer for {} bytes", rank(), bytes);
    return w_->register_memory(me_, p, bytes);
  }
  void deregister_memory(RegionHandle h) { w_->deregister_memory(me_, h); }
  /// This handle and its world: a registration outlives neither.
  Lifetime lifetime() const { return Lifetime(token_).add(w_->token_); }
  /// The ranges this endpoint has registered and not deregistered (what a
  /// test measures staging by, apart from the executor's own figures).
  std::vector<std::span<const std::byte>> registered() const { return w_->registered(me_); }

  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> blob, Deadline deadline) {
    return w_->all_gather(me_, blob, deadline);
  }
  std::vector<std::vector<std::byte>> exchange(std::span<const PeerBlob> out, Deadline deadline) {
    return w_->exchange(me_, out, deadline);
  }
  /// Two-sided matching needs no setup; checks the ops reference live regions.
  void prepare(std::span<const TransferOp> ops, Deadline) {
    std::lock_guard lk(w_->m_);
    const auto& regs = w_->endpoints_[me_].regions;
    for (const auto& op : ops)
      if (op.region.id >= regs.size() || !regs[op.region.id].live)
        throw TransportError(fmt::format("local transport: rank {}: {} uses region {} which is not registered", rank(),
                                         w_->describe(op, rank()), op.region.id));
  }

  request post(std::span<const TransferOp> ops) { return w_->post(me_, ops); }

  bool test(request& r) {
    std::lock_guard lk(w_->m_);
    check(r);
    if (r->left == 0 && !r->error.empty()) throw TransportError(r->error);
    return r->left == 0;
  }
  void wait(request& r, Deadline deadline) {
    check(r);
    LocalWorld::Group* g = r.get();
    w_->wait_until(
        me_, [&] { return g->left == 0; }, [&] { return w_->pending_ops({g}); }, [&] { return w_->stranded({g}); }, deadline);
    if (!g->error.empty()) throw TransportError(g->error);
  }
  std::size_t wait_any(std::span<request* const> rs, Deadline deadline) {
    if (rs.empty()) fail("local transport: wait_any on no requests (rank {})", rank());
    for (auto* r : rs) check(*r);
    std::size_t found = rs.size();
    w_->wait_until(
        me_,
        [&] {
          for (std::size_t i = 0; i < rs.size(); ++i)
            if ((*rs[i])->left == 0) {
              found = i;
              return true;
            }
          return false;
        },
        [&] { return w_->pending_ops(groups_of(rs)); }, [&] { return w_->stranded(groups_of(rs)); }, deadline);
    if (!(*rs[found])->error.empty()) throw TransportError((*rs[found])->error);
    return found;
  }
  void abort(std::string_view why) noexcept { w_->abort(why); }

 private:
  static std::vector<LocalWorld::Group*> groups_of(std::span<request* const> rs) {
    std::vector<LocalWorld::Group*> gs;
    for (auto* r : rs) gs.push_back(r->get());
    return gs;
  }
  void check(const request& r) const {
    if (!r) fail("local transport: wait on an empty request (rank {})", rank());
    if (r->rank != rank()) fail("local transport: rank {} waits on a request of rank {}", rank(), r->rank);
  }
  LocalWorld* w_;
  std::size_t me_;
  LifetimeToken token_;
};

inline LocalTransport LocalWorld::endpoint(std::int64_t rank) { return LocalTransport(*this, rank); }

template <class F>
void LocalWorld::run(F&& fn) {
  if (aborted()) throw Error(fmt::format("LocalWorld::run: the world was aborted earlier ({}); make a new one", abort_reason_));
  std::vector<std::exception_ptr> errors(ranks_.size());
  std::mutex first_m;
  std::ptrdiff_t first = -1;
  std::vector<std::thread> threads;
  threads.reserve(ranks_.size());
  for (std::size_t i = 0; i < ranks_.size(); ++i) {
    threads.emplace_back([&, i] {
      try {
        LocalTransport t(*this, ranks_[i]);
        fn(t);
        leave(i);
      } catch (const std::exception& e) {
        errors[i] = std::current_exception();
        bool root = false;
        {
          std::lock_guard lk(first_m);
          // An abort-induced failure is a consequence, not the cause.
          if (first < 0 && !aborted()) {
            first = static_cast<std::ptrdiff_t>(i);
            root = true;
          }
        }
        if (root) abort(fmt::format("rank {} failed: {}", ranks_[i], e.what()));
      } catch (...) {
        errors[i] = std::current_exception();
        abort(fmt::format("rank {} failed", ranks_[i]));
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first >= 0) std::rethrow_exception(errors[static_cast<std::size_t>(first)]);
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

static_assert(check_transport<LocalTransport>());

}  // namespace reshard
