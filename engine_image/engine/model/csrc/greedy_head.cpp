// greedy_head: the argmax of the LM head's float32 logits, x @ W^T, for greedy rows,
// without computing every logit in float32. The result is the token the float32 head
// (panel_linear) and argmax_rows give, bit for bit the same decision.
//
//   pack_bf16_panels(W [N, K] float32) -> panels [P, ceil(K/2), NR, 2] bfloat16
//   greedy_head(x [M, K], panels, W, norms [N], N) -> token ids [M] (int64)
//
// How: a screen, then exact rescoring of the few tokens it cannot rule out.
//   1. a_j = x^ . w^_j, with x and W rounded to bfloat16 and float32 sums (AVX512-BF16's
//      vdpbf16ps): twice the float32 FMA rate, half the bytes of W to stream.
//   2. |a_j - f_j| <= e_j, f_j the float32 logit, for a rigorous e_j (below). Every j
//      with a_j + e_j < L = max_k (a_k - e_k) has f_j < f_max: it cannot be the argmax,
//      nor tie with it. The others are the candidates (SmolLM2, real text: median 2, a
//      few over 100 in 633 rows).
//   3. f_j for the candidates, summed as panel_linear sums (k in order, FMA), in index
//      order: the first maximum, torch's rule.
//
// The bound. With u = 2^-8 (bfloat16's unit roundoff), g(n) = n 2^-24 / (1 - n 2^-24),
// S_j = sum_k |x_k w_jk| <= |x| |w_j| (Cauchy-Schwarz; near tight for dense rows):
//   rounding x and w:        |x^ w^ - x w| <= (2u + u^2) |x w|, per term;
//   a's float32 sums:        <= g(2K) (1 + u)^2 S_j (vdpbf16ps rounds at most twice a pair);
//   f's float32 sums:        <= g(K) S_j;
//   flushed denormals (vdpbf16ps and its conversion flush them): <= 4K 2^-126 (1 + max|x|)
//   (1 + max|w|), absolute.
// A row whose |x| |w|_max could reach 1e30 (or that holds a NaN or an infinity) skips the
// screen: its logits are all computed in float32, so no sum overflows unseen.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int NV = 3;             // vectors across a panel
constexpr int NR = NV * 16;       // a panel's columns
constexpr int MR = 8;             // rows of the register tile: MR x NV accumulators
constexpr int64_t LINE = 64;      // bytes of a cache line
constexpr double UNIT = 1.0 / 256;  // bfloat16's unit roundoff, u = 2^-8
constexpr double SCREEN_LIMIT = 1e30;  // |x| |w|_max past this: no screen (overflow)

double gamma(int64_t n) {
  const double t = static_cast<double>(n) * std::ldexp(1.0, -24);
  return t / (1.0 - t);
}

// f_j: w_j . x in float32, k in order with FMAs, as panel_linear's tiles sum a column.
float exact_logit(const float* x, const float* w, int64_t K) {
  float acc = 0.0f;
  for (int64_t k = 0; k < K; ++k) acc = std::fma(x[k], w[k], acc);
  return acc;
}

// The first maximum of row's logits, NaN first as torch's argmax has it: the row that
// skips the screen.
int64_t exact_argmax(const float* x, const float* weight, int64_t N, int64_t K) {
  int64_t best = 0;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < N; ++j) {
    const float f = exact_logit(x, weight + j * K, K);
    if (std::isnan(f)) return j;
    if (f > top || j == 0) top = f, best = j;
  }
  return best;
}

bool has_bf16_dot() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_bf16_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_bf16_panels: expected a float32 weight [out_features, in_features]");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + NR - 1) / NR, K2 = (K + 1) / 2;
  // [P*NR, 2*K2] -> [P, NR, K2, 2] -> [P, K2, NR, 2]: panel p, k pair q, column c, k & 1.
  const at::Tensor padded = at::constant_pad_nd(weight, {0, 2 * K2 - K, 0, P * NR - N});
  return padded.to(at::kBFloat16).view({P, NR, K2, 2}).transpose(1, 2).contiguous();
}

#if defined(__AVX512BF16__)

// What the screen needs of a row besides its bfloat16 pairs: e_j = c |w_j| + slack, the
// bound on |a_j - f_j|, rounded up (c and slack are, by far more than a float product's
// rounding).
struct RowBound {
  float c;
  float slack;
};

// Rows m..m+R of the screen against one panel: a = x^ . w^ over k pairs, stored at out
// (ld apart), and each row's max over the panel of a_j - e_j at top[r * P].
template <int R>
void screen_tile(const uint32_t* xs, int64_t K2, const uint16_t* panel, const float* norms, const RowBound* bounds,
                 float* out, int64_t ld, int64_t cols, float* top, int64_t P, const char* prefetch, int64_t per_k) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t q = 0; q < K2; ++q) {
    const uint16_t* bq = panel + q * NR * 2;
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(bq + v * 32);
    for (int64_t i = 0; i < per_k; ++i) __builtin_prefetch(prefetch + (q * per_k + i) * LINE, 0, 2);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xq = (__m512bh)_mm512_set1_epi32(static_cast<int>(xs[r * K2 + q]));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xq, b[v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 c = _mm512_set1_ps(bounds[r].c), slack = _mm512_set1_ps(bounds[r].slack);
    if (cols == NR) {
      __m512 low = _mm512_set1_ps(-INFINITY);
      for (int v = 0; v < NV; ++v) {
        _mm512_storeu_ps(out + r * ld + v * 16, acc[r][v]);
        const __m512 e = _mm512_fmadd_ps(c, _mm512_loadu_ps(norms + v * 16), slack);
        low = _mm512_max_ps(low, _mm512_sub_ps(acc[r][v], e));
      }
      top[r * P] = _mm512_reduce_max_ps(low);
    } else {  // the last panel, past the vocabulary's end
      float row[NR];
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(row + v * 16, acc[r][v]);
      float low = -INFINITY;
      for (int64_t j = 0; j < cols; ++j) {
        out[r * ld + j] = row[j];
        low = std::max(low, row[j] - std::fma(bounds[r].c, norms[j], bounds[r].slack));
      }
      top[r * P] = low;
    }
  }
}

using ScreenFn = void (*)(const uint32_t*, int64_t, const uint16_t*, const float*, const RowBound*, float*, int64_t,
                          int64_t, float*, int64_t, const char*, int64_t);
constexpr ScreenFn SCREENS[MR] = {&screen_tile<1>, &screen_tile<2>, &screen_tile<3>, &screen_tile<4>,
                                  &screen_tile<5>, &screen_tile<6>, &screen_tile<7>, &screen_tile<8>};

// The screen over `rows` rows (bfloat16 pairs xs): a [rows, N], and top [rows, P] each
// row's max of a_j - e_j per panel.
void screen(const uint32_t* xs, int64_t rows, int64_t K2, const uint16_t* panels, const float* norms,
            const RowBound* bounds, int64_t P, int64_t N, float* a, float* top) {
  const int64_t panel_elems = K2 * NR * 2;
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), P));
  const int64_t tiles = (rows + MR - 1) / MR;
  const int64_t lines = panel_elems * 2 / LINE;  // a panel's cache lines, fetched over its tiles
  const int64_t per_k = (lines + tiles * K2 - 1) / (tiles * K2);
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t p0 = P * t / nt, p1 = P * (t + 1) / nt;
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* panel = panels + p * panel_elems;
      const char* next = p + 1 < p1 ? reinterpret_cast<const char*>(panel + panel_elems) : nullptr;
      const int64_t cols = std::min<int64_t>(NR, N - p * NR);
      for (int64_t ti = 0; ti < tiles; ++ti) {
        const int64_t m = ti * MR;
        const bool fetch = next && ti * K2 * per_k < lines;
        SCREENS[std::min<int64_t>(MR, rows - m) - 1](xs + m * K2, K2, panel, norms + p * NR, bounds + m,
                                                     a + m * N + p * NR, N, cols, top + m * P + p, P,
                                                     fetch ? next + ti * K2 * per_k * LINE : next, fetch ? per_k : 0);
      }
    }
  }
}

// The tokens of a row the screen cannot rule out: a_j + e_j >= L, L = max_j (a_j - e_j).
// Sums err by half an ulp of their result, and where the two sides meet their ulps are
// L's: two ulps below L covers both.
void candidates_of(const float* a, const float* norms, int64_t N, RowBound bound, float L,
                   std::vector<int64_t>& out) {
  L = std::nextafter(std::nextafter(L, -INFINITY), -INFINITY);
  const __m512 c = _mm512_set1_ps(bound.c), slack = _mm512_set1_ps(bound.slack), low = _mm512_set1_ps(L);
  int64_t j = 0;
  for (; j + 16 <= N; j += 16) {
    const __m512 e = _mm512_fmadd_ps(c, _mm512_loadu_ps(norms + j), slack);
    __mmask16 in = _mm512_cmp_ps_mask(_mm512_add_ps(_mm512_loadu_ps(a + j), e), low, _CMP_GE_OQ);
    for (; in; in &= in - 1) out.push_back(j + __builtin_ctz(in));
  }
  for (; j < N; ++j)
    if (a[j] + std::fma(bound.c, norms[j], bound.slack) >= L) out.push_back(j);
}

#endif  // __AVX512BF16__

at::Tensor greedy_head(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& weight, const at::Tensor& norms,
                       int64_t N) {
  TORCH_CHECK(has_bf16_dot(), "greedy_head: the kernels were built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "greedy_head: x must be float32 [rows, in_features]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(0) == N && weight.size(1) == x.size(1),
              "greedy_head: weight must be the contiguous float32 [out_features, in_features] of the head");
  const int64_t M = x.size(0), K = x.size(1), K2 = (K + 1) / 2, P = (N + NR - 1) / NR;
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() && panels.dim() == 4 &&
                  panels.size(0) == P && panels.size(1) == K2 && panels.size(2) == NR && panels.size(3) == 2,
              "greedy_head: panels must come from pack_bf16_panels of the same weight");
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.numel() == N,
              "greedy_head: norms must be the weight's row norms, float32 [out_features]");
  TORCH_CHECK(N > 0 && K > 0, "greedy_head: an empty head");
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  if (M == 0) return out;
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* np = norms.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const float norm_max = *std::max_element(np, np + N);
  const double w_abs_max = static_cast<double>(norm_max);  // |w_jk| <= |w_j|
  const double relative = 2 * UNIT + UNIT * UNIT + gamma(2 * K) * (1 + UNIT) * (1 + UNIT) + gamma(K);

  // Which rows take the screen, their |x| and max|x|, and their bfloat16 pairs.
  std::vector<int64_t> screened;
  std::vector<double> x_norm(M), x_abs_max(M);
  for (int64_t r = 0; r < M; ++r) {
    const float* row = xp + r * K;
    double sq = 0, top = 0;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) {
      finite &= std::isfinite(row[k]);
      sq += static_cast<double>(row[k]) * row[k];
      top = std::max(top, static_cast<double>(std::fabs(row[k])));
    }
    x_norm[r] = std::sqrt(sq), x_abs_max[r] = top;
    if (finite && x_norm[r] * norm_max < SCREEN_LIMIT) screened.push_back(r);
  }
  const int64_t S = static_cast<int64_t>(screened.size());
  std::vector<int64_t> slow;
  for (int64_t r = 0, s = 0; r < M; ++r) {
    if (s < S && screened[s] == r) ++s;
    else slow.push_back(r);
  }
  at::parallel_for(0, static_cast<int64_t>(slow.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) op[slow[i]] = exact_argmax(xp + slow[i] * K, wp, N, K);
  });
  if (S == 0) return out;

#if defined(__AVX512BF16__)
  std::vector<uint32_t> xs(S * K2, 0);
  std::vector<RowBound> bounds(S);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t r = screened[s];
    const float* row = xp + r * K;
    uint16_t* pairs = reinterpret_cast<uint16_t*>(xs.data() + s * K2);
    for (int64_t k = 0; k < K; ++k) {
      // Round to nearest even, as the weight's .to(bfloat16) does (finite inputs).
      const uint32_t bits = std::bit_cast<uint32_t>(row[k]);
      pairs[k] = static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
    }
    const double slack = 4.0 * K * std::ldexp(1.0, -126) * (1 + x_abs_max[r]) * (1 + w_abs_max);
    bounds[s] = {static_cast<float>(relative * x_norm[r] * (1 + 1e-6)),
                 static_cast<float>(slack * (1 + 1e-6)) + std::numeric_limits<float>::denorm_min()};
  }
  // Uninitialised: the screen writes every element it is read at.
  const at::Tensor a = at::empty({S, N}, x.options());
  const at::Tensor top = at::empty({S, P}, x.options());
  float* ap = a.data_ptr<float>();
  float* tp = top.data_ptr<float>();
  screen(xs.data(), S, K2, reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>()), np, bounds.data(), P,
         N, ap, tp);

  at::parallel_for(0, S, 1, [&](int64_t b, int64_t e) {
    std::vector<int64_t> candidates;
    for (int64_t s = b; s < e; ++s) {
      const int64_t r = screened[s];
      const float L = *std::max_element(tp + s * P, tp + (s + 1) * P);
      candidates.clear();
      candidates_of(ap + s * N, np, N, bounds[s], L, candidates);
      // f_j for each in index order: the first maximum wins, as argmax_rows has it.
      const float* xr = xp + r * K;
      int64_t best = candidates.front();
      float top_f = exact_logit(xr, wp + best * K, K);
      for (size_t i = 1; i < candidates.size(); ++i) {
        const float f = exact_logit(xr, wp + candidates[i] * K, K);
        if (f > top_f) top_f = f, best = candidates[i];
      }
      op[r] = best;
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("pack_bf16_panels", &pack_bf16_panels);
  m.impl("greedy_head", &greedy_head);
}
