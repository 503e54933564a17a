// A quantised weight's codes on their way to AMX's B tiles (split_linear.cpp): the codes
// (int8, or two a byte: split_planes.py) as bfloat16 (small integers: exact), a code
// block at a time.
#pragma once

#include "amx_tiles.h"

#if defined(TANDEM_AMX) && defined(__AVX512BF16__)
#include <cstdint>
#include <cstring>

namespace tandem::coded {

// The bfloat16 of each code by its low 5 bits, for codes that lie in [low, low + 32): two
// codes there never share those bits.
inline __m512i code_table(int64_t low) {
  alignas(64) uint16_t table[32];
  for (int64_t i = 0; i < 32; ++i) {
    const float value = static_cast<float>(low + ((i - low) % 32 + 32) % 32);
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    table[i] = static_cast<uint16_t>(bits >> 16);  // exact: a small integer
  }
  return _mm512_load_si512(table);
}

// The bfloat16 of low + i for each nibble i (codes stored two a byte, less low).
inline __m512i nibble_table(int64_t low) {
  alignas(64) uint16_t table[32] = {};
  for (int64_t i = 0; i < 16; ++i) {
    const float value = static_cast<float>(low + i);
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    table[i] = static_cast<uint16_t>(bits >> 16);  // exact: a small integer
  }
  return _mm512_load_si512(table);
}

// A weight's codes (coded_planes): int8 [T][KBC][16][32] in the planes' tile layout (or
// two a byte: [T][KBC][16][16], byte i of a row codes i and i + 16 less the least code,
// low nibble first), float32 scales [T][KBC][16] (a column tile's, a code block), and the
// tail's planes [T][KBO][J][16][32] (the offsets' columns), converted a code block at a time.
struct CodedTiles {
  const int8_t* codes;
  const float* scales;
  const uint16_t* tail;
  int64_t KBC, KBO;
  // Where every code lies in 32 consecutive integers (Q4_0, Q4_1, Q5_0, Q5_1): code_table's,
  // and a row of codes converts in two instructions (widen, look up) against five through
  // float32 (Q8_0's).
  bool windowed;
  // Codes two a byte (Q4_0, Q4_1; windowed too): nibble_table's, a row's nibbles split,
  // widened and looked up (seven instructions a row).
  bool nibbles;
  __m512i table;

  int64_t tile_bytes() const { return nibbles ? amx::TILE_ELEMS / 2 : amx::TILE_ELEMS; }
};

// Code block kb of column tile c as bfloat16 (small integers: exact) into out, one B
// tile. `ahead`: a column tile converted later (or none), whose block kb is asked for in
// L2 now: first reads from memory otherwise stalled the conversion (chained 64-row
// products 7 % slower).
inline void convert_block(const CodedTiles& w, int64_t c, int64_t kb, uint16_t* out, const int64_t* ahead) {
  constexpr int64_t TILE = amx::TILE_ELEMS, KT = amx::TILE_K;
  const int64_t bytes = w.tile_bytes();
  if (ahead) {
    const char* codes = reinterpret_cast<const char*>(w.codes + (*ahead * w.KBC + kb) * bytes);
    const char* scales = reinterpret_cast<const char*>(w.scales + (*ahead * w.KBC + kb) * amx::COLUMNS);
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(codes + i, _MM_HINT_T1);
    _mm_prefetch(scales, _MM_HINT_T1);  // 16 floats: a line
  }
  const int8_t* codes = w.codes + (c * w.KBC + kb) * bytes;
  if (w.nibbles) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int q = 0; q < amx::ROWS; ++q) {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + q * KT / 2));
      const __m128i first = _mm_and_si128(packed, low4), second = _mm_and_si128(_mm_srli_epi16(packed, 4), low4);
      const __m256i row = _mm256_inserti128_si256(_mm256_castsi128_si256(first), second, 1);
      _mm512_store_si512(out + q * KT, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(row), w.table));
    }
    return;
  }
  if (w.windowed) {
    for (int q = 0; q < amx::ROWS; ++q) {
      const __m512i wide = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + q * KT)));
      _mm512_store_si512(out + q * KT, _mm512_permutexvar_epi16(wide, w.table));
    }
    return;
  }
  for (int q = 0; q < amx::ROWS; ++q) {
    const int8_t* row = codes + q * KT;
    const __m128i c0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
    const __m128i c1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16));
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c1)),
                                           _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c0)));
    _mm512_store_si512(out + q * KT, reinterpret_cast<const __m512i&>(v));
  }
}

// Column tile c's tail planes (the offsets' columns), after its converted codes in out.
inline void copy_tail(const CodedTiles& w, int64_t c, uint16_t* out, int64_t tail_planes) {
  constexpr int64_t TILE = amx::TILE_ELEMS;
  const int64_t elems = w.KBO * tail_planes * TILE;
  if (elems) std::memcpy(out + w.KBC * TILE, w.tail + c * elems, elems * sizeof(uint16_t));
}

}  // namespace tandem::coded
#endif  // TANDEM_AMX && __AVX512BF16__
