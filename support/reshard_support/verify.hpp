#pragma once
// Tagged weights for checking a refit: every element of every local buffer
// gets a value derived from (tensor name, global index, salt), the same on
// both sides of a refit, so a destination element is right iff it equals its
// tag. Padding slots get a fixed byte, different on each side, so a copy that
// reads or writes padding is caught too.
//
//   fill_tags(src_layout, pos, buffer, ptr, TagFill::source, salt);
//   fill_tags(dst_layout, pos, buffer, ptr, TagFill::poison, salt);   // every slot wrong
//   ... refit ...
//   auto r = check_tags(dst_layout, pos, buffer, ptr, salt);          // r.wrong == 0
//
// Works a row at a time over the storage boxes (fast enough for GBs).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "reshard/exec/binding.hpp"
#include "reshard/exec/quant_refit.hpp"
#include "reshard/layout/layout.hpp"
#include "reshard/layout/quantize.hpp"
#include "reshard/layout/rank_buffers.hpp"
#include "reshard/layout/storage.hpp"

namespace reshard {

inline constexpr std::byte kSourcePadding{0xA5}, kDestinationPadding{0x5A};

inline std::uint64_t tensor_key(std::string_view name) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return h;
}
inline std::uint64_t tag_block(std::uint64_t key, std::int64_t block, std::uint64_t salt) {
  std::uint64_t x = key ^ (static_cast<std::uint64_t>(block) * 0x9E3779B97F4A7C15ull) ^ (salt * 0xD6E8FEB86659FD93ull);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return x;
}
/// The tag of one element: a hash per block of 256 global indices plus an
/// odd multiple of the index within the block, so neighbours always differ
/// and a run costs one hash per 256 elements.
inline std::uint64_t element_tag(std::uint64_t key, std::int64_t index, std::uint64_t salt) {
  return tag_block(key, index >> 8, salt) + static_cast<std::uint64_t>(index & 255) * 0x9E3779B97F4A7C15ull;
}

namespace detail {
/// Calls f(i, tag) for the elements g0 .. g0+count-1, one hash per block.
template <class F>
inline void for_each_tag(std::uint64_t key, std::int64_t g0, std::int64_t count, std::uint64_t salt, F&& f) {
  std::int64_t i = 0;
  while (i < count) {
    const std::int64_t g = g0 + i;
    const std::uint64_t base = tag_block(key, g >> 8, salt);
    const std::int64_t n = std::min(count - i, 256 - (g & 255));
    std::uint64_t v = base + static_cast<std::uint64_t>(g & 255) * 0x9E3779B97F4A7C15ull;
    for (std::int64_t k = 0; k < n; ++k, v += 0x9E3779B97F4A7C15ull) f(i + k, v);
    i += n;
  }
}
}  // namespace detail

enum class TagFill : std::uint8_t {
  source,  ///< tags; padding kSourcePadding
  poison,  ///< the complement of each tag (always wrong); padding kDestinationPadding
};

/// A tag as a finite float of dtype dt (the exponent's top bit cleared:
/// |x| < 2, no NaN or infinity), for sources of quantized tensors, whose
/// quantization needs numbers.
inline std::uint64_t finite_tag(DType dt, std::uint64_t v) {
  if (dt == DType::bf16 || dt == DType::f16) return v & ~std::uint64_t{0x4000};
  if (dt == DType::f32) return v & ~std::uint64_t{0x40000000};
  return v;
}
/// Does source tensor t feed a quantized tensor of `dst`?
inline bool feeds_quantized(const Layout& src, int t, const Layout* dst) {
  if (!dst) return false;
  const int d = dst->find_tensor(src.tensors[static_cast<std::size_t>(t)].name);
  return d >= 0 && dst->tensors[static_cast<std::size_t>(d)].quant.has_value();
}

/// Writes every slot of a dense local buffer. With `quantized_dst`, source
/// tensors that feed its quantized tensors get finite_tag values.
inline void fill_tags(const Layout& L, std::int64_t pos, int buf, std::byte* data, TagFill mode, std::uint64_t salt,
                      const Layout* quantized_dst = nullptr) {
  const auto E = static_cast<std::size_t>(element_bytes(L.local_buffers()[static_cast<std::size_t>(buf)].dtype));
  const std::size_t w = std::min<std::size_t>(E, 8);
  for_each_slot_run(L, pos, buf, [&](std::int64_t b0, std::int64_t count, int t, std::int64_t g0) {
    std::byte* p = data + static_cast<std::size_t>(b0) * E;
    if (t < 0) {
      std::memset(p, static_cast<int>(mode == TagFill::source ? kSourcePadding : kDestinationPadding), static_cast<std::size_t>(count) * E);
      return;
    }
    const std::uint64_t key = tensor_key(L.tensors[static_cast<std::size_t>(t)].name);
    const std::uint64_t flip = mode == TagFill::poison ? ~std::uint64_t{0} : 0;
    const bool finite = mode == TagFill::source && feeds_quantized(L, t, quantized_dst);
    const DType dt = L.tensors[static_cast<std::size_t>(t)].dtype;
    detail::for_each_tag(key, g0, count, salt, [&](std::int64_t i, std::uint64_t v) {
      if (finite) v = finite_tag(dt, v);
      v ^= flip;
      std::memcpy(p + static_cast<std::size_t>(i) * E, &v, w);
    });
  });
}

struct TagCheck {
  std::int64_t checked = 0, wrong = 0;
  std::string first_wrong;  ///< the first wrong slot, in words

  /// Adds another check (another buffer, another iteration); `where` prefixes
  /// its first wrong slot when that becomes the first here.
  void add(const TagCheck& c, std::string_view where = {}) {
    checked += c.checked;
    if (c.wrong && wrong == 0) first_wrong = where.empty() ? c.first_wrong : fmt::format("{}: {}", where, c.first_wrong);
    wrong += c.wrong;
  }
};

/// Checks every slot of a dense destination buffer after a refit.
inline TagCheck check_tags(const Layout& L, std::int64_t pos, int buf, const std::byte* data, std::uint64_t salt) {
  TagCheck r;
  const auto& lb = L.local_buffers()[static_cast<std::size_t>(buf)];
  const auto E = static_cast<std::size_t>(element_bytes(lb.dtype));
  const std::size_t w = std::min<std::size_t>(E, 8);
  for_each_slot_run(L, pos, buf, [&](std::int64_t b0, std::int64_t count, int t, std::int64_t g0) {
    const std::byte* p = data + static_cast<std::size_t>(b0) * E;
    r.checked += count;
    if (t < 0) {
      for (std::int64_t i = 0; i < count * static_cast<std::int64_t>(E); ++i)
        if (p[i] != kDestinationPadding) {
          if (r.wrong++ == 0)
            r.first_wrong = fmt::format("rank {} buffer '{}' element {} (padding) was overwritten", L.mesh.global_rank(pos), lb.name,
                                        b0 + i / static_cast<std::int64_t>(E));
          i = (i / static_cast<std::int64_t>(E) + 1) * static_cast<std::int64_t>(E) - 1;
        }
      return;
    }
    const auto& ts = L.tensors[static_cast<std::size_t>(t)];
    if (ts.quant || ts.scale_of >= 0) {  // check_quantized's
      r.checked -= count;
      return;
    }
    const std::uint64_t key = tensor_key(ts.name);
    detail::for_each_tag(key, g0, count, salt, [&](std::int64_t i, std::uint64_t v) {
      if (std::memcmp(p + static_cast<std::size_t>(i) * E, &v, w) != 0 && r.wrong++ == 0)
        r.first_wrong = fmt::format("rank {} buffer '{}' element {} ({} global index {}) is wrong", L.mesh.global_rank(pos), lb.name, b0 + i,
                                    ts.name, g0 + i);
    });
  });
  return r;
}

/// Checks the quantized tensors of destination buffer `buf` (values and
/// their scale entries) after a refit from `src` filled by fill_tags(...,
/// &dst): each tile is quantized here from the source's tags (the library's
/// kernel, tested on its own against an independent reference).
inline TagCheck check_quantized(const Layout& src, const Layout& dst, std::int64_t pos, int buf, const std::byte* data,
                                const std::vector<const std::byte*>& buffers, std::uint64_t salt) {
  TagCheck r;
  const auto& lb = dst.local_buffers()[static_cast<std::size_t>(buf)];
  for (int t : lb.tensors) {
    const auto& ts = dst.tensors[static_cast<std::size_t>(t)];
    if (!ts.quant || !dst.holds(pos, t)) continue;
    const auto& q = *ts.quant;
    const int st = src.find_tensor(ts.name);
    const DType sdt = src.tensors[static_cast<std::size_t>(st)].dtype;
    const auto E = static_cast<std::size_t>(element_bytes(sdt));
    const auto SE = static_cast<std::size_t>(element_bytes(scale_dtype(q.scheme)));
    const std::uint64_t key = tensor_key(ts.name);
    const std::byte* scales = buffers[static_cast<std::size_t>(dst.buffer_of(q.scale_tensor))];
    const PieceRuns runs = PieceRuns::of(dst, pos, t);
    std::vector<std::byte> vals;
    std::vector<std::uint8_t> want;
    std::vector<std::int64_t> at;
    for_each_whole_tile(dst, pos, t, q, [&](const auto& origin, const auto& extent) {
      vals.clear();
      at.clear();
      for_each_tile_row(ts.shape, origin, extent, [&](std::int64_t g, std::int64_t len) {
        detail::for_each_tag(key, g, len, salt, [&](std::int64_t, std::uint64_t v) {
          v = finite_tag(sdt, v);
          const auto* p = reinterpret_cast<const std::byte*>(&v);
          vals.insert(vals.end(), p, p + E);
        });
        runs.pieces(g, len, [&](std::int64_t b0, std::int64_t k) {
          for (std::int64_t i = 0; i < k; ++i) at.push_back(b0 + i);
        });
      });
      want.assign(at.size(), 0);
      std::byte scale[4];
      quantize_tile(q.scheme, sdt, [&](auto&& f) { f(vals.data(), want.data(), static_cast<std::int64_t>(want.size())); }, scale);
      for (std::size_t i = 0; i < at.size(); ++i) {
        ++r.checked;
        if (static_cast<std::uint8_t>(data[at[i]]) != want[i] && r.wrong++ == 0)
          r.first_wrong = fmt::format("rank {} buffer '{}' element {} ({}: FP8 value) is wrong", dst.mesh.global_rank(pos), lb.name,
                                      at[i], ts.name);
      }
      const std::int64_t so = scale_index(dst, pos, t, origin);
      ++r.checked;
      if (!scales || std::memcmp(scales + static_cast<std::size_t>(so) * SE, scale, SE) != 0) {
        if (r.wrong++ == 0)
          r.first_wrong = fmt::format("rank {} scale tensor '{}' entry {} is wrong", dst.mesh.global_rank(pos), q.scale, so);
      }
    });
  }
  return r;
}

/// Dense local buffers of one rank under one layout, filled with tags
/// (fill) and checked (check), quantized tensors included; the refit
/// harnesses' memory.
struct TaggedSide {
  const Layout* L = nullptr;
  std::optional<std::int64_t> pos;
  std::vector<std::unique_ptr<std::byte[]>> mem;
  std::vector<std::int64_t> bytes;

  void allocate(const Layout& layout, std::int64_t rank, std::map<std::string, BufferView>& views) {
    L = &layout;
    pos = layout.mesh.position_of(rank);
    const auto& lbs = layout.local_buffers();
    mem.resize(lbs.size());
    bytes.assign(lbs.size(), 0);
    if (!pos) return;
    for (std::size_t b = 0; b < lbs.size(); ++b) {
      const auto shape = buffer_shape(layout, *pos, static_cast<int>(b));
      if (shape.empty()) continue;
      const std::int64_t E = element_bytes(lbs[b].dtype);
      bytes[b] = product(shape) * E;
      mem[b] = std::make_unique<std::byte[]>(static_cast<std::size_t>(std::max<std::int64_t>(bytes[b], 1)));  // zeroed: pages touched now
      views[lbs[b].name] = bytes_view(mem[b].get(), static_cast<std::size_t>(bytes[b]), E);
    }
  }
  /// The other side of the refit: sources of its quantized tensors get
  /// finite values; its quantized tensors are checked against their sources.
  const Layout* other = nullptr;

  void fill(TagFill mode, std::uint64_t salt) {
    if (!pos) return;
    for (std::size_t b = 0; b < mem.size(); ++b)
      if (mem[b]) fill_tags(*L, *pos, static_cast<int>(b), mem[b].get(), mode, salt, other);
  }
  TagCheck check(std::uint64_t salt) const {
    TagCheck all;
    if (!pos) return all;
    for (std::size_t b = 0; b < mem.size(); ++b) {
      if (!mem[b]) continue;
      all.add(check_tags(*L, *pos, static_cast<int>(b), mem[b].get(), salt));
      if (other) {
        std::vector<const std::byte*> ptrs;
        for (const auto& m : mem) ptrs.push_back(m.get());
        all.add(check_quantized(*other, *L, *pos, static_cast<int>(b), mem[b].get(), ptrs, salt));
      }
    }
    return all;
  }
};

}  // namespace reshard
