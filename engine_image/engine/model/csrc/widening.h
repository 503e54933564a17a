// Widening narrow panels back to float32 (panel_linear.cpp): int8 codes with per-block
// scales (and offsets), as a quantised checkpoint stores a weight, or 16-bit floats,
// each W values a vector, exactly the float32 values they stand for.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernel_common.h"

namespace tandem {

// What a narrow panel holds (NarrowPanels in panel_linear.cpp): int8 codes with scales
// (and offsets), the same codes two a byte where they lie within 16 values (Q4_0's,
// Q4_1's), or the weights themselves in bfloat16 or float16, where each is exact.
enum class Narrow { Codes, Nibbles, BFloat16, Half };

// A narrow panel slice that the first row tile widens as it goes.
struct Widening {
  const void* codes = nullptr;  // [kc, NR] at the slice's first k (NR: a panel's columns)
  const float* scales = nullptr;  // Codes: [kc / block, NR] from there
  const float* offsets = nullptr;  // same, or null
  int64_t block = 1;  // k a scale holds for
  float low = 0.0f;  // Nibbles: the least code, which each nibble counts from
  float* out = nullptr;  // [kc, NR]: the widened slice, which the other row tiles read;
                         // null where there are none
};

// W codes as floats: the sign extension and conversion in two instructions (gcc's
// __builtin_convertvector went element by element).
inline wvec as_floats(const int8_t* c) {
#if defined(__AVX512F__)
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  return static_cast<wvec>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
#elif defined(__AVX2__)
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
  return static_cast<wvec>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
#else
  wvec q;
  for (int i = 0; i < W; ++i) q[i] = static_cast<float>(c[i]);
  return q;
#endif
}

// The codes a nibble stands for, low + n, for nibble_floats (with AVX-512: a lane each).
inline wvec nibble_values(float low) {
  wvec v;
  for (int i = 0; i < W; ++i) v[i] = low + static_cast<float>(i);
  return v;
}

// W codes two a byte (Nibbles: byte n of a row pair holds row 2i's column n in its low
// half, row 2i + 1's in its high half, each less the least code), as floats: the low
// halves' (HIGH false) or the high halves', small integers, exact. `values`:
// nibble_values(the least code).
template <bool HIGH>
inline wvec nibble_floats(const uint8_t* c, wvec values) {
#if defined(__AVX512F__)
  __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  if constexpr (HIGH) q = _mm_srli_epi16(q, 4);
  const __m128i n = _mm_and_si128(q, _mm_set1_epi8(0x0F));
  // Each nibble picks its value's lane: one instruction for the conversion and the low.
  return static_cast<wvec>(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(n), static_cast<__m512>(values)));
#elif defined(__AVX2__)
  __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
  if constexpr (HIGH) q = _mm_srli_epi16(q, 4);
  const __m128i n = _mm_and_si128(q, _mm_set1_epi8(0x0F));
  return static_cast<wvec>(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(n))) + values[0];
#else
  wvec q;
  for (int i = 0; i < W; ++i) q[i] = static_cast<float>(HIGH ? c[i] >> 4 : c[i] & 0x0F) + values[0];
  return q;
#endif
}

// W 16-bit floats as float32 (exactly: a bfloat16 is a float32's upper half).
inline wvec bf16_floats(const uint16_t* c) {
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
  return static_cast<wvec>(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
#elif defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  return static_cast<wvec>(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
#else
  wvec q;
  for (int i = 0; i < W; ++i) q[i] = static_cast<float>(c10::BFloat16(c[i], c10::BFloat16::from_bits()));
  return q;
#endif
}
inline wvec half_floats(const uint16_t* c) {
#if defined(__AVX512F__)
  return static_cast<wvec>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c))));
#elif defined(__F16C__) && defined(__AVX2__)
  return static_cast<wvec>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
#else
  wvec q;
  for (int i = 0; i < W; ++i) q[i] = static_cast<float>(c10::Half(c[i], c10::Half::from_bits()));
  return q;
#endif
}

// scale * code (+ offset) as one FMA: the loader rounds the product, then the sum, but
// pack_coded takes only codes whose products with their scales float32 holds exactly
// (a float16 scale times an 8-bit code needs 19 bits of the 24), so the fused
// operation rounds once, to the same value.
inline wvec widen(wvec code, const float* scale, const float* offset) {
  const wvec w = code * vload<wvec>(scale);
  return offset ? w + vload<wvec>(offset) : w;
}

}  // namespace tandem
