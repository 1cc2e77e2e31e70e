#pragma once
// Where the planner puts copies as it emits them: a vector for a full plan,
// or a CopyLog (each copy's route, offsets and only its `rank` dims) for a
// one-rank plan, the one process's whole job, sorted afterwards.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "../base/error.hpp"
#include "../base/prefault.hpp"
#include "../schedule/schedule.hpp"

namespace reshard::detail {

/// A one-rank plan's copies as emitted, before sorting: each copy's route,
/// offsets and only its `rank` dims, as 64-bit words in fixed blocks. A copy
/// takes 56 + 24 * rank bytes here, the least a copy needs, and growing
/// moves nothing: a one-rank plan is one process's whole job, so the pages it
/// touches for the first time are most of its cost.
class CopyLog {
 public:
  using Handle = std::uint32_t;  ///< word position of a copy
  static constexpr std::size_t kBlockWords = 8192;  // 64 KiB
  static constexpr std::size_t kHeaderWords = 7;
  static constexpr std::size_t kMaxWords = kHeaderWords + 3 * static_cast<std::size_t>(kMaxBoxRank);

  std::size_t size() const { return count_; }
  bool empty() const { return count_ == 0; }

  void push(const Copy& c) {
    const auto r = static_cast<std::size_t>(c.rank);
    const std::size_t words = kHeaderWords + 3 * r;
    if (blocks_.empty() || used_ + words > kBlockWords) {
      if (blocks_.size() >= (std::size_t{1} << 32) / kBlockWords)
        fail("plan: one rank's copies exceed {} words of planning memory", std::size_t{1} << 32);
      blocks_.emplace_back(new std::int64_t[kBlockWords]);  // uninitialized: written before read
      ends_.push_back(0);
      used_ = 0;
    }
    std::int64_t* w = blocks_.back().get() + used_;
    w[0] = c.src_rank;
    w[1] = c.dst_rank;
    w[2] = c.src_offset;
    w[3] = c.dst_offset;
    w[4] = pack(c.src_buffer, c.dst_buffer);
    w[5] = pack(c.tensor, c.element_bytes);
    w[6] = pack(static_cast<std::int32_t>(c.quant), c.rank);
    for (int d = 0; d < c.rank; ++d) {
      const auto ud = static_cast<std::size_t>(d);
      w[kHeaderWords + 3 * ud] = c.extent(d);
      w[kHeaderWords + 3 * ud + 1] = c.src_stride(d);
      w[kHeaderWords + 3 * ud + 2] = c.dst_stride(d);
    }
    used_ += words;
    ends_.back() = static_cast<std::uint32_t>(used_);
    ++count_;
  }

  /// Calls f(handle, copy) for every copy in push order; the Copy is a view
  /// of the header only (dims are not read): route, offsets and rank.
  template <class F>
  void for_each_header(F&& f) const {
    Copy c;
    for (std::size_t b = 0; b < blocks_.size(); ++b) {
      const std::int64_t* base = blocks_[b].get();
      for (std::size_t at = 0; at < ends_[b];) {
        read_header(base + at, c);
        f(static_cast<Handle>(b * kBlockWords + at), c);
        at += kHeaderWords + 3 * static_cast<std::size_t>(c.rank);
      }
    }
  }

  /// The copy at h, exactly as pushed.
  void read(Handle h, Copy& c) const {
    const std::int64_t* w = blocks_[h / kBlockWords].get() + h % kBlockWords;
    read_header(w, c);
    std::array<std::int64_t, kMaxBoxRank> ext{}, ss{}, ds{};
    const auto r = static_cast<std::size_t>(c.rank);
    for (std::size_t d = 0; d < r; ++d) {
      ext[d] = w[kHeaderWords + 3 * d];
      ss[d] = w[kHeaderWords + 3 * d + 1];
      ds[d] = w[kHeaderWords + 3 * d + 2];
    }
    c.assign(c.rank, ext.data(), ss.data(), ds.data());
  }

 private:
  static std::int64_t pack(std::int32_t hi, std::int32_t lo) {
    return static_cast<std::int64_t>((static_cast<std::uint64_t>(static_cast<std::uint32_t>(hi)) << 32) |
                                     static_cast<std::uint32_t>(lo));
  }
  static std::int32_t high(std::int64_t w) { return static_cast<std::int32_t>(static_cast<std::uint64_t>(w) >> 32); }
  static std::int32_t low(std::int64_t w) { return static_cast<std::int32_t>(static_cast<std::uint32_t>(w)); }
  static void read_header(const std::int64_t* w, Copy& c) {
    c.src_rank = w[0];
    c.dst_rank = w[1];
    c.src_offset = w[2];
    c.dst_offset = w[3];
    c.src_buffer = high(w[4]);
    c.dst_buffer = low(w[4]);
    c.tensor = high(w[5]);
    c.element_bytes = low(w[5]);
    c.rank = low(w[6]);
    c.quant = static_cast<CopyQuant>(high(w[6]));
  }

  std::vector<std::unique_ptr<std::int64_t[]>> blocks_;
  std::vector<std::uint32_t> ends_;  // words used per block
  std::size_t used_ = 0, count_ = 0;
};

/// Where emit() puts copies: a vector (a full plan: one destination's batch
/// at a time) or, for a one-rank plan, a CopyLog.
struct CopySink {
  std::vector<Copy>* copies = nullptr;
  CopyLog* log = nullptr;
  void push(const Copy& c) {
    if (log) {
      log->push(c);
      return;
    }
    if (copies->size() == copies->capacity()) grow_prefaulted(*copies);
    copies->push_back(c);
  }
};

}  // namespace reshard::detail
