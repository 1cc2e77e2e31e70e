#pragma once
// A third transport, written from the contract in reshard/transport/transport.hpp
// alone (not from the other backends): in-process ranks (threads) matching
// sends and receives in plain std::mutex / std::condition_variable queues.
// It exists to show the contract is enough to implement a backend, and so
// that the conformance suite (transport_conformance.hpp) runs on something
// that is not one of ours.
//
// Each rank's endpoint is a QueueTransport over a shared QueueWorld. A send
// and a receive meet under the world's mutex; the bytes are copied there (the
// sender's range is the caller's until the send completes, so copying at the
// match is allowed). Tags are kept whole (64 bits); equal (sender, receiver,
// tag) keys match first-posted first.
//
// With `batches` on, it behaves like a batching transport (NCCL p2p, torch's
// batch_isend_irecv): post() only queues; flush() (or, for what is still
// queued, the next test/wait) makes the queued groups one batch on this
// rank's stream; only the batch at the head of a stream takes part in
// matching, and the next one starts when it completed (all its ops matched),
// and its requests complete together with it.
//
// With `plan_cap` > 0 as well, it splits a batch the way NCCL splits a group
// larger than its limits: into plans of at most plan_cap ops each, cut from
// this rank's own op list in posting order (knowing nothing of the peers'
// lists); the plans run one after another on the rank's stream. So when the
// two ends of a pair put a message into different plans (rank A's plan 0
// holds only receives from B, B's plan 0 only receives from A) nothing
// matches and both ranks wait until their deadline, which names the ops (and
// so the pair) still pending: the hang a real NCCL group would have, made a
// bounded error.
//
// Flaw plants one contract violation on purpose, so the tests can show each
// conformance case turns red on a transport that breaks its rule.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "reshard/transport/transport.hpp"
#include "transport_parts.hpp"

namespace queue_transport {

using namespace transport_parts;

/// Deliberate violations (none by default), one per conformance rule.
enum class Flaw {
  none,
  tag_32_bits,       ///< matches on the low 32 bits of the tag only
  lifo,              ///< equal keys match last-posted first
  silent_size,       ///< a size mismatch copies the smaller size and succeeds
  late_deadline,     ///< waits throw 3 s after their deadline
  blocking_test,     ///< test() waits up to 1 s for completion
  deaf_abort,        ///< abort() fails only this endpoint; peers are not told
  stale_replay,      ///< a key matched before is not copied again
  wrong_any,         ///< wait_any returns 0 whenever anything completed
  reversed_gather,   ///< all_gather returns the blobs in reverse world order
  post_is_batch,     ///< (with batches) every post() is a batch of its own, flush does nothing
  deaf_deregister,   ///< deregister_memory leaves the region's unmatched ops matchable (and written)
};

class QueueWorld {
 public:
  explicit QueueWorld(std::vector<std::int64_t> ranks, Flaw flaw = Flaw::none, bool batches = false, std::size_t plan_cap = 0)
      : ranks_(std::move(ranks)), flaw_(flaw), batches_(batches), plan_cap_(plan_cap), regions_(ranks_.size()), streams_(ranks_.size()) {}
  QueueWorld(const QueueWorld&) = delete;
  QueueWorld& operator=(const QueueWorld&) = delete;
  // A batch that never started (a failed or deadlocked case) still holds its
  // groups, which hold it: break that cycle.
  ~QueueWorld() {
    for (auto& stream : streams_)
      for (auto& b : stream) b->ops.clear();
  }
  const std::vector<std::int64_t>& ranks() const { return ranks_; }
  Flaw flaw() const { return flaw_; }
  /// Batches: the most plans one batch was split into so far.
  std::size_t most_plans() const { return most_plans_; }

 private:
  friend class QueueTransport;
  struct Batch;
  struct Group {
    std::size_t slot = 0;
    std::vector<TransferOp> ops;  // copied: post()'s span is the caller's
    std::size_t left = 0;
    std::string error;
    std::shared_ptr<Batch> batch;  // batches: null until flushed; the last plan holding its ops
    bool complete() const { return left == 0 && (!batch || batch->left == 0); }
  };
  struct Batch {  // one plan: a batch, or a part of one past plan_cap
    std::vector<std::pair<std::shared_ptr<Group>, std::size_t>> ops;  // (group, op) until it starts matching
    std::size_t left = 0;                                             // ops not yet matched
  };
  struct Half {  // one op waiting for its partner
    std::shared_ptr<Group> group;
    std::size_t op = 0;
    std::byte* at = nullptr;
    std::shared_ptr<Batch> plan;  // batches: the plan it was entered with
  };
  using Key = std::tuple<std::int64_t, std::int64_t, std::uint64_t>;  // sender, receiver, tag

  std::vector<std::int64_t> ranks_;
  Flaw flaw_;
  bool batches_ = false;
  std::size_t plan_cap_ = 0, most_plans_ = 0;
  std::mutex m_;
  std::condition_variable cv_;
  std::vector<std::vector<std::pair<std::byte*, std::size_t>>> regions_;  // per slot; {nullptr, 0} once deregistered
  std::map<Key, std::deque<Half>> sends_, recvs_;
  std::map<Key, int> matched_;  // for Flaw::stale_replay
  bool aborted_ = false;
  std::string reason_;
  std::vector<bool> deaf_aborted_;  // for Flaw::deaf_abort: per slot
  std::vector<std::deque<std::shared_ptr<Batch>>> streams_;  // batches: per slot, the head one matching
  // all_gather: generation-counted rendezvous.
  std::vector<std::vector<std::byte>> slots_, result_;
  std::size_t arrived_ = 0;
  std::uint64_t generation_ = 0;
};

class QueueTransport : public WaitIsWaitAny<QueueTransport> {
 public:
  using request = std::shared_ptr<QueueWorld::Group>;

  QueueTransport(QueueWorld& w, std::int64_t rank) : w_(&w) {
    auto it = std::find(w.ranks_.begin(), w.ranks_.end(), rank);
    if (it == w.ranks_.end()) throw TransportError(fmt::format("queue transport: rank {} is not in the world", rank));
    me_ = static_cast<std::size_t>(it - w.ranks_.begin());
    std::lock_guard lk(w_->m_);
    if (w_->deaf_aborted_.empty()) w_->deaf_aborted_.assign(w_->ranks_.size(), false);
  }

  std::int64_t rank() const { return w_->ranks_[me_]; }
  std::span<const std::int64_t> world_ranks() const { return w_->ranks_; }
  std::string_view name() const { return "queue"; }

  RegionHandle register_memory(void* p, std::size_t bytes, reshard::MemoryKind kind) {
    if (kind != reshard::MemoryKind::host) throw TransportError("queue transport: host memory only");
    std::lock_guard lk(w_->m_);
    auto& regs = w_->regions_[me_];
    regs.emplace_back(static_cast<std::byte*>(p), bytes);
    return RegionHandle{static_cast<std::uint32_t>(regs.size() - 1)};
  }
  void deregister_memory(RegionHandle h) {
    std::lock_guard lk(w_->m_);
    if (h.id < w_->regions_[me_].size()) w_->regions_[me_][h.id] = {nullptr, 0};
    // Copies happen at match time under m_: only this rank's unmatched ops can still touch the region.
    if (w_->flaw_ == Flaw::deaf_deregister) return;
    for (auto* queues : {&w_->sends_, &w_->recvs_})
      for (auto& [key, halves] : *queues)
        std::erase_if(halves, [&](const QueueWorld::Half& x) { return x.group->slot == me_ && x.group->ops[x.op].region.id == h.id; });
  }

  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> blob, Deadline deadline) {
    std::unique_lock lk(w_->m_);
    throw_if_aborted();
    auto& w = *w_;
    if (w.slots_.empty()) w.slots_.resize(w.ranks_.size());
    const std::uint64_t gen = w.generation_;
    w.slots_[me_].assign(blob.begin(), blob.end());
    if (++w.arrived_ == w.ranks_.size()) {
      w.result_ = w.slots_;
      if (w.flaw_ == Flaw::reversed_gather) std::reverse(w.result_.begin(), w.result_.end());
      w.arrived_ = 0;
      ++w.generation_;
      w.cv_.notify_all();
      return w.result_;
    }
    while (w.generation_ == gen) {
      throw_if_aborted();
      if (w.cv_.wait_until(lk, deadline) == std::cv_status::timeout && w.generation_ == gen)
        throw TransportError(fmt::format("queue transport: rank {} timed out in all_gather ({} of {} arrived)", rank(), w.arrived_, w.ranks_.size()));
    }
    return w.result_;
  }

  /// Two-sided matching: nothing to set up.
  void prepare(std::span<const TransferOp>, Deadline) {}

  request post(std::span<const TransferOp> ops) {
    auto g = std::make_shared<QueueWorld::Group>();
    g->slot = me_;
    g->ops.assign(ops.begin(), ops.end());
    g->left = ops.size();
    std::lock_guard lk(w_->m_);
    throw_if_aborted();
    auto& w = *w_;
    for (const TransferOp& op : g->ops) {
      const auto& regs = w.regions_[me_];
      if (op.region.id >= regs.size() || !regs[op.region.id].first || op.offset + op.bytes > regs[op.region.id].second)
        throw TransportError(fmt::format("queue transport: rank {}: {} is outside a registered region", rank(), describe(op)));
    }
    if (w.batches_) {
      queued_.push_back(g);
      if (w.flaw_ == Flaw::post_is_batch) start_queued();
      return g;
    }
    enter(g);
    w.cv_.notify_all();
    return g;
  }

  /// Batches: the groups posted since the last flush become one batch.
  void flush(Deadline) {
    std::lock_guard lk(w_->m_);
    throw_if_aborted();
    if (w_->flaw_ != Flaw::post_is_batch) start_queued();
  }

  bool test(request& r) {
    std::unique_lock lk(w_->m_);
    start_queued();  // what was posted after the last flush
    if (w_->flaw_ == Flaw::blocking_test) w_->cv_.wait_for(lk, std::chrono::seconds(1), [&] { return r->complete(); });
    if (r->complete()) {
      if (!r->error.empty()) throw TransportError(r->error);
      return true;
    }
    throw_if_aborted();
    return false;
  }

  std::size_t wait_any(std::span<request* const> rs, Deadline deadline) {
    if (rs.empty()) throw TransportError(fmt::format("queue transport: rank {}: wait_any on no requests", rank()));
    if (w_->flaw_ == Flaw::late_deadline) deadline += std::chrono::seconds(3);
    std::unique_lock lk(w_->m_);
    start_queued();
    while (true) {
      for (std::size_t i = 0; i < rs.size(); ++i) {
        const auto& g = **rs[i];
        if (!g.complete()) continue;
        if (!g.error.empty()) throw TransportError(g.error);
        return w_->flaw_ == Flaw::wrong_any ? 0 : i;
      }
      throw_if_aborted();
      if (w_->cv_.wait_until(lk, deadline) == std::cv_status::timeout) {
        bool done = false;
        for (auto* r : rs) done |= (*r)->complete();
        if (done) continue;
        std::string pending;
        for (auto* r : rs)
          for (const auto& op : (*r)->ops) pending += (pending.empty() ? "" : "; ") + describe(op);
        throw TransportError(fmt::format("queue transport: rank {} timed out waiting for {}", rank(), pending));
      }
    }
  }

  void abort(std::string_view why) noexcept {
    try {
      std::lock_guard lk(w_->m_);
      const std::string reason = fmt::format("queue transport: rank {} gave up: {}", rank(), why);
      if (w_->flaw_ == Flaw::deaf_abort) {
        w_->deaf_aborted_[me_] = true;
        if (w_->reason_.empty()) w_->reason_ = reason;
      } else if (!w_->aborted_) {
        w_->aborted_ = true;
        w_->reason_ = reason;
      }
    } catch (...) {
      std::lock_guard lk(w_->m_);
      w_->aborted_ = true;
    }
    w_->cv_.notify_all();
  }

 private:
  void throw_if_aborted() const {
    if (w_->aborted_ || (w_->flaw_ == Flaw::deaf_abort && w_->deaf_aborted_[me_])) throw TransportError(w_->reason_);
  }
  // m_ held. A group's ops take part in matching.
  void enter(const std::shared_ptr<QueueWorld::Group>& g) {
    for (std::size_t i = 0; i < g->ops.size(); ++i) enter(g, i, nullptr);
  }
  // m_ held. One op of a group takes part in matching.
  void enter(const std::shared_ptr<QueueWorld::Group>& g, std::size_t i, const std::shared_ptr<QueueWorld::Batch>& plan) {
    auto& w = *w_;
    {
      const TransferOp& op = g->ops[i];
      const auto& regs = w.regions_[g->slot];
      const std::int64_t self = w.ranks_[g->slot];
      const std::uint64_t tag = w.flaw_ == Flaw::tag_32_bits ? (op.tag & 0xffffffffu) : op.tag;
      const bool send = op.kind == OpKind::send;
      const QueueWorld::Key key = send ? QueueWorld::Key{self, op.peer, tag} : QueueWorld::Key{op.peer, self, tag};
      QueueWorld::Half mine{g, i, regs[op.region.id].first + op.offset, plan};
      auto& others = send ? w.recvs_ : w.sends_;
      auto it = others.find(key);
      if (it == others.end() || it->second.empty()) {
        (send ? w.sends_ : w.recvs_)[key].push_back(mine);
        return;
      }
      QueueWorld::Half theirs;
      if (w.flaw_ == Flaw::lifo) {
        theirs = it->second.back();
        it->second.pop_back();
      } else {
        theirs = it->second.front();
        it->second.pop_front();
      }
      match(send ? mine : theirs, send ? theirs : mine, key);
    }
  }
  // m_ held. Batches: the queued groups become one batch on this rank's
  // stream, split into plans of at most plan_cap ops (in posting order).
  void start_queued() {
    if (queued_.empty()) return;
    std::vector<std::shared_ptr<QueueWorld::Batch>> plans(1, std::make_shared<QueueWorld::Batch>());
    for (auto& g : queued_) {
      for (std::size_t i = 0; i < g->ops.size(); ++i) {
        if (w_->plan_cap_ > 0 && plans.back()->ops.size() == w_->plan_cap_) plans.push_back(std::make_shared<QueueWorld::Batch>());
        plans.back()->ops.emplace_back(g, i);
        ++plans.back()->left;
      }
      g->batch = plans.back();
    }
    w_->most_plans_ = std::max(w_->most_plans_, plans.size());
    queued_.clear();
    auto& stream = w_->streams_[me_];
    const bool idle = stream.empty();
    for (auto& b : plans) stream.push_back(b);
    if (idle) advance(me_);
    w_->cv_.notify_all();
  }
  // m_ held. Starts the batches at the head of a slot's stream, dropping completed ones.
  void advance(std::size_t slot) {
    auto& stream = w_->streams_[slot];
    while (!stream.empty()) {
      auto head = stream.front();
      if (!head->ops.empty()) {
        auto ops = std::move(head->ops);
        head->ops.clear();
        for (auto& [g, i] : ops) enter(g, i, head);  // its last match may complete it: match() then advances
      }
      if (head->left != 0 || stream.empty() || stream.front() != head) return;
      stream.pop_front();  // completed at once (0 ops)
    }
  }
  // m_ held.
  void match(const QueueWorld::Half& s, const QueueWorld::Half& r, const QueueWorld::Key& key) {
    const TransferOp& sop = s.group->ops[s.op];
    const TransferOp& rop = r.group->ops[r.op];
    if (sop.bytes != rop.bytes && w_->flaw_ != Flaw::silent_size) {
      const std::string e = fmt::format("queue transport: size mismatch: rank {} sends {} bytes to rank {} (tag {:#x}), which receives {}",
                                        std::get<0>(key), sop.bytes, std::get<1>(key), sop.tag, rop.bytes);
      s.group->error = r.group->error = e;
    } else if (!(w_->flaw_ == Flaw::stale_replay && w_->matched_[key]++ > 0)) {
      std::memcpy(r.at, s.at, std::min(sop.bytes, rop.bytes));
    }
    --s.group->left;
    --r.group->left;
    for (const auto* h : {&s, &r}) {
      const auto& b = h->plan;
      if (b && --b->left == 0 && !w_->streams_[h->group->slot].empty() && w_->streams_[h->group->slot].front() == b) {
        w_->streams_[h->group->slot].pop_front();
        advance(h->group->slot);
      }
    }
  }

  QueueWorld* w_;
  std::size_t me_ = 0;
  std::vector<request> queued_;  // batches: posted, not yet flushed
};

static_assert(reshard::check_transport<QueueTransport>());

}  // namespace queue_transport
