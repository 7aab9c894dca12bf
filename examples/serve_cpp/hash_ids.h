// The rows `ids: hash` features take, as lightning_rec's DataModules compute them (lightning_rec.data.schema.hash_ids,
// recorded in an artifact's spec as raw_inputs.hash): the same 64-bit hash in C++, header-only, no dependencies.
//
//   #include "hash_ids.h"
//   int64_t row = lightning_rec::hashed_row(int64_t{42}, 1000000);     // an integer id
//   int64_t same = lightning_rec::hashed_row("42", 1000000);             // text that is a decimal integer: the same
//   int64_t other = lightning_rec::hashed_row("user-42", 1000000);       // text: its UTF-8 bytes
//
// num_embeddings is the feature's "num_embeddings" in the spec's raw_inputs.sparse; the row is what goes into the
// artifact's `values`.
#pragma once

#include <cstdint>
#include <string_view>

namespace lightning_rec {

// SplitMix64's finaliser of a 64-bit pattern (an integer id: its two's complement bits).
inline uint64_t hash_integer(uint64_t bits) {
  uint64_t z = bits + 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Whether `text` is an integer written in decimal (-?[0-9]+) whose value is in [-2^63, 2^64); if so, `bits` is its
// value modulo 2^64 (int64 two's complement, or uint64 above 2^63 - 1).
inline bool integer_text(std::string_view text, uint64_t& bits) {
  const bool negative = !text.empty() && text[0] == '-';
  const std::string_view digits = negative ? text.substr(1) : text;
  if (digits.empty()) return false;
  uint64_t magnitude = 0;
  for (const char c : digits) {
    if (c < '0' || c > '9') return false;
    const uint64_t d = static_cast<uint64_t>(c - '0');
    if (magnitude > (UINT64_MAX - d) / 10) return false;  // 2^64 or more: not an integer here, text
    magnitude = magnitude * 10 + d;
  }
  if (negative && magnitude > (uint64_t{1} << 63)) return false;  // below -2^63
  bits = negative ? uint64_t{0} - magnitude : magnitude;
  return true;
}

// FNV-1a (64 bit) of a text's UTF-8 bytes, zero bytes skipped; a decimal integer's text hashes as the integer.
inline uint64_t hash_text(std::string_view utf8) {
  uint64_t bits = 0;
  if (integer_text(utf8, bits)) return hash_integer(bits);
  uint64_t z = 0xCBF29CE484222325ULL;
  for (const char c : utf8) {
    const auto byte = static_cast<uint64_t>(static_cast<unsigned char>(c));
    if (byte != 0) z = (z ^ byte) * 0x100000001B3ULL;
  }
  return z;
}

// The row of an integer id, or of a text id, in a table of num_embeddings rows.
inline int64_t hashed_row(int64_t id, int64_t num_embeddings) {
  return static_cast<int64_t>(hash_integer(static_cast<uint64_t>(id)) % static_cast<uint64_t>(num_embeddings));
}
inline int64_t hashed_row(std::string_view id, int64_t num_embeddings) {
  return static_cast<int64_t>(hash_text(id) % static_cast<uint64_t>(num_embeddings));
}

}  // namespace lightning_rec
