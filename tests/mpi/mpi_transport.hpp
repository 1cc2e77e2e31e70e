#pragma once
// A fourth transport, written from reshard/transport/transport.hpp's contract alone:
// MPI_Isend / MPI_Irecv on a communicator (tests only; run under mpirun).
//
//  * Tags: MPI tags are narrower than the executor's 64 bits (Open MPI's
//    MPI_TAG_UB is 2^31 - 1, the standard only promises 32767), so prepare()
//    maps each prepared (peer, direction, tag) to a dense wire tag: the
//    index of the tag among this prepare's distinct tags with that peer and
//    direction, after those of earlier prepares. Both ends prepare the same
//    keys in the same collective calls, so they number them alike. Wire tag
//    0 is the abort channel. An op that was not prepared is refused.
//  * Sizes: prepare() all-gathers every rank's op table and checks each op
//    against its peer's (same key, same occurrence, same size), so a
//    mismatch fails on both sides (MPI itself would tell only the receiver).
//  * Equal keys: MPI's non-overtaking rule (same source, tag, communicator)
//    gives posting order.
//  * Waits poll MPI_Testall and the abort channel, sleeping briefly, until
//    the deadline.
//  * abort(): a message on wire tag 0 to every rank; every endpoint keeps a
//    receive of it posted and polls it in every call.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "reshard/transport/transport.hpp"
#include "../transport_parts.hpp"

namespace mpi_transport {

using namespace transport_parts;

class MpiTransport : public WaitIsWaitAny<MpiTransport> {
 public:
  struct Group {
    std::vector<TransferOp> ops;  // copied: post()'s span is the caller's
    std::vector<MPI_Request> reqs;
    bool done = false;
    std::string error;
  };
  using request = std::shared_ptr<Group>;

  explicit MpiTransport(MPI_Comm comm) {
    MPI_Comm_dup(comm, &comm_);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_dup(comm_, &exchange_comm_);  // pairwise setup blobs: apart from data tags
    int me = 0, n = 0;
    MPI_Comm_rank(comm_, &me);
    MPI_Comm_size(comm_, &n);
    me_ = me;
    for (int i = 0; i < n; ++i) ranks_.push_back(i);
    MPI_Irecv(abort_buf_, sizeof abort_buf_, MPI_CHAR, MPI_ANY_SOURCE, 0, comm_, &abort_req_);
  }
  MpiTransport(const MpiTransport&) = delete;
  MpiTransport& operator=(const MpiTransport&) = delete;
  ~MpiTransport() {
    // Receives still posted (a peer that never sent, the abort channel) are
    // cancelled; a communicator with pending requests must not be freed.
    for (auto& g : live_)
      for (std::size_t i = 0; i < g->reqs.size(); ++i)
        if (g->reqs[i] != MPI_REQUEST_NULL) {
          if (g->ops[i].kind == OpKind::recv) MPI_Cancel(&g->reqs[i]);
          MPI_Request_free(&g->reqs[i]);
        }
    if (abort_req_ != MPI_REQUEST_NULL) {
      MPI_Cancel(&abort_req_);
      MPI_Wait(&abort_req_, MPI_STATUS_IGNORE);
    }
    for (auto& r : abort_sends_) MPI_Request_free(&r);
    MPI_Comm_free(&exchange_comm_);
    MPI_Comm_free(&comm_);
  }

  std::int64_t rank() const { return me_; }
  std::span<const std::int64_t> world_ranks() const { return ranks_; }
  std::string_view name() const { return "mpi"; }

  RegionHandle register_memory(void* p, std::size_t bytes, reshard::MemoryKind kind) {
    if (kind != reshard::MemoryKind::host) throw TransportError("mpi transport: host memory only");
    regions_.emplace_back(static_cast<std::byte*>(p), bytes);
    return RegionHandle{static_cast<std::uint32_t>(regions_.size() - 1)};
  }
  /// Receives still posted into the region (a failed run drops its requests
  /// unwaited) are cancelled and completed first, so MPI never writes it
  /// afterwards; their group fails. Sends are left to finish (MPI-4
  /// deprecates cancelling them).
  void deregister_memory(RegionHandle h) {
    if (h.id >= regions_.size()) return;
    for (auto& g : live_)
      for (std::size_t i = 0; i < g->reqs.size(); ++i)
        if (g->reqs[i] != MPI_REQUEST_NULL && g->ops[i].kind == OpKind::recv && g->ops[i].region.id == h.id) {
          MPI_Cancel(&g->reqs[i]);
          MPI_Wait(&g->reqs[i], MPI_STATUS_IGNORE);  // a cancelled receive, or one already matched, completes locally
          if (g->error.empty())
            g->error = fmt::format("mpi transport: rank {}: region {} was deregistered while its {} was pending", me_, h.id, describe(g->ops[i]));
        }
    regions_[h.id] = {nullptr, 0};
  }

  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> blob, Deadline deadline) {
    check_aborted();
    const auto n = ranks_.size();
    std::uint64_t mine = blob.size();
    std::vector<std::uint64_t> sizes(n);
    MPI_Request r;
    MPI_Iallgather(&mine, 1, MPI_UINT64_T, sizes.data(), 1, MPI_UINT64_T, comm_, &r);
    settle(r, deadline, "the all_gather of sizes");
    std::vector<int> counts(n), displs(n);
    std::size_t total = 0;
    for (std::size_t i = 0; i < n; ++i) {
      counts[i] = static_cast<int>(sizes[i]);
      displs[i] = static_cast<int>(total);
      total += sizes[i];
    }
    std::vector<std::byte> all(std::max<std::size_t>(total, 1));
    MPI_Iallgatherv(blob.data(), static_cast<int>(blob.size()), MPI_BYTE, all.data(), counts.data(), displs.data(), MPI_BYTE, comm_, &r);
    settle(r, deadline, "the all_gather of blobs");
    std::vector<std::vector<std::byte>> out(n);
    for (std::size_t i = 0; i < n; ++i) out[i].assign(all.begin() + displs[i], all.begin() + displs[i] + counts[i]);
    return out;
  }

  /// Pairwise exchange: one message per listed peer on a communicator of
  /// its own (MPI keeps messages of one sender and tag in order, so the k-th
  /// calls pair up), received by size after a probe.
  std::vector<std::vector<std::byte>> exchange(std::span<const reshard::PeerBlob> out, Deadline deadline) {
    check_aborted();
    std::vector<MPI_Request> sends(out.size(), MPI_REQUEST_NULL);
    for (std::size_t i = 0; i < out.size(); ++i)
      MPI_Isend(out[i].bytes.data(), static_cast<int>(out[i].bytes.size()), MPI_BYTE, static_cast<int>(out[i].peer), 1, exchange_comm_, &sends[i]);
    std::vector<std::vector<std::byte>> got(out.size());
    for (std::size_t i = 0; i < out.size(); ++i) {
      MPI_Status st;
      for (int flag = 0; !flag;) {
        MPI_Iprobe(static_cast<int>(out[i].peer), 1, exchange_comm_, &flag, &st);
        if (flag) break;
        check_aborted();
        if (Clock::now() >= deadline)
          throw TransportError(fmt::format("mpi transport: rank {} timed out in a pairwise exchange: nothing from rank {}", me_, out[i].peer));
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      int count = 0;
      MPI_Get_count(&st, MPI_BYTE, &count);
      got[i].resize(static_cast<std::size_t>(count));
      MPI_Recv(got[i].data(), count, MPI_BYTE, static_cast<int>(out[i].peer), 1, exchange_comm_, MPI_STATUS_IGNORE);
    }
    for (auto& r : sends) settle(r, deadline, "the sends of a pairwise exchange");
    return got;
  }

  void prepare(std::span<const TransferOp> ops, Deadline deadline) {
    // Op table: (kind, peer, tag, bytes) per op, to every rank.
    std::vector<std::byte> table(ops.size() * 32);
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const std::uint64_t row[4] = {static_cast<std::uint64_t>(ops[i].kind), static_cast<std::uint64_t>(ops[i].peer), ops[i].tag, ops[i].bytes};
      std::memcpy(table.data() + 32 * i, row, 32);
    }
    const auto tables = all_gather(table, deadline);
    // (sender, receiver, tag) -> sizes in posting order, as each side lists them.
    std::map<std::tuple<std::int64_t, std::int64_t, std::uint64_t>, std::vector<std::uint64_t>> sent, received;
    for (std::size_t r = 0; r < tables.size(); ++r)
      for (std::size_t i = 0; i + 32 <= tables[r].size(); i += 32) {
        std::uint64_t row[4];
        std::memcpy(row, tables[r].data() + i, 32);
        const auto peer = static_cast<std::int64_t>(row[1]), self = static_cast<std::int64_t>(r);
        if (row[0] == static_cast<std::uint64_t>(OpKind::send))
          sent[{self, peer, row[2]}].push_back(row[3]);
        else
          received[{peer, self, row[2]}].push_back(row[3]);
      }
    // Every rank checks the ops that touch it, so both ends of a bad pair fail.
    for (const auto& op : ops) {
      const bool send = op.kind == OpKind::send;
      const auto key = send ? std::make_tuple(me_, op.peer, op.tag) : std::make_tuple(op.peer, me_, op.tag);
      const auto& a = sent[key];
      const auto& b = received[key];
      if (a != b)
        throw TransportError(fmt::format("mpi transport: rank {}: rank {} prepared {} send(s) of tag {:#x} to rank {} ({} bytes) and rank {} "
                                         "{} receive(s) ({} bytes)",
                                         me_, std::get<0>(key), a.size(), op.tag, std::get<1>(key), fmt::join(a, ", "), std::get<1>(key),
                                         b.size(), fmt::join(b, ", ")));
    }
    // Wire tags: per (peer, direction), this prepare's distinct tags in order, after the earlier ones.
    std::map<std::pair<std::int64_t, int>, std::vector<std::uint64_t>> fresh;
    for (const auto& op : ops) {
      const auto k = std::make_tuple(op.peer, static_cast<int>(op.kind), op.tag);
      if (!wire_.count(k)) fresh[{op.peer, static_cast<int>(op.kind)}].push_back(op.tag);
    }
    int ub = 0, flag = 0;
    int* attr = nullptr;
    MPI_Comm_get_attr(comm_, MPI_TAG_UB, &attr, &flag);
    ub = flag ? *attr : 32767;
    for (auto& [pd, tags] : fresh) {
      std::sort(tags.begin(), tags.end());
      tags.erase(std::unique(tags.begin(), tags.end()), tags.end());
      int& next = next_wire_[pd];
      for (auto t : tags) {
        if (next + 1 > ub) throw TransportError(fmt::format("mpi transport: rank {}: more distinct tags with rank {} than MPI_TAG_UB {}", me_, pd.first, ub));
        wire_[{pd.first, pd.second, t}] = ++next;  // 0 is the abort channel
      }
    }
  }

  request post(std::span<const TransferOp> ops) {
    check_aborted();
    auto g = std::make_shared<Group>();
    g->ops.assign(ops.begin(), ops.end());
    for (const auto& op : g->ops) {
      auto w = wire_.find({op.peer, static_cast<int>(op.kind), op.tag});
      if (w == wire_.end()) throw TransportError(fmt::format("mpi transport: rank {}: {} was not prepared", me_, describe(op)));
      if (op.region.id >= regions_.size() || !regions_[op.region.id].first || op.offset + op.bytes > regions_[op.region.id].second)
        throw TransportError(fmt::format("mpi transport: rank {}: {} is outside a registered region", me_, describe(op)));
    }
    for (const auto& op : g->ops) {
      std::byte* p = regions_[op.region.id].first + op.offset;
      const int wire = wire_[{op.peer, static_cast<int>(op.kind), op.tag}];
      MPI_Request r;
      const int rc = op.kind == OpKind::send ? MPI_Isend(p, static_cast<int>(op.bytes), MPI_BYTE, static_cast<int>(op.peer), wire, comm_, &r)
                                             : MPI_Irecv(p, static_cast<int>(op.bytes), MPI_BYTE, static_cast<int>(op.peer), wire, comm_, &r);
      if (rc != MPI_SUCCESS) throw TransportError(fmt::format("mpi transport: rank {}: starting {} failed", me_, describe(op)));
      g->reqs.push_back(r);
    }
    std::erase_if(live_, [](const request& q) { return q->done; });
    live_.push_back(g);
    return g;
  }

  bool test(request& r) {
    if (progress(*r)) return true;
    check_aborted();
    return false;
  }
  std::size_t wait_any(std::span<request* const> rs, Deadline deadline) {
    if (rs.empty()) throw TransportError(fmt::format("mpi transport: rank {}: wait_any on no requests", me_));
    while (true) {
      for (std::size_t i = 0; i < rs.size(); ++i)
        if (progress(**rs[i])) return i;
      check_aborted();
      if (Clock::now() >= deadline) {
        std::string pending;
        for (auto* r : rs)
          for (std::size_t i = 0; i < (*r)->ops.size(); ++i)
            if ((*r)->reqs[i] != MPI_REQUEST_NULL) pending += (pending.empty() ? "" : "; ") + describe((*r)->ops[i]);
        throw TransportError(fmt::format("mpi transport: rank {} timed out waiting for {}", me_, pending));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  void abort(std::string_view why) noexcept {
    if (aborted_) return;
    aborted_ = true;
    try {
      reason_ = fmt::format("mpi transport: rank {} gave up: {}", me_, why);
      const std::string text = reason_.substr(0, sizeof abort_buf_ - 1);
      abort_text_ = text;
      for (auto peer : ranks_) {
        if (peer == me_) continue;
        MPI_Request r;
        MPI_Isend(abort_text_.data(), static_cast<int>(abort_text_.size()), MPI_CHAR, static_cast<int>(peer), 0, comm_, &r);
        abort_sends_.push_back(r);
      }
    } catch (...) {
    }
  }

 private:
  /// Completes what MPI finished; true once the whole group is done (throws if it failed).
  bool progress(Group& g) {
    if (!g.done) {
      std::vector<MPI_Status> st(g.reqs.size());
      int flag = 0;
      const int rc = MPI_Testall(static_cast<int>(g.reqs.size()), g.reqs.data(), &flag, st.data());
      if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) g.error = fmt::format("mpi transport: rank {}: MPI_Testall failed ({})", me_, rc);
      if (flag || rc == MPI_ERR_IN_STATUS) {
        for (std::size_t i = 0; i < g.ops.size(); ++i) {
          int count = 0;
          MPI_Get_count(&st[i], MPI_BYTE, &count);
          if (g.ops[i].kind == OpKind::recv && (st[i].MPI_ERROR != MPI_SUCCESS || static_cast<std::uint64_t>(count) != g.ops[i].bytes) &&
              g.error.empty())
            g.error = fmt::format("mpi transport: rank {}: {} got {} bytes", me_, describe(g.ops[i]), count);
        }
        if (flag) g.done = true;
      }
      if (!g.error.empty()) g.done = true;
    }
    if (g.done && !g.error.empty()) throw TransportError(g.error);
    return g.done;
  }
  void check_aborted() {
    if (!aborted_ && abort_req_ != MPI_REQUEST_NULL) {
      int flag = 0;
      MPI_Status st;
      MPI_Test(&abort_req_, &flag, &st);
      if (flag) {
        int count = 0;
        MPI_Get_count(&st, MPI_CHAR, &count);
        aborted_ = true;
        reason_ = fmt::format("mpi transport: rank {}: {}", me_, std::string(abort_buf_, static_cast<std::size_t>(count)));
      }
    }
    if (aborted_) throw TransportError(reason_);
  }
  void settle(MPI_Request& r, Deadline deadline, const char* what) {
    while (true) {
      int flag = 0;
      MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
      if (flag) return;
      check_aborted();
      if (Clock::now() >= deadline) throw TransportError(fmt::format("mpi transport: rank {} timed out in {}", me_, what));
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL, exchange_comm_ = MPI_COMM_NULL;
  std::int64_t me_ = 0;
  std::vector<std::int64_t> ranks_;
  std::vector<std::pair<std::byte*, std::size_t>> regions_;
  std::map<std::tuple<std::int64_t, int, std::uint64_t>, int> wire_;  // (peer, kind, tag) -> wire tag
  std::map<std::pair<std::int64_t, int>, int> next_wire_;
  std::vector<request> live_;  // posted groups, so the destructor can cancel what never completed
  bool aborted_ = false;
  std::string reason_, abort_text_;
  char abort_buf_[1024] = {};
  MPI_Request abort_req_ = MPI_REQUEST_NULL;
  std::vector<MPI_Request> abort_sends_;
};

static_assert(reshard::check_transport<MpiTransport>());

}  // namespace mpi_transport
