#pragma once
// The one format of the blobs ranks exchange through a transport's
// all_gather and pairwise exchange (setup tables, prepare tables, verdicts,
// figures): trivially copyable values in host byte order, byte strings as a
// u64 length and the bytes. Every rank of a job runs the same build, so no
// version field; a blob that ends early is a TransportError naming the rank
// it came from (a peer of another version, or a bug).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "transport.hpp"

namespace reshard {

class BlobWriter {
 public:
  template <class V>
  void put(const V& v) {
    static_assert(std::is_trivially_copyable_v<V>);
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    buf.insert(buf.end(), p, p + sizeof(V));
  }
  void put_bytes(const void* p, std::size_t n) {
    put<std::uint64_t>(n);
    const auto* b = static_cast<const std::byte*>(p);
    buf.insert(buf.end(), b, b + n);
  }
  void put_string(std::string_view s) { put_bytes(s.data(), s.size()); }
  std::vector<std::byte> buf;
};

class BlobReader {
 public:
  /// `from`: the rank that sent it; `what`: the kind of blob, for messages.
  BlobReader(std::span<const std::byte> b, std::int64_t from, const char* what = "setup") : b_(b), from_(from), what_(what) {}
  template <class V>
  V get() {
    static_assert(std::is_trivially_copyable_v<V>);
    need(sizeof(V));
    V v;
    std::memcpy(&v, b_.data() + pos_, sizeof(V));
    pos_ += sizeof(V);
    return v;
  }
  /// A view into the blob: valid while the blob is.
  std::span<const std::byte> get_bytes() {
    const auto n = get<std::uint64_t>();
    need(n);
    auto s = b_.subspan(pos_, static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return s;
  }
  std::string get_string() {
    const auto s = get_bytes();
    return std::string(reinterpret_cast<const char*>(s.data()), s.size());
  }
  bool done() const { return pos_ == b_.size(); }

 private:
  void need(std::uint64_t n) const {
    if (n > b_.size() - pos_)
      throw TransportError(fmt::format("the {} blob from rank {} is truncated (a rank of another version?)", what_, from_));
  }
  std::span<const std::byte> b_;
  std::size_t pos_ = 0;
  std::int64_t from_;
  const char* what_;
};

}  // namespace reshard
