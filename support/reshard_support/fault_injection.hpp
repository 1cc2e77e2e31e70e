#pragma once
// FaultInjectingTransport<Inner>: a reshard::Transport that wraps any other
// (local, UCX, ...) and, as a shared FaultPlan says, corrupts, drops, delays
// or duplicates chosen messages. For tests: every injected fault must end in
// an error naming the tensor and the peer, never in a refit that reports
// success.
//
//   reshard::FaultPlan plan;
//   plan.add(reshard::FaultRule::when(reshard::FaultKind::corrupt_arrived,
//            [](const reshard::MessageInfo& m) { return m.from == 0 && m.to == 3 && m.replay == 1; }));
//   world.run([&](reshard::LocalTransport& inner) {
//     reshard::FaultInjectingTransport<reshard::LocalTransport> t(inner, plan);
//     reshard::Resharder<reshard::Layout, decltype(t)> r(src, dst, bufs, t);  // t everywhere the inner was
//     ...
//   });
//   plan.injected();   // what was done, to compare with the errors seen
//
// A message is one send op (for corrupt_arrived: one receive op) as the
// executor posts it; `replay` counts how often this endpoint posted an op of
// the same kind, peer and tag before (0 in the first refit, 1 in the second,
// ...), `index` counts every op this endpoint posted. Each rule hits at most
// `times` messages (all endpoints together), first rule first.
//
// Faults:
//  * corrupt_sent: XORs one byte of the sender's range right before the send
//    is posted and restores it when the send completes (the ops stay exactly
//    as prepared, so a one-sided backend works too). While the send is in
//    flight anything else reading that byte sees the flipped value.
//  * corrupt_arrived: XORs one byte of the receiver's range when the receive
//    is seen complete (before the executor looks at it).
//  * drop: the send is never posted; locally it reads as complete. The
//    receiver waits until its deadline.
//  * delay: the send is posted `delay` later, by whichever call this endpoint
//    makes into the transport once it is due (every wait is cut short at the
//    next due time for that; the endpoint's other messages are not held up).
//    Its group completes only after it was posted and completed.
//  * duplicate: the send is posted, and a second send of the same bytes
//    (copied at post time) to the same peer and tag is posted beside it and
//    never waited for: the peer's next receive of that tag (its next refit)
//    matches the copy. Needs a transport that accepts ops not given to
//    prepare() (the local one; UCX refuses them).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "reshard/base/error.hpp"
#include "reshard/transport/transport.hpp"

namespace reshard {

enum class FaultKind : std::uint8_t { corrupt_sent, corrupt_arrived, drop, delay, duplicate };

inline const char* to_string(FaultKind k) {
  switch (k) {
    case FaultKind::corrupt_sent: return "corrupt_sent";
    case FaultKind::corrupt_arrived: return "corrupt_arrived";
    case FaultKind::drop: return "drop";
    case FaultKind::delay: return "delay";
    case FaultKind::duplicate: return "duplicate";
  }
  return "?";
}

/// A message as a rule sees it.
struct MessageInfo {
  std::int64_t from = -1, to = -1;  ///< sender and receiver (global ranks)
  std::uint64_t tag = 0, bytes = 0;
  std::int64_t replay = 0;  ///< earlier posts of this (kind, peer, tag) on this endpoint
  std::int64_t index = 0;   ///< ops this endpoint posted before this one
};

struct FaultRule {
  FaultKind kind = FaultKind::corrupt_arrived;
  std::function<bool(const MessageInfo&)> match;  ///< empty: every message
  int times = 1;                                  ///< messages to hit; < 0: unlimited
  std::chrono::milliseconds delay{0};             ///< for delay
  std::uint64_t byte = UINT64_MAX;                ///< corrupt: which byte (wraps); default the middle one
  unsigned char mask = 0x01;                      ///< corrupt: XOR mask (non-zero)

  static FaultRule when(FaultKind k, std::function<bool(const MessageInfo&)> m, int times = 1) {
    FaultRule r;
    r.kind = k;
    r.match = std::move(m);
    r.times = times;
    return r;
  }
};

/// What was injected, in order.
struct InjectedFault {
  FaultKind kind;
  MessageInfo message;
};

/// The rules every endpoint of a job shares; thread-safe.
class FaultPlan {
 public:
  FaultPlan& add(FaultRule r) {
    if ((r.kind == FaultKind::corrupt_sent || r.kind == FaultKind::corrupt_arrived) && r.mask == 0)
      fail("FaultPlan: a corruption with XOR mask 0 changes nothing");
    std::lock_guard lk(m_);
    rules_.push_back(Rule{std::move(r), 0});
    return *this;
  }
  std::vector<InjectedFault> injected() const {
    std::lock_guard lk(m_);
    return log_;
  }
  std::size_t injected_count() const {
    std::lock_guard lk(m_);
    return log_.size();
  }

  /// The rule that takes this message, if any (counts the hit and logs it).
  std::optional<FaultRule> take(const MessageInfo& m, bool send_side) {
    std::lock_guard lk(m_);
    for (auto& r : rules_) {
      const bool wants_send = r.rule.kind != FaultKind::corrupt_arrived;
      if (wants_send != send_side) continue;
      if (r.rule.times >= 0 && r.hits >= r.rule.times) continue;
      if (r.rule.match && !r.rule.match(m)) continue;
      ++r.hits;
      log_.push_back(InjectedFault{r.rule.kind, m});
      return r.rule;
    }
    return std::nullopt;
  }

 private:
  struct Rule {
    FaultRule rule;
    int hits = 0;
  };
  mutable std::mutex m_;
  std::vector<Rule> rules_;
  std::vector<InjectedFault> log_;
};

template <class Inner>
class FaultInjectingTransport {
  static_assert(check_transport<Inner>(), "FaultInjectingTransport<Inner>: Inner must model reshard::Transport");

  struct Flip {
    std::byte* at = nullptr;
    unsigned char mask = 0;
  };

 public:
  /// One post(): what went to the inner transport, and what is still held back.
  struct State {
    std::vector<typename Inner::request> inner;  ///< empty with nothing posted (all dropped)
    std::size_t delayed_left = 0;                ///< delayed ops not posted yet
    std::vector<Flip> on_arrival;                ///< receive corruptions, applied once
    std::vector<Flip> restore;                   ///< send corruptions to undo once done
    bool seen_done = false;
  };
  struct request {
    std::shared_ptr<State> s;
  };

  FaultInjectingTransport(Inner& inner, FaultPlan& plan) : in_(&inner), plan_(&plan) {
    if constexpr (LifetimeTransport<Inner>) inner_life_ = inner.lifetime();
  }
  FaultInjectingTransport(const FaultInjectingTransport&) = delete;
  FaultInjectingTransport& operator=(const FaultInjectingTransport&) = delete;
  ~FaultInjectingTransport() {
    // Flips still pending lie in regions still registered (deregistering a
    // region restores its own first), so this memory is alive.
    for (auto& f : pending_restore_) *f.at ^= std::byte{f.mask};
    if (inner_life_.expired()) return;  // the inner transport is gone, and its registrations with it
    for (auto& s : copies_)
      if (s.region.valid()) in_->deregister_memory(s.region);
  }

  Inner& inner() { return *in_; }
  std::int64_t rank() const { return in_->rank(); }
  std::span<const std::int64_t> world_ranks() const { return in_->world_ranks(); }
  std::string_view name() const { return "fault-injecting"; }

  RegionHandle register_memory(void* p, std::size_t bytes, MemoryKind kind) {
    const RegionHandle h = in_->register_memory(p, bytes, kind);
    regions_[h.id] = Region{static_cast<std::byte*>(p), bytes, kind};
    return h;
  }
  /// This decorator and its inner transport (where that one says).
  Lifetime lifetime() const {
    Lifetime l(token_);
    l.add(inner_life_);
    return l;
  }
  void deregister_memory(RegionHandle h) {
    // A sent-corruption whose send never completed (a failed refit) is undone
    // now: after deregistering, the owner may free the memory.
    if (auto it = regions_.find(h.id); it != regions_.end()) {
      const std::byte *lo = it->second.ptr, *hi = lo + it->second.bytes;
      std::erase_if(pending_restore_, [&](const Flip& f) {
        if (f.at < lo || f.at >= hi) return false;
        *f.at ^= std::byte{f.mask};
        return true;
      });
      regions_.erase(it);
    }
    in_->deregister_memory(h);
  }
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> blob, Deadline deadline) {
    return in_->all_gather(blob, deadline);
  }
  /// The inner transport's pairwise exchange, where it has one.
  std::vector<std::vector<std::byte>> exchange(std::span<const PeerBlob> out, Deadline deadline)
    requires ExchangingTransport<Inner>
  {
    return in_->exchange(out, deadline);
  }
  void prepare(std::span<const TransferOp> ops, Deadline deadline) { in_->prepare(ops, deadline); }

  request post(std::span<const TransferOp> ops) {
    post_due();
    request r{std::make_shared<State>()};
    State& st = *r.s;
    std::vector<TransferOp> keep, dups;
    keep.reserve(ops.size());
    for (const TransferOp& op : ops) {
      const bool send = op.kind == OpKind::send;
      MessageInfo m;
      m.from = send ? rank() : op.peer;
      m.to = send ? op.peer : rank();
      m.tag = op.tag;
      m.bytes = op.bytes;
      m.replay = posts_[{static_cast<int>(op.kind), op.peer, op.tag}]++;
      m.index = index_++;
      const auto rule = plan_->take(m, send);
      if (!rule) {
        keep.push_back(op);
        continue;
      }
      switch (rule->kind) {
        case FaultKind::drop:
          break;
        case FaultKind::delay:
          delayed_.push_back(Delayed{Clock::now() + rule->delay, op, r.s});
          ++st.delayed_left;
          break;
        case FaultKind::corrupt_sent: {
          const Flip f = flip_of(op, *rule);
          *f.at ^= std::byte{f.mask};
          st.restore.push_back(f);
          pending_restore_.push_back(f);
          keep.push_back(op);
          break;
        }
        case FaultKind::corrupt_arrived:
          st.on_arrival.push_back(flip_of(op, *rule));
          keep.push_back(op);
          break;
        case FaultKind::duplicate:
          keep.push_back(op);
          dups.push_back(copy_of(op));
          break;
      }
    }
    if (!keep.empty()) st.inner.push_back(in_->post(keep));
    if (!dups.empty()) background_.push_back(in_->post(dups));
    return r;
  }

  bool test(request& r) {
    post_due();
    if (!done(*r.s)) return false;
    arrived(*r.s);
    return true;
  }
  void wait(request& r, Deadline deadline) {
    check(r);
    while (true) {
      post_due();
      if (done(*r.s)) break;
      typename Inner::request* q = first_open(*r.s);
      if (!q) {
        // Completed since done() looked (another thread moved it), or only
        // held-back ops are left: then wait for their time.
        if (r.s->delayed_left > 0) wait_for_due(deadline, r.s.get());
        continue;
      }
      cut_at_due([&](Deadline d) { in_->wait(*q, d); }, deadline);
    }
    arrived(*r.s);
  }
  std::size_t wait_any(std::span<request* const> rs, Deadline deadline) {
    if (rs.empty()) fail("fault-injecting transport: wait_any on no requests (rank {})", rank());
    for (auto* r : rs) check(*r);
    while (true) {
      post_due();
      std::vector<typename Inner::request*> open;
      for (std::size_t i = 0; i < rs.size(); ++i) {
        if (done(*rs[i]->s)) {
          arrived(*rs[i]->s);
          return i;
        }
        if (auto* q = first_open(*rs[i]->s)) open.push_back(q);
      }
      if (open.empty()) {  // as in wait(): completed meanwhile, or every one held back
        if (std::all_of(rs.begin(), rs.end(), [](const request* q) { return q->s->delayed_left > 0; })) wait_for_due(deadline, nullptr);
        continue;
      }
      // One inner group completing may not finish its post(): look again.
      cut_at_due([&](Deadline d) { in_->wait_any(std::span<typename Inner::request* const>(open), d); }, deadline);
    }
  }
  void abort(std::string_view why) noexcept { in_->abort(why); }
  /// The batch boundary goes through (delayed sends posted later start at
  /// the inner transport's next call, as anything posted after a flush).
  void flush(Deadline deadline) { flush_batch(*in_, deadline); }

 private:
  struct Region {
    std::byte* ptr = nullptr;
    std::size_t bytes = 0;
    MemoryKind kind = MemoryKind::host;
  };
  struct OwnedCopy {
    std::unique_ptr<std::byte[]> bytes;
    RegionHandle region;
  };

  const Region& region_of(const TransferOp& op) const {
    auto it = regions_.find(op.region.id);
    if (it == regions_.end()) fail("fault-injecting transport: rank {}: an op uses region {}, not registered here", rank(), op.region.id);
    if (it->second.kind != MemoryKind::host) fail("fault-injecting transport: rank {}: faults on device memory are not supported", rank());
    return it->second;
  }
  Flip flip_of(const TransferOp& op, const FaultRule& rule) const {
    if (op.bytes == 0) fail("fault-injecting transport: rank {}: cannot corrupt an empty message (tag {:#x})", rank(), op.tag);
    const Region& g = region_of(op);
    const std::uint64_t at = rule.byte == UINT64_MAX ? op.bytes / 2 : rule.byte % op.bytes;
    return Flip{g.ptr + op.offset + at, rule.mask};
  }
  TransferOp copy_of(const TransferOp& op) {
    const Region& g = region_of(op);
    OwnedCopy c;
    c.bytes = std::make_unique<std::byte[]>(std::max<std::uint64_t>(op.bytes, 1));
    std::memcpy(c.bytes.get(), g.ptr + op.offset, op.bytes);
    c.region = in_->register_memory(c.bytes.get(), std::max<std::uint64_t>(op.bytes, 1), MemoryKind::host);
    TransferOp d = op;
    d.region = c.region;
    d.offset = 0;
    copies_.push_back(std::move(c));
    return d;
  }
  struct Delayed {
    Clock::time_point due;
    TransferOp op;
    std::shared_ptr<State> owner;
  };
  void check(const request& r) const {
    if (!r.s) fail("fault-injecting transport: wait on an empty request (rank {})", rank());
  }
  /// Posts every held-back op whose time has come.
  void post_due() {
    const auto now = Clock::now();
    for (std::size_t i = 0; i < delayed_.size();) {
      if (delayed_[i].due > now) {
        ++i;
        continue;
      }
      Delayed d = std::move(delayed_[i]);
      delayed_.erase(delayed_.begin() + static_cast<std::ptrdiff_t>(i));
      const TransferOp ops[1] = {d.op};
      d.owner->inner.push_back(in_->post(ops));
      --d.owner->delayed_left;
    }
  }
  std::optional<Clock::time_point> next_due() const {
    std::optional<Clock::time_point> t;
    for (const auto& d : delayed_)
      if (!t || d.due < *t) t = d.due;
    return t;
  }
  bool done(State& s) {
    if (s.delayed_left > 0) return false;
    for (auto& q : s.inner)
      if (!in_->test(q)) return false;
    return true;
  }
  typename Inner::request* first_open(State& s) {
    for (auto& q : s.inner)
      if (!in_->test(q)) return &q;
    return nullptr;
  }
  /// Runs an inner wait, cut short at the next held-back op's time (then
  /// returns so the caller posts it and waits again).
  template <class F>
  void cut_at_due(F&& inner_wait, Deadline deadline) {
    const auto due = next_due();
    const bool cut = due && *due < deadline;
    try {
      inner_wait(cut ? *due : deadline);
    } catch (const TransportError&) {
      if (cut && Clock::now() >= *due) return;  // our own cut, not a failure (a real one shows again next time)
      throw;
    }
  }
  void wait_for_due(Deadline deadline, const State* s) {
    const auto due = next_due();
    if (!due) fail("fault-injecting transport: rank {}: internal: nothing posted and nothing held back", rank());
    if (*due >= deadline) {
      std::this_thread::sleep_until(deadline);
      std::string what;
      for (const auto& d : delayed_)
        if (!s || d.owner.get() == s)
          what += fmt::format("{}send of {} bytes to rank {} (tag {:#x})", what.empty() ? "" : "; ", d.op.bytes, d.op.peer, d.op.tag);
      throw TransportError(fmt::format("fault-injecting transport: rank {} timed out waiting for {} (held back by a delay fault)", rank(),
                                       what.empty() ? std::string("delayed sends") : what));
    }
    std::this_thread::sleep_until(*due);
  }
  void arrived(State& r) {
    if (r.seen_done) return;
    r.seen_done = true;
    for (const Flip& f : r.on_arrival) *f.at ^= std::byte{f.mask};
    for (const Flip& f : r.restore) {
      // Only once: a flip already undone (its region deregistered) is not pending.
      auto it = std::find_if(pending_restore_.begin(), pending_restore_.end(), [&](const Flip& p) { return p.at == f.at; });
      if (it == pending_restore_.end()) continue;
      *f.at ^= std::byte{f.mask};
      pending_restore_.erase(it);
    }
  }

  Inner* in_;
  LifetimeToken token_;
  Lifetime inner_life_;  ///< the inner transport's (empty: it does not say)
  FaultPlan* plan_;
  std::map<std::uint32_t, Region> regions_;
  std::map<std::tuple<int, std::int64_t, std::uint64_t>, std::int64_t> posts_;
  std::int64_t index_ = 0;
  std::vector<Flip> pending_restore_;
  std::vector<OwnedCopy> copies_;
  std::vector<typename Inner::request> background_;  ///< duplicates, never waited for
  std::vector<Delayed> delayed_;                      ///< held-back sends, posted when due
};

}  // namespace reshard
