#pragma once
// Runs a staged schedule (hierarchical.hpp's StagedSchedule, CONTRACT.md §2
// "Staged schedules"): one Executor per stage, each on its own channel (so
// the stages' tags never meet), run one after another on every rank.
//
// Why no barrier between stages is needed: a copy of stage s that reads the
// destination layout (a fan-out copy, src_layout "dst") reads what its
// sending rank received or copied in earlier stages (the staged oracle
// checks that of every staged plan), and a rank starts stage s only after
// its own stages before s completed. The ranks it feeds simply wait on
// their receives, as in any stage.
//
// A fan-out copy's source buffer is a destination buffer of the sending
// rank: each stage's Executor sees the source buffers followed by the
// destination buffers as its source side (ids shifted by the number of
// source buffers), so the same compile, staging and zero-copy rules apply.
//
// Staging: ExecutorOptions::staging_budget bounds the staging of all stages
// together (split among the stages this rank talks in, each given at least
// what its peer pairs need), and the run's staging_bytes is what all stages
// allocated.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "../plan/hierarchical.hpp"
#include "executor.hpp"

namespace reshard {

template <class T>
class StagedExecutor {
 public:
  /// Compiles every stage of `s` (collective, in stage order, as
  /// Executor::setup). Stage k runs on channel opt.channel + k. A non-empty
  /// `local_error` (a bad buffer found by the caller), like a stage list
  /// that does not fit the copies, fails setup on every rank, none hangs.
  void setup(const StagedSchedule& s, std::vector<const BoundBuffer*> src, std::vector<const BoundBuffer*> dst,
             T& transport, ExecutorOptions opt = {}, std::string local_error = {}) {
    stages_.clear();
    failed_stage_ = -1;
    const std::size_t n = s.schedule.copies.size();
    std::int32_t stages = std::max<std::int32_t>(s.stages, 1);
    try {
      if (!s.stage.empty() && s.stage.size() != n)
        fail("staged executor: {} stage entries for {} copies", s.stage.size(), n);
      if (!s.from_dst.empty() && s.from_dst.size() != n)
        fail("staged executor: {} src_layout entries for {} copies", s.from_dst.size(), n);
      for (std::size_t i = 0; i < n; ++i) {
        const std::int32_t k = s.stage_of(i);
        if (k < 0) fail("staged executor: copy {} has stage {}", i, k);
        stages = std::max(stages, k + 1);
      }
      if (static_cast<std::int64_t>(opt.channel) + stages > 0xFFFF)
        fail("staged executor: channels {}..{} do not fit in 16 bits", opt.channel, static_cast<std::int64_t>(opt.channel) + stages - 1);
    } catch (const std::exception& e) {
      if (local_error.empty()) local_error = e.what();
    }
    if (!local_error.empty()) {
      // One collective setup carries the error to every rank (the others
      // meet it in their first stage's setup) and throws here.
      Executor<T> ex;
      ex.setup(Schedule{}, {}, {}, transport, opt, local_error);
      fail("{}", local_error);  // not reached: setup threw
    }
    const auto nsrc = static_cast<std::int32_t>(src.size());
    // Source side of every stage: the source buffers, then the destination buffers.
    std::vector<const BoundBuffer*> sources = src;
    sources.insert(sources.end(), dst.begin(), dst.end());
    std::vector<Schedule> per(static_cast<std::size_t>(stages));
    for (auto& p : per) {
      p.src_buffers = s.schedule.src_buffers;
      p.src_buffers.insert(p.src_buffers.end(), s.schedule.dst_buffers.begin(), s.schedule.dst_buffers.end());
      p.dst_buffers = s.schedule.dst_buffers;
      p.only_rank = s.schedule.only_rank;
    }
    for (std::size_t i = 0; i < n; ++i) {
      Copy c = s.schedule.copies[i];
      if (s.reads_dst(i)) c.src_buffer += nsrc;
      per[static_cast<std::size_t>(s.stage_of(i))].copies.push_back(c);
    }
    // One staging budget for the staged refit: every stage's Executor keeps
    // its staging as long as this object lives, so the stages' allocations
    // add up. The budget is split among the stages in which this rank
    // exchanges bytes with another rank (stage_staging_budgets, the rule the
    // simulator uses too); each rank splits its own, and both ends of a peer
    // pair still agree on the pair's share through the stage's setup.
    const std::int64_t me = transport.rank();
    std::vector<std::int64_t> pairs(static_cast<std::size_t>(stages), 0);
    for (std::int32_t k = 0; k < stages; ++k) {
      std::set<std::pair<std::int64_t, bool>> peers;  // (peer, this rank sends)
      for (const Copy& c : per[static_cast<std::size_t>(k)].copies)
        if (!c.is_local() && (c.src_rank == me || c.dst_rank == me)) peers.emplace(c.src_rank == me ? c.dst_rank : c.src_rank, c.src_rank == me);
      pairs[static_cast<std::size_t>(k)] = static_cast<std::int64_t>(peers.size());
    }
    const auto budgets = stage_staging_budgets(opt.staging_budget, pairs, opt.pipeline);
    for (std::int32_t k = 0; k < stages; ++k) {
      auto ex = std::make_unique<Executor<T>>();
      ex->set_tensor_names(tensor_names_);
      ExecutorOptions o = opt;
      o.channel = static_cast<std::uint16_t>(opt.channel + k);
      o.staging_budget = budgets[static_cast<std::size_t>(k)];
      ex->setup(per[static_cast<std::size_t>(k)], sources, dst, transport, o);
      stages_.push_back(std::move(ex));
    }
  }

  /// Runs every stage once (all ranks pass the same version); the stats are
  /// summed over the stages (seconds: the whole run).
  /// With device buffers, stage 0 waits for the caller's events and every
  /// stage but the last returns after its copies (the next stage may read
  /// what they wrote); the last follows `order.wait`.
  ExecutorStats run(std::uint64_t version, const StreamOrder& order = {}) {
    if (stages_.empty()) fail("staged executor: run() before setup()");
    ExecutorStats total;
    if (failed_stage_ >= 0)
      fail("staged executor: stage {} of an earlier run failed; the peers' state is unknown, set up again", failed_stage_);
    const auto t0 = Clock::now();
    for (auto& ex : stages_) {
      ExecutorStats st;
      try {
        StreamOrder o = order;
        if (&ex != stages_.data()) o.sources_final = o.destination_free = nullptr;
        if (&ex != &stages_.back()) o.wait = true;
        st = ex->run(version, o);
      } catch (...) {
        failed_stage_ = static_cast<int>(&ex - stages_.data());
        throw;
      }
      total.add_counts(st);
      total.done = st.done;
      total.staging_bytes += st.staging_bytes;  // every stage's staging is allocated at once
      total.peak_staging_bytes = std::max(total.peak_staging_bytes, st.peak_staging_bytes);  // the stages run one after another
    }
    total.version = version;
    total.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    return total;
  }

  /// Names for error messages (destination tensor ids); set before setup.
  void set_tensor_names(std::vector<std::string> names) { tensor_names_ = std::move(names); }
  int stages() const { return static_cast<int>(stages_.size()); }
  /// After a failed run: per peer, what did not arrive checked on this rank,
  /// in the failed stage and in every stage after it (never run).
  std::vector<MissingPieces> missing() const {
    if (failed_stage_ < 0) return {};
    std::map<std::int64_t, std::pair<MissingPieces, std::set<std::string>>> by_peer;
    for (std::size_t k = static_cast<std::size_t>(failed_stage_); k < stages_.size(); ++k) {
      const auto& ex = *stages_[k];
      for (auto& m : static_cast<int>(k) == failed_stage_ ? ex.missing() : ex.incoming()) {
        auto& [mp, names] = by_peer[m.peer];
        mp.peer = m.peer;
        mp.messages += m.messages;
        mp.bytes += m.bytes;
        names.insert(m.tensors.begin(), m.tensors.end());
      }
    }
    std::vector<MissingPieces> out;
    for (auto& [peer, e] : by_peer) {
      e.first.tensors.assign(e.second.begin(), e.second.end());
      out.push_back(std::move(e.first));
    }
    return out;
  }
  /// What the last run did to each destination buffer (BufferWrite): the
  /// stages write disjoint pieces; those after a failed stage never ran.
  BufferWrites buffer_writes() const {
    BufferWrites out;
    for (std::size_t k = 0; k < stages_.size(); ++k) {
      const bool ran = failed_stage_ < 0 || static_cast<int>(k) <= failed_stage_;
      merge_into(out, ran ? stages_[k]->buffer_writes() : not_started(stages_[k]->buffer_writes()), merge_disjoint);
    }
    return out;
  }
  bool broken() const { return failed_stage_ >= 0; }
  /// Compiles of every stage (each stage compiles once per setup).
  std::int64_t compiles() const { return sum(&Executor<T>::compiles); }
  const Executor<T>& stage(int k) const { return *stages_.at(static_cast<std::size_t>(k)); }
  /// Per replay, summed over the stages.
  std::int64_t planned_bytes_sent() const { return sum(&Executor<T>::planned_bytes_sent); }
  std::int64_t planned_bytes_received() const { return sum(&Executor<T>::planned_bytes_received); }
  std::int64_t planned_local_bytes() const { return sum(&Executor<T>::planned_local_bytes); }

 private:
  std::int64_t sum(std::int64_t (Executor<T>::*f)() const) const {
    std::int64_t s = 0;
    for (const auto& ex : stages_) s += ((*ex).*f)();
    return s;
  }
  std::vector<std::unique_ptr<Executor<T>>> stages_;
  std::vector<std::string> tensor_names_;
  int failed_stage_ = -1;  ///< the stage whose run failed (-1: none)
};

}  // namespace reshard
