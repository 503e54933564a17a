// greedy_head: the argmax of the LM head's float32 logits, x @ W^T, for greedy rows,
// without computing every logit in float32. The result is the token the float32 head
// (panel_linear) and argmax_rows give: the same decision, bit for bit.
//
//   pack_bf16_panels(W [N, K] float32) -> panels [P, K2, NR, 2] bfloat16, K2 = K's pairs
//     zero-padded to a multiple of 16 (an AMX tile's)
//   greedy_head(x [M, K], bf16 panels, float32 panels (pack_panels), norms [N], N, tiles)
//     -> token ids [M] (int64)
//   amx_ready() -> whether `tiles` may be asked for (built for AMX, granted by the OS)
//
// How: a screen, then exact logits where the screen cannot decide.
//   1. a_j = x^ . w^_j, with x and W rounded to bfloat16 and float32 sums (AVX512-BF16's
//      vdpbf16ps: twice the float32 FMA rate on AMD Zen 4, half the bytes of W to
//      stream; or, with tiles, AMX's tdpbf16ps, ~4x vdpbf16ps on a Xeon). Per row and
//      panel of 48 tokens only the max of a_j - e_j and of a_j + e_j is kept (the tiles
//      store a 16 x 48 block of a at a time to take them).
//   2. |a_j - f_j| <= e_j, f_j the float32 logit, for a rigorous e_j (below). A token
//      with a_j + e_j < L = max_k (a_k - e_k) has f_j < f_max: it can be neither the
//      argmax nor tie with it. A panel whose max of a_j + e_j is below L holds no
//      candidate (SmolLM2 over real text: a median of 2 candidates a row).
//   3. The panels left get their float32 logits, computed as panel_linear's tile computes
//      them (the same panels, k in order, FMA), each panel read once for all the rows
//      that want it (exact_logits.h); per row in index order, the first maximum wins,
//      torch's rule. (Batch-64 heads of SmolLM2 with a random prompt's flat
//      continuations: 2.97 ms against 3.34 for a pass per row, a panel wanted by
//      ~3 rows.)
//
// The bound. With u = 2^-8 (bfloat16's unit roundoff), g(n) = n 2^-24 / (1 - n 2^-24),
// S_j = sum_k |x_k w_jk| <= |x| |w_j| (Cauchy-Schwarz; near tight for dense rows):
//   rounding x and w:        |x^ w^ - x w| <= (2u + u^2) |x w|, per term;
//   a's float32 sums:        <= g(2K) (1 + u)^2 S_j (vdpbf16ps and tdpbf16ps round at most
//                            twice a pair: the Intel SDM's pseudo-code adds each product
//                            of a pair in turn, rounding to nearest even);
//   f's float32 sums:        <= g(K) S_j;
//   flushed denormals (both flush inputs and outputs): <= 4K 2^-126 (1 + max|x|) (1 + max|w|),
//   absolute.
// e_j = c |w_j| + slack holds all of it, with c and slack rounded up by far more than the
// float arithmetic that applies them can lose. Applying it in float32 loses nothing:
// rounding is monotone, so real(a_i + e_i) >= f_i >= f_k >= real(a_k - e_k) gives
// fl(a_i + e_i) >= fl(a_k - e_k) whatever their signs and sizes.
// A row whose |x| |w|_max could reach 1e30, that holds a NaN or an infinity, or a value
// bfloat16 cannot hold (|x_k| >= 2^127 rounds to infinity) skips the screen: all its
// logits are computed in float32, so no sum overflows unseen. So do all rows of a head
// whose norms are not finite (GreedyHead.pack refuses such a head in the first place).
// Flushing denormals (torch.set_flush_denormal) is per thread, and panel_linear splits
// panels over threads where this splits rows: with it on, logits in the denormal range
// may differ between the two; the engine never sets it.

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

#include "amx_tiles.h"
#include "exact_logits.h"

namespace {

using tandem::exact::NR;                // a panel's columns: panel_linear's with AVX-512
using tandem::exact::NV;                // vectors across a panel
constexpr int MR = 8;                  // rows of the register tile: MR x NV accumulators
constexpr int64_t LINE = 64;           // bytes of a cache line
constexpr double UNIT = 1.0 / 256;     // bfloat16's unit roundoff, u = 2^-8
constexpr double SCREEN_LIMIT = 1e30;  // |x| |w|_max past this: no screen (overflow)
constexpr double BF16_LIMIT = 0x1p127;  // |x_k| from this on may round to infinity
constexpr int64_t PAIR_BLOCK = 16;     // k pairs padded to a multiple of this: the pairs of an AMX tile

// x's bits rounded to the nearest bfloat16, ties to even, as the weight's .to(bfloat16)
// (finite x below BF16_LIMIT), in the low 16 bits.
inline uint32_t to_bf16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
}

double gamma(int64_t n) {
  const double t = static_cast<double>(n) * std::ldexp(1.0, -24);
  return t / (1.0 - t);
}

// k pairs a panel and a row of the screen hold: K's, zero-padded to whole tiles of k.
int64_t padded_pairs(int64_t K) { return (K + 2 * PAIR_BLOCK - 1) / (2 * PAIR_BLOCK) * PAIR_BLOCK; }

// Whether greedy_head can screen on AMX tiles: built for them, and granted by the OS.
bool amx_ready() {
#if defined(TANDEM_AMX)
  return tandem::amx::permitted();
#else
  return false;
#endif
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
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + NR - 1) / NR, K2 = padded_pairs(K);
  // [P*NR, 2*K2] -> [P, NR, K2, 2] -> [P, K2, NR, 2]: panel p, k pair q, column c, k & 1.
  const at::Tensor padded = at::constant_pad_nd(weight, {0, 2 * K2 - K, 0, P * NR - N});
  return padded.to(at::kBFloat16).view({P, NR, K2, 2}).transpose(1, 2).contiguous();
}

#if defined(__AVX512BF16__)

using tandem::exact::panels_argmax;

// What the screen needs of a row besides its bfloat16 pairs: e_j = c |w_j| + slack.
struct RowBound {
  float c;
  float slack;
};

// Per row and panel: the max of a_j - e_j (low) and of a_j + e_j (high).
struct PanelBounds {
  float* low;
  float* high;
};

// One row's screen over one panel, a [NR], into its low and high.
inline void store_bounds(const __m512 (&a)[NV], RowBound row, const float* norms, int64_t cols, float* low_out,
                         float* high_out) {
  const __m512 c = _mm512_set1_ps(row.c), slack = _mm512_set1_ps(row.slack);
  __m512 low = _mm512_set1_ps(-INFINITY), high = low;
  for (int v = 0; v < NV; ++v) {
    // Columns past the vocabulary's end (the last panel) stay out of both maxima.
    const int64_t valid = std::clamp<int64_t>(cols - v * 16, 0, 16);
    const __mmask16 in = valid == 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 e = _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(in, norms + v * 16), slack);
    low = _mm512_mask_max_ps(low, in, low, _mm512_sub_ps(a[v], e));
    high = _mm512_mask_max_ps(high, in, high, _mm512_add_ps(a[v], e));
  }
  *low_out = _mm512_reduce_max_ps(low);
  *high_out = _mm512_reduce_max_ps(high);
}

// Rows m..m+R of the screen against one panel: a = x^ . w^ over k pairs, kept in
// registers; each row's low and high over the panel's columns at bounds[r * P].
template <int R>
void screen_tile(const uint32_t* xs, int64_t K2, const uint16_t* panel, const float* norms, const RowBound* rows,
                 int64_t cols, PanelBounds bounds, int64_t P, const char* prefetch, int64_t per_k) {
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
  for (int r = 0; r < R; ++r) store_bounds(acc[r], rows[r], norms, cols, bounds.low + r * P, bounds.high + r * P);
}

using ScreenFn = void (*)(const uint32_t*, int64_t, const uint16_t*, const float*, const RowBound*, int64_t,
                          PanelBounds, int64_t, const char*, int64_t);
constexpr ScreenFn SCREENS[MR] = {&screen_tile<1>, &screen_tile<2>, &screen_tile<3>, &screen_tile<4>,
                                  &screen_tile<5>, &screen_tile<6>, &screen_tile<7>, &screen_tile<8>};

// What the screens' threads hold for their run of panels: nothing for vdpbf16ps (AMX's
// tile configuration below).
struct NoScope {};

// visit(p, panel, next, cols) for every panel, each OpenMP thread a contiguous run of them
// with a Scope of its own for the run: next is the panel the thread takes after p (to
// prefetch), null at the run's end; cols, p's columns within the vocabulary.
template <typename Scope, typename Visit>
void for_each_panel(const uint16_t* panels, int64_t P, int64_t panel_elems, int64_t N, Visit&& visit) {
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), P));
#pragma omp parallel num_threads(threads)
  {
    [[maybe_unused]] const Scope scope;
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t p0 = P * t / nt, p1 = P * (t + 1) / nt;
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* panel = panels + p * panel_elems;
      const char* next = p + 1 < p1 ? reinterpret_cast<const char*>(panel + panel_elems) : nullptr;
      visit(p, panel, next, std::min<int64_t>(NR, N - p * NR));
    }
  }
}

// The screen over `rows` rows (bfloat16 pairs xs): low and high [rows, P].
void screen(const uint32_t* xs, int64_t rows, int64_t K2, const uint16_t* panels, const float* norms,
            const RowBound* bounds, int64_t P, int64_t N, PanelBounds out) {
  const int64_t panel_elems = K2 * NR * 2;
  const int64_t tiles = (rows + MR - 1) / MR;
  const int64_t lines = panel_elems * 2 / LINE;  // a panel's cache lines, fetched over its tiles
  const int64_t per_k = (lines + tiles * K2 - 1) / (tiles * K2);
  for_each_panel<NoScope>(panels, P, panel_elems, N,
                          [&](int64_t p, const uint16_t* panel, const char* next, int64_t cols) {
                            for (int64_t ti = 0; ti < tiles; ++ti) {
                              const int64_t m = ti * MR;
                              const bool fetch = next && ti * K2 * per_k < lines;
                              SCREENS[std::min<int64_t>(MR, rows - m) - 1](
                                  xs + m * K2, K2, panel, norms + p * NR, bounds + m, cols,
                                  {out.low + m * P + p, out.high + m * P + p}, P,
                                  fetch ? next + ti * K2 * per_k * LINE : next, fetch ? per_k : 0);
                            }
                          });
}

#if defined(TANDEM_AMX)

// The screen on AMX tiles: per panel, each 16 rows' a [16 x NR] in three C tiles (one per
// 16 columns), summed over k by tdpbf16ps, the same float32 dot products of bfloat16
// pairs as vdpbf16ps (its rounding and flushing, so the same bound), ~4x its speed on a Xeon. Rows
// past `rows` (xs holds them as zeros, to whole tiles) are computed and dropped.
void screen_tiles(const uint32_t* xs, int64_t rows, int64_t K2, const uint16_t* panels, const float* norms,
                  const RowBound* bounds, int64_t P, int64_t N, PanelBounds out) {
  namespace amx = tandem::amx;
  static_assert(PAIR_BLOCK % amx::PAIRS == 0, "K2 holds whole tiles of k pairs");
  static_assert(NR == NV * amx::COLUMNS && NV == 3, "three C tiles across a panel");
  const int64_t panel_elems = K2 * NR * 2, groups = (rows + amx::ROWS - 1) / amx::ROWS;
  const int64_t k_tiles = K2 / amx::PAIRS;
  const int64_t x_stride = K2 * 4, panel_stride = NR * 4;  // bytes from one row of A, of B, to the next
  // No software prefetch of the next panel: the hardware prefetchers follow the tiles'
  // loads, and fetching its lines in bursts over this panel's k tiles measured slower on
  // a Xeon (64 rows 4.9-5.8 ms against 4.7-5.6, 1 row 1.6-1.8 against 1.5).
  struct TileScope {
    amx::Tiles tiles{7};  // C: 0-2, A: 3, B: 4-6
  };
  for_each_panel<TileScope>(panels, P, panel_elems, N, [&](int64_t p, const uint16_t* panel, const char*,
                                                            int64_t cols) {
    alignas(64) float a[amx::ROWS][NR];
    for (int64_t g = 0; g < groups; ++g) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      const uint32_t* x = xs + g * amx::ROWS * K2;
      for (int64_t kt = 0; kt < k_tiles; ++kt) {
        const uint16_t* b = panel + kt * amx::PAIRS * NR * 2;
        _tile_loadd(3, x + kt * amx::PAIRS, x_stride);
        _tile_loadd(4, b, panel_stride);
        _tile_loadd(5, b + 2 * amx::COLUMNS, panel_stride);
        _tile_loadd(6, b + 4 * amx::COLUMNS, panel_stride);
        _tile_dpbf16ps(0, 3, 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_dpbf16ps(2, 3, 6);
      }
      _tile_stored(0, &a[0][0], NR * 4);
      _tile_stored(1, &a[0][16], NR * 4);
      _tile_stored(2, &a[0][32], NR * 4);
      for (int64_t r = 0; r < std::min<int64_t>(amx::ROWS, rows - g * amx::ROWS); ++r) {
        const __m512 sums[NV] = {_mm512_load_ps(&a[r][0]), _mm512_load_ps(&a[r][16]), _mm512_load_ps(&a[r][32])};
        const int64_t m = g * amx::ROWS + r;
        store_bounds(sums, bounds[m], norms + p * NR, cols, out.low + m * P + p, out.high + m * P + p);
      }
    }
  });
}

#endif  // TANDEM_AMX

#endif  // __AVX512BF16__

at::Tensor greedy_head(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& float_panels,
                       const at::Tensor& norms, int64_t N, bool tiles) {
  TORCH_CHECK(has_bf16_dot(), "greedy_head: the kernels were built without AVX512-BF16");
  TORCH_CHECK(!tiles || amx_ready(), "greedy_head: AMX tiles asked for, and this build or process has none");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "greedy_head: x must be float32 [rows, in_features]");
  const int64_t M = x.size(0), K = x.size(1), K2 = padded_pairs(K), P = (N + NR - 1) / NR;
  TORCH_CHECK(N > 0 && K > 0, "greedy_head: an empty head");
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() && panels.dim() == 4 &&
                  panels.size(0) == P && panels.size(1) == K2 && panels.size(2) == NR && panels.size(3) == 2,
              "greedy_head: panels must come from pack_bf16_panels of the head");
  TORCH_CHECK(float_panels.scalar_type() == at::kFloat && float_panels.is_contiguous() && float_panels.dim() == 3 &&
                  float_panels.size(0) == P && float_panels.size(1) == K && float_panels.size(2) == NR,
              "greedy_head: float_panels must come from pack_panels of the head");
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.numel() == N,
              "greedy_head: norms must be the head's row norms, float32 [out_features]");
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
#if defined(__AVX512BF16__)
  if (M == 0) return out;
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const float* fp = float_panels.data_ptr<float>();
  const float* np = norms.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // A NaN among the norms would slip past max_element: look at every one.
  const bool norms_finite = std::all_of(np, np + N, [](float v) { return std::isfinite(v); });
  const float norm_max = norms_finite ? *std::max_element(np, np + N) : INFINITY;
  const double w_abs_max = static_cast<double>(norm_max);  // |w_jk| <= |w_j|
  const double relative = 2 * UNIT + UNIT * UNIT + gamma(2 * K) * (1 + UNIT) * (1 + UNIT) + gamma(K);

  // Which rows take the screen, with their bfloat16 pairs and bounds; the others are
  // computed in float32 whole.
  std::vector<int64_t> screened, whole;
  std::vector<uint32_t> xs;
  std::vector<RowBound> bounds;
  for (int64_t r = 0; r < M; ++r) {
    const float* row = xp + r * K;
    double sq = 0, top = 0;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) {
      finite &= std::isfinite(row[k]);
      sq += static_cast<double>(row[k]) * row[k];
      top = std::max(top, static_cast<double>(std::fabs(row[k])));
    }
    const double norm = std::sqrt(sq);
    if (!finite || !(top < BF16_LIMIT) || !(norm * norm_max < SCREEN_LIMIT)) {
      whole.push_back(r);
      continue;
    }
    screened.push_back(r);
    xs.resize(screened.size() * K2, 0);
    uint32_t* pairs = xs.data() + (screened.size() - 1) * K2;
    for (int64_t k = 0; k < K; ++k) pairs[k / 2] |= to_bf16(row[k]) << (16 * (k % 2));
    const double slack = 4.0 * K * std::ldexp(1.0, -126) * (1 + top) * (1 + w_abs_max);
    bounds.push_back({static_cast<float>(relative * norm * (1 + 1e-6)),
                      static_cast<float>(slack * (1 + 1e-6)) + std::numeric_limits<float>::denorm_min()});
  }
  const auto every_panel = [](int64_t) { return true; };
  at::parallel_for(0, static_cast<int64_t>(whole.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) op[whole[i]] = panels_argmax(xp + whole[i] * K, fp, K, N, P, every_panel);
  });
  const int64_t S = static_cast<int64_t>(screened.size());
  if (S == 0) return out;
  std::vector<float> low(S * P), high(S * P);
  const uint16_t* bp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
#if defined(TANDEM_AMX)
  if (tiles) {
    xs.resize((S + tandem::amx::ROWS - 1) / tandem::amx::ROWS * tandem::amx::ROWS * K2, 0);  // whole tiles of rows
    screen_tiles(xs.data(), S, K2, bp, np, bounds.data(), P, N, {low.data(), high.data()});
  } else
#endif
    screen(xs.data(), S, K2, bp, np, bounds.data(), P, N, {low.data(), high.data()});
  // The candidates: per row, the panels whose max of a_j + e_j reaches L. Monotone
  // rounding makes hi >= L exact for the argmax's panel (header); two ulps below L are a
  // margin that costs nothing.
  std::vector<int64_t> begin(S + 1, 0), cand;
  std::vector<const float*> rows(S);
  for (int64_t s = 0; s < S; ++s) {
    const float* lo = low.data() + s * P;
    const float* hi = high.data() + s * P;
    float L = *std::max_element(lo, lo + P);
    L = std::nextafter(std::nextafter(L, -INFINITY), -INFINITY);
    for (int64_t p = 0; p < P; ++p)
      if (hi[p] >= L) cand.push_back(p);
    begin[s + 1] = static_cast<int64_t>(cand.size());
    rows[s] = xp + screened[s] * K;
  }
  std::vector<int64_t> best(S);
  tandem::exact::candidates_argmax(rows, begin, cand, fp, K, N, P, at::get_num_threads(), best.data());
  for (int64_t s = 0; s < S; ++s) {
    // No panel in the running cannot happen with finite sums; should it, be exact.
    op[screened[s]] = best[s] >= 0 ? best[s] : panels_argmax(rows[s], fp, K, N, P, every_panel);
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("pack_bf16_panels", &pack_bf16_panels);
  m.impl("greedy_head", &greedy_head);
}

// No tensor to dispatch on: the kernel for every backend.
TORCH_LIBRARY_IMPL(tandem_cpu, CompositeImplicitAutograd, m) { m.impl("amx_ready", &amx_ready); }
