// The register tiles of decode attention (decode_attention.cpp): a few query rows'
// scores against a group of keys, and their probabilities times the values. K and V
// rows come as pointers (a paged cache's rows are scattered); scores and
// probabilities are rows `ld` floats apart.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernel_common.h"

namespace tandem {

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// out[i] = sum of the lanes of v_i, for 8 vectors at once.
inline vfloat reduce8(vfloat v0, vfloat v1, vfloat v2, vfloat v3, vfloat v4, vfloat v5, vfloat v6,
                      vfloat v7) {
  const vint even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
  const vfloat x01 = __builtin_shuffle(v0, v1, even) + __builtin_shuffle(v0, v1, odd);
  const vfloat x23 = __builtin_shuffle(v2, v3, even) + __builtin_shuffle(v2, v3, odd);
  const vfloat x45 = __builtin_shuffle(v4, v5, even) + __builtin_shuffle(v4, v5, odd);
  const vfloat x67 = __builtin_shuffle(v6, v7, even) + __builtin_shuffle(v6, v7, odd);
  const vint lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
  const vfloat y0 = __builtin_shuffle(x01, x23, lo2) + __builtin_shuffle(x01, x23, hi2);
  const vfloat y1 = __builtin_shuffle(x45, x67, lo2) + __builtin_shuffle(x45, x67, hi2);
  const vint lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
  return __builtin_shuffle(y0, y1, lo4) + __builtin_shuffle(y0, y1, hi4);
}

// scores[r][0..n) = q[r] . k[j] for RB (1 or 2) query rows (row r at q + r * D, its
// scores at scores + r * ld), four keys at a time: each K vector loaded feeds RB rows,
// and one transposing reduction finishes 4 keys of 2 rows; D % VL == 0.
template <int RB>
inline void qk_rows(const float* q, const float* const* k, float* scores, int64_t ld, int64_t n, int64_t D) {
  static_assert(RB == 1 || RB == 2);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    vfloat a[2][4] = {};
    const float *k0 = k[j], *k1 = k[j + 1], *k2 = k[j + 2], *k3 = k[j + 3];
    for (int64_t c = 0; c < D; c += VL) {
      const vfloat x0 = vload(k0 + c), x1 = vload(k1 + c), x2 = vload(k2 + c), x3 = vload(k3 + c);
      for (int r = 0; r < RB; ++r) {
        const vfloat qv = vload(q + r * D + c);
        a[r][0] += qv * x0;
        a[r][1] += qv * x1;
        a[r][2] += qv * x2;
        a[r][3] += qv * x3;
      }
    }
    const vfloat sums = reduce8(a[0][0], a[0][1], a[0][2], a[0][3], a[1][0], a[1][1], a[1][2], a[1][3]);
    const float* lanes = reinterpret_cast<const float*>(&sums);  // row 0's 4 scores, then row 1's
    for (int r = 0; r < RB; ++r) __builtin_memcpy(scores + r * ld + j, lanes + 4 * r, 4 * sizeof(float));
  }
  for (; j < n; ++j)
    for (int r = 0; r < RB; ++r) scores[r * ld + j] = dot(q + r * D, k[j], D);
}

// acc[r][0..D) += sum_j p[r][j] * v[j][0..D) for RB rows (row stride D, p row stride
// ld), j < n, NV vectors of the head dim at a time held in registers.
template <int RB, int NV>
inline void pv_rows(float* acc, const float* p, int64_t ld, const float* const* v, int64_t n, int64_t D) {
  for (int64_t c = 0; c < D; c += NV * VL) {
    vfloat a[RB][NV];
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < NV; ++t) a[r][t] = vload(acc + r * D + c + t * VL);
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = v[j] + c;
      vfloat x[NV];
      for (int t = 0; t < NV; ++t) x[t] = vload(vj + t * VL);
      for (int r = 0; r < RB; ++r) {
        const vfloat pr = splat(p[r * ld + j]);
        for (int t = 0; t < NV; ++t) a[r][t] += pr * x[t];
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < NV; ++t) vstore(acc + r * D + c + t * VL, a[r][t]);
  }
}

// pv_rows over R rows, for keys j0..j0+n (p and v start at key j0; row r sees keys
// below limit[r]), two rows at a time up to the keys both see, then the row that sees
// more alone: a row never multiplies a V row it must not see (0 * inf is NaN).
template <int NV>
inline void pv_tile(float* acc, const float* p, int64_t ld, const int64_t* limit, int64_t j0, const float* const* v,
                    int64_t n, int64_t R, int64_t D) {
  const auto seen = [&](int64_t r) { return std::clamp<int64_t>(limit[r] - j0, 0, n); };
  int64_t r = 0;
  for (; r + 2 <= R; r += 2) {
    const int64_t a = seen(r), b = seen(r + 1), both = std::min(a, b);
    if (both > 0) pv_rows<2, NV>(acc + r * D, p + r * ld, ld, v, both, D);
    const int64_t longer = a > b ? r : r + 1;
    if (a != b) pv_rows<1, NV>(acc + longer * D, p + longer * ld + both, ld, v + both, std::max(a, b) - both, D);
  }
  if (r < R && seen(r) > 0) pv_rows<1, NV>(acc + r * D, p + r * ld, ld, v, seen(r), D);
}

}  // namespace tandem
