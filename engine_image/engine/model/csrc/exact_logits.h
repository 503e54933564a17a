// The greedy head's exact step (greedy_head.cpp): float32 logits of whole panels, as
// panel_linear's tile sums them, and the first maximum over the panels each row's screen
// left in the running.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace tandem::exact {

constexpr int NV = 3;        // vectors across a panel
constexpr int NR = NV * 16;  // a panel's columns: panel_linear's with AVX-512
constexpr int ROWS = 4;      // rows a panel's pass serves: 12 accumulators

}  // namespace tandem::exact

#if defined(__AVX512F__)
#include <immintrin.h>

namespace tandem::exact {

// The float32 logits of one panel for R rows (x[r], out[r]), as panel_linear's tile sums
// them: from 0, k in order, one FMA a step, the panel [K, NR] read front to back, once
// for all R rows (a row's logits do not depend on R).
template <int R>
inline void panel_logits(const float* const* x, const float* panel, int64_t K, float (*out)[NR]) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[NV];
    for (int v = 0; v < NV; ++v) w[v] = _mm512_loadu_ps(panel + k * NR + v * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xk = _mm512_set1_ps(x[r][k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(xk, w[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out[r] + v * 16, acc[r][v]);
}

// A panel's part in a row's argmax: its first NaN, else its first maximum.
struct PanelBest {
  int64_t index = -1;  // the token
  float value = 0.0f;
  bool nan = false;
};

inline PanelBest panel_best(const float* f, int64_t p, int64_t cols) {
  PanelBest best;
  for (int64_t i = 0; i < cols; ++i) {
    if (std::isnan(f[i])) return {p * NR + i, f[i], true};
    if (best.index < 0 || f[i] > best.value) best = {p * NR + i, f[i], false};
  }
  return best;
}

// Folds the next panel's part (in index order) into a row's argmax so far: false once a
// NaN decides it (argmax_rows' rule: the first NaN), else keeps the first maximum.
inline bool fold(PanelBest& best, const PanelBest& next) {
  if (next.nan) {
    best = next;
    return false;
  }
  if (best.index < 0 || next.value > best.value) best = next;
  return true;
}

// The first maximum of x's float32 logits over the panels `wanted` says to compute (all
// of them: NaN first, as argmax_rows has it); -1 where none is wanted.
template <typename Wanted>
int64_t panels_argmax(const float* x, const float* panels, int64_t K, int64_t N, int64_t P, Wanted wanted) {
  PanelBest best;
  float f[1][NR];
  for (int64_t p = 0; p < P; ++p) {
    if (!wanted(p)) continue;
    panel_logits<1>(&x, panels + p * K * NR, K, f);
    if (!fold(best, panel_best(f[0], p, std::min<int64_t>(NR, N - p * NR)))) break;
  }
  return best.index;
}

// Each row's first maximum over its candidate panels: row s's are cand[begin[s] ..
// begin[s + 1]), in increasing order. The panels are read once each, for all the rows
// that want them, ROWS at a time (rows of real text share few; the flat distributions
// of a random prompt's continuations share many: a third as many distinct panels as
// candidates a batch). x[s]: row s. A row with no candidate gets -1.
inline void candidates_argmax(const std::vector<const float*>& x, const std::vector<int64_t>& begin,
                              const std::vector<int64_t>& cand, const float* panels, int64_t K, int64_t N, int64_t P,
                              int threads, int64_t* out) {
  const int64_t S = static_cast<int64_t>(x.size());
  // The candidates by panel: by_panel[start[p] .. start[p + 1]) their indices into cand.
  std::vector<int64_t> start(P + 1, 0), by_panel(cand.size());
  for (const int64_t p : cand) ++start[p + 1];
  for (int64_t p = 0; p < P; ++p) start[p + 1] += start[p];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < static_cast<int64_t>(cand.size()); ++i) by_panel[fill[cand[i]]++] = i;
  }
  std::vector<int64_t> wanted;  // the panels some row wants
  for (int64_t p = 0; p < P; ++p)
    if (start[p + 1] > start[p]) wanted.push_back(p);
  std::vector<PanelBest> found(cand.size());  // per candidate, as cand orders them
  std::vector<int64_t> row_of(cand.size());
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = begin[s]; i < begin[s + 1]; ++i) row_of[i] = s;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t w = 0; w < static_cast<int64_t>(wanted.size()); ++w) {
    const int64_t p = wanted[w], cols = std::min<int64_t>(NR, N - p * NR);
    const float* panel = panels + p * K * NR;
    for (int64_t j = start[p]; j < start[p + 1]; j += ROWS) {
      const int64_t n = std::min<int64_t>(ROWS, start[p + 1] - j);
      const float* rows[ROWS];
      for (int64_t r = 0; r < n; ++r) rows[r] = x[row_of[by_panel[j + r]]];
      float f[ROWS][NR];
      switch (n) {
        case 1: panel_logits<1>(rows, panel, K, f); break;
        case 2: panel_logits<2>(rows, panel, K, f); break;
        case 3: panel_logits<3>(rows, panel, K, f); break;
        default: panel_logits<4>(rows, panel, K, f);
      }
      for (int64_t r = 0; r < n; ++r) found[by_panel[j + r]] = panel_best(f[r], p, cols);
    }
  }
  for (int64_t s = 0; s < S; ++s) {  // in panel order: the first NaN, else the first maximum
    PanelBest best;
    for (int64_t i = begin[s]; i < begin[s + 1]; ++i)
      if (!fold(best, found[i])) break;
    out[s] = best.index;
  }
}

}  // namespace tandem::exact
#endif  // __AVX512F__
