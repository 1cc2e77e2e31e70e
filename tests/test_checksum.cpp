// CRC32C (checksum.hpp): the RFC 3720 B.4 test vectors, the hardware and
// table paths against a bit-at-a-time reference over many lengths and
// alignments (the three-lane loop and its zeros operator included), and
// crc32c_extend's concatenation property.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "reshard/exec/checksum.hpp"

using namespace reshard;

namespace {
// Bit-serial reference straight from the polynomial definition.
std::uint32_t crc_bitwise(const unsigned char* p, std::size_t n) {
  std::uint32_t c = 0xFFFFFFFFu;
  for (std::size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}
}  // namespace

TEST_CASE("crc32c: RFC 3720 B.4 vectors and the check value") {
  std::vector<unsigned char> v(32, 0);
  CHECK(crc32c(v.data(), v.size()) == 0x8A9136AAu);
  CHECK(crc32c_portable(v.data(), v.size()) == 0x8A9136AAu);
  std::fill(v.begin(), v.end(), 0xFF);
  CHECK(crc32c(v.data(), v.size()) == 0x62A8AB43u);
  for (int i = 0; i < 32; ++i) v[static_cast<std::size_t>(i)] = static_cast<unsigned char>(i);
  CHECK(crc32c(v.data(), v.size()) == 0x46DD794Eu);
  for (int i = 0; i < 32; ++i) v[static_cast<std::size_t>(i)] = static_cast<unsigned char>(31 - i);
  CHECK(crc32c(v.data(), v.size()) == 0x113FDB5Cu);
  const unsigned char pdu[48] = {0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                                 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x18,
                                 0x28, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
  CHECK(crc32c(pdu, sizeof pdu) == 0xD9963A56u);
  CHECK(crc32c_portable(pdu, sizeof pdu) == 0xD9963A56u);
  CHECK(crc32c("123456789", 9) == 0xE3069283u);
  CHECK(crc32c(nullptr, 0) == 0u);
  MESSAGE("crc32c uses the SSE4.2 instruction: " << (crc32c_hardware() ? "yes" : "no"));
}

TEST_CASE("crc32c: fast paths equal the bitwise reference at every length and alignment") {
  std::mt19937_64 rng(7);
  std::vector<unsigned char> buf(3 * 4096 * 3 + 64);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  std::vector<std::size_t> lengths;
  for (std::size_t n = 0; n < 80; ++n) lengths.push_back(n);
  // Around the short (256 B) and long (4 KiB) three-lane blocks and their mixes.
  for (std::size_t n : {767u, 768u, 769u, 775u, 1536u, 1543u, 3072u, 12287u, 12288u, 12289u, 12295u, 13056u, 13063u, 24576u, 25344u,
                        36863u, 36864u})
    lengths.push_back(n);
  for (int i = 0; i < 40; ++i) lengths.push_back(static_cast<std::size_t>(rng() % (buf.size() - 16)));
  for (std::size_t n : lengths)
    for (std::size_t a = 0; a < 8; ++a) {
      CAPTURE(n);
      CAPTURE(a);
      const std::uint32_t want = crc_bitwise(buf.data() + a, n);
      REQUIRE(crc32c(buf.data() + a, n) == want);
      REQUIRE(crc32c_portable(buf.data() + a, n) == want);
    }
}

TEST_CASE("crc32c: extend over a split equals the whole; one flipped bit changes the value") {
  std::mt19937_64 rng(11);
  std::vector<unsigned char> buf(20000);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  const std::uint32_t whole = crc32c(buf.data(), buf.size());
  for (std::size_t cut : {0u, 1u, 7u, 1024u, 3072u, 3075u, 10001u, 20000u}) {
    CAPTURE(cut);
    CHECK(crc32c_extend(crc32c(buf.data(), cut), buf.data() + cut, buf.size() - cut) == whole);
    CHECK(crc32c_extend(crc32c_portable(buf.data(), cut), buf.data() + cut, buf.size() - cut) == whole);
  }
  for (std::size_t bit : {0u, 9u, 8191u, 24577u, 159999u}) {
    buf[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
    CHECK(crc32c(buf.data(), buf.size()) != whole);
    buf[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
  }
  CHECK(crc32c(buf.data(), buf.size()) == whole);
}
