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

// The tiles' vectors: 16 lanes with AVX-512 (dvec), else 8 (vfloat); head dims of 8
// mod 16 take vfloat tiles with AVX-512 too. Query rows a tile holds in registers: 4
// with 16-lane vectors (AVX-512's 32 registers: 16 accumulators, the K or V vectors
// and a broadcast), 2 with 8-lane ones (16 registers with AVX2).
constexpr int64_t DL = W >= 8 ? W : VL;
typedef float dvec __attribute__((vector_size(DL * sizeof(float))));
template <typename V>
constexpr int64_t lanes_of = sizeof(V) / sizeof(float);
template <typename V>
constexpr int tile_rows = lanes_of<V> >= 16 ? 4 : 2;

// v's lanes summed pairwise down to 8 (lo half + hi half), for reduce8.
template <typename V>
inline vfloat fold8(V v) {
  if constexpr (sizeof(V) == sizeof(vfloat)) {
    return v;
  } else {
    vfloat lo, hi;
    halves(v, lo, hi);
    return lo + hi;
  }
}

// scores[r][0..n) = q[r] . k[j] for RB query rows (row r at q + r * D, its scores at
// scores + r * ld), four keys at a time: each K vector loaded feeds all RB rows, and a
// transposing reduction finishes 4 keys of 2 rows at once; D % lanes_of<V> == 0.
template <int RB, typename V>
inline void qk_rows(const float* q, const float* const* k, float* scores, int64_t ld, int64_t n, int64_t D) {
  static_assert(RB >= 1 && RB <= tile_rows<V>);
  constexpr int64_t L = lanes_of<V>;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    V a[RB][4] = {};
    const float *k0 = k[j], *k1 = k[j + 1], *k2 = k[j + 2], *k3 = k[j + 3];
    for (int64_t c = 0; c < D; c += L) {
      const V x0 = vload<V>(k0 + c), x1 = vload<V>(k1 + c), x2 = vload<V>(k2 + c), x3 = vload<V>(k3 + c);
      for (int r = 0; r < RB; ++r) {
        const V qv = vload<V>(q + r * D + c);
        a[r][0] += qv * x0;
        a[r][1] += qv * x1;
        a[r][2] += qv * x2;
        a[r][3] += qv * x3;
      }
    }
    for (int r = 0; r < RB; r += 2) {
      const int r1 = r + 1 < RB ? r + 1 : r;  // a lone last row pairs with zeros
      const vfloat z = {};
      const bool pair = r1 != r;
      const vfloat sums = reduce8(fold8(a[r][0]), fold8(a[r][1]), fold8(a[r][2]), fold8(a[r][3]),
                                  pair ? fold8(a[r1][0]) : z, pair ? fold8(a[r1][1]) : z,
                                  pair ? fold8(a[r1][2]) : z, pair ? fold8(a[r1][3]) : z);
      const float* lanes = reinterpret_cast<const float*>(&sums);  // row r's 4 scores, then r1's
      __builtin_memcpy(scores + r * ld + j, lanes, 4 * sizeof(float));
      if (pair) __builtin_memcpy(scores + r1 * ld + j, lanes + 4, 4 * sizeof(float));
    }
  }
  for (; j < n; ++j)
    for (int r = 0; r < RB; ++r) scores[r * ld + j] = dot(q + r * D, k[j], D);
}

// acc[r][0..D) += sum_j p[r][j] * v[j][0..D) for RB rows (row stride D, p row stride
// ld), j < n, NV vectors of the head dim at a time held in registers.
template <int RB, int NV, typename V>
inline void pv_rows(float* acc, const float* p, int64_t ld, const float* const* v, int64_t n, int64_t D) {
  constexpr int64_t L = lanes_of<V>;
  for (int64_t c = 0; c < D; c += NV * L) {
    V a[RB][NV];
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < NV; ++t) a[r][t] = vload<V>(acc + r * D + c + t * L);
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = v[j] + c;
      V x[NV];
      for (int t = 0; t < NV; ++t) x[t] = vload<V>(vj + t * L);
      for (int r = 0; r < RB; ++r) {
        const V pr = broadcast<V>(p[r * ld + j]);
        for (int t = 0; t < NV; ++t) a[r][t] += pr * x[t];
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < NV; ++t) vstore(acc + r * D + c + t * L, a[r][t]);
  }
}

// f.template operator()<rb>() for a run-time rb in [1, MaxRows] (2 or 4).
template <int MaxRows, typename F>
inline void with_rows(int64_t rb, F&& f) {
  switch (rb) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    default:
      if constexpr (MaxRows >= 4) {
        if (rb == 3) f.template operator()<3>();
        else f.template operator()<4>();
      }
  }
}

// Every row's scores against keys j0..j0+n of a chunk (krows and the scores' rows start
// at key 0; row r sees keys below limit[r], non-decreasing in r), tile_rows<V> rows at a
// time, each block up to the keys its last row sees.
template <typename V>
inline void score_rows(const float* q, const float* const* krows, float* scores, int64_t ld, const int64_t* limit,
                       int64_t j0, int64_t n, int64_t R, int64_t D) {
  constexpr int TR = tile_rows<V>;
  for (int64_t r = 0; r < R; r += TR) {
    const int64_t rb = std::min<int64_t>(TR, R - r);
    const int64_t lim = std::min(n, limit[r + rb - 1] - j0);
    if (lim <= 0) continue;
    with_rows<TR>(rb, [&]<int RB>() { qk_rows<RB, V>(q + r * D, krows + j0, scores + r * ld + j0, ld, lim, D); });
  }
}

// pv_rows over R rows, for keys j0..j0+n (p and v start at key j0; row r sees keys
// below limit[r]), tile_rows<V> rows at a time up to the keys all of them see, then
// each row's further keys alone: a row never multiplies a V row it must not see (0 *
// inf is NaN). (Rows see more keys only with drafts, the last few.)
template <int NV, typename V>
inline void pv_tile(float* acc, const float* p, int64_t ld, const int64_t* limit, int64_t j0, const float* const* v,
                    int64_t n, int64_t R, int64_t D) {
  constexpr int TR = tile_rows<V>;
  const auto seen = [&](int64_t r) { return std::clamp<int64_t>(limit[r] - j0, 0, n); };
  for (int64_t r = 0; r < R; r += TR) {
    const int64_t rb = std::min<int64_t>(TR, R - r);
    int64_t common = n;
    for (int64_t i = r; i < r + rb; ++i) common = std::min(common, seen(i));
    if (common > 0) {
      with_rows<TR>(rb, [&]<int RB>() { pv_rows<RB, NV, V>(acc + r * D, p + r * ld, ld, v, common, D); });
    }
    for (int64_t i = r; i < r + rb; ++i) {
      const int64_t extra = seen(i) - common;
      if (extra > 0) pv_rows<1, NV, V>(acc + i * D, p + i * ld + common, ld, v + common, extra, D);
    }
  }
}

// pv_tile with as many vectors of V a pass as D allows (4, 2 or 1); D % lanes_of<V> == 0.
template <typename V>
inline void add_values(float* acc, const float* p, int64_t ld, const int64_t* limit, int64_t j0,
                       const float* const* v, int64_t n, int64_t R, int64_t D) {
  constexpr int64_t L = lanes_of<V>;
  if (D % (4 * L) == 0) {
    pv_tile<4, V>(acc, p, ld, limit, j0, v, n, R, D);
  } else if (D % (2 * L) == 0) {
    pv_tile<2, V>(acc, p, ld, limit, j0, v, n, R, D);
  } else {
    pv_tile<1, V>(acc, p, ld, limit, j0, v, n, R, D);
  }
}

}  // namespace tandem
