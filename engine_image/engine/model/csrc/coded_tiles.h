// A quantised weight's int8 codes on their way to AMX's B tiles (split_linear.cpp): the
// codes as bfloat16 (small integers: exact), a column tile at a time, and each column's
// scale from the pairs' layout the scales are stored in.
#pragma once

#include "amx_tiles.h"

#if defined(TANDEM_AMX) && defined(__AVX512BF16__)
#include <cstdint>
#include <cstring>

namespace tandem::coded {

// The scale of each of 16 columns from the pairs' layout [s0, s0, s1, s1, ...].
inline __m512 column_scales(const float* pairs) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  return _mm512_permutex2var_ps(_mm512_loadu_ps(pairs), even, _mm512_loadu_ps(pairs + 16));
}

// A weight's codes (coded_planes): int8 [T][KBC][16][32] in the planes' tile layout,
// float32 scales [T][KBC][32] (each column's, twice: its pair), and the tail's planes
// [T][KBO][J][16][32] (the offsets' columns), converted a column tile at a time.
struct CodedTiles {
  const int8_t* codes;
  const float* scales;
  const uint16_t* tail;
  int64_t KBC, KBO;
};

// Column tile c's codes as bfloat16 (small integers: exact), every k block, then the
// tail's planes. `ahead`: the column tile the thread converts next (or none), whose codes
// are asked for in L2 now, a column pair's products ahead of their use: their first
// reads from memory otherwise stalled the conversion (chained 64-row products 7 % slower).
inline void convert(const CodedTiles& w, int64_t c, uint16_t* out, int64_t tail_planes, const int64_t* ahead) {
  constexpr int64_t TILE = amx::TILE_ELEMS, KT = amx::TILE_K;
  const int8_t* codes = w.codes + c * w.KBC * TILE;
  const char* fetch = ahead ? reinterpret_cast<const char*>(w.codes + *ahead * w.KBC * TILE) : nullptr;
  const char* fetch_scales = ahead ? reinterpret_cast<const char*>(w.scales + *ahead * w.KBC * KT) : nullptr;
  for (int64_t kb = 0; kb < w.KBC; ++kb, codes += TILE, out += TILE) {
    if (fetch) {
      for (int64_t i = 0; i < TILE; i += 64) _mm_prefetch(fetch + kb * TILE + i, _MM_HINT_T1);
      for (int64_t i = 0; i < KT * 4; i += 64) _mm_prefetch(fetch_scales + kb * KT * 4 + i, _MM_HINT_T1);
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
  if (w.KBO) std::memcpy(out, w.tail + c * w.KBO * tail_planes * TILE, w.KBO * tail_planes * TILE * sizeof(uint16_t));
}

}  // namespace tandem::coded
#endif  // TANDEM_AMX && __AVX512BF16__
