// causal_attention: prefill attention for one sequence, built with cpu_kernels.cpp
// (which declares the op).
//
// q [T, H, D] holds the last T positions of a context whose keys and values are
// k, v [L, KVH, D] (L >= T: a prompt chunk after cached tokens has L > T); query
// row i sits at position L - T + i and attends to positions 0..L - T + i. Rows may
// be strided (views of a fused QKV product); each row's heads are dense. float32,
// bfloat16 or float16, computed in float32.
//
// One work item per (KV head, block of QB query positions): the block's G * QB
// query rows (its G query heads share the KV head) meet the context KT tokens at a
// time. Scores are a register-tiled product of the rows against the tile's K
// (transposed once per call, tile by tile, for all the blocks that read it); then an
// online softmax (kernel_common.h) and the probabilities times the tile's V into
// float32 accumulators. Measured on SmolLM2-135M's shapes (1,024 tokens, 9 heads
// over 3 KV heads, D 64, 2 threads, AMD Zen 4): ~8 ms a layer against ~11.6 for
// torch's flash attention on CPU, whose block products run through MKL.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "kernel_common.h"

namespace {

using namespace tandem;

constexpr int64_t QB = 64;  // query positions per work item
constexpr int64_t KT = 64;  // context tokens per tile
constexpr int64_t NB = 4 * VL;  // output columns per register tile; D must be a multiple

// c[MR rows][NB] (+)= a[MR rows][0..K) * b[0..K)[NB]; rows lda, ldb, ldc apart: added
// to c when Accumulate, else written over it. With MR = 4 the tile holds 16
// accumulators plus 4 of b: registers enough with AVX-512VL's 32 (cpu_kernels.py adds
// its flags where the CPU has them); AVX2 spills some.
template <int MR, bool Accumulate>
inline void tile_product(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
                         int64_t K) {
  vfloat acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int t = 0; t < 4; ++t) acc[r][t] = Accumulate ? vload(c + r * ldc + t * VL) : vfloat{};
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = b + k * ldb;
    const vfloat b0 = vload(bk), b1 = vload(bk + VL), b2 = vload(bk + 2 * VL), b3 = vload(bk + 3 * VL);
    for (int r = 0; r < MR; ++r) {
      const vfloat ar = splat(a[r * lda + k]);
      acc[r][0] += ar * b0;
      acc[r][1] += ar * b1;
      acc[r][2] += ar * b2;
      acc[r][3] += ar * b3;
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int t = 0; t < 4; ++t) vstore(c + r * ldc + t * VL, acc[r][t]);
}

// Score tiles: c[M][N] = a[M][K] * b[K][N] where row group r..r+4 needs only its first
// need(r) columns, rounded up to NB (the columns past them are left unwritten).
// Probability tiles: c[M][N] += a[M][K] * b[K][N] over the first need(r) rows of b.
// The diagonal tile's early rows see few keys. Each row group of a stays in L1 across
// its column tiles.
template <bool Scores, typename Need>
inline void product(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t M,
                    int64_t N, int64_t K, Need need) {
  constexpr bool trim_columns = Scores, accumulate = !Scores;
  for (int64_t r = 0; r < M; r += 4) {
    const int64_t rows = std::min<int64_t>(4, M - r);
    const int64_t lim = need(r + rows - 1);  // the group's last row sees the most
    const int64_t cols = trim_columns ? std::min(N, (lim + NB - 1) / NB * NB) : N;
    const int64_t depth = trim_columns ? K : std::min(K, lim);
    for (int64_t n0 = 0; n0 < cols; n0 += NB) {
      if (rows == 4) {
        tile_product<4, accumulate>(a + r * lda, lda, b + n0, ldb, c + r * ldc + n0, ldc, depth);
      } else {
        for (int64_t i = 0; i < rows; ++i)
          tile_product<1, accumulate>(a + (r + i) * lda, lda, b + n0, ldb, c + (r + i) * ldc + n0, ldc, depth);
      }
    }
  }
}

template <typename T>
struct Tensors {
  const T* q;
  const T* k;
  const T* v;
  T* out;  // [T, H, D] contiguous
  int64_t q_stride, k_stride, v_stride;  // between rows
  int64_t queries, context, H, KVH, D;  // query rows; context tokens (>= queries)
  float* kt;  // K in float32, [KVH][context tiles][D][KT], zero past the context
};

inline int64_t context_tiles(int64_t context) { return (context + KT - 1) / KT; }

// Every context tile of K transposed into t.kt, once for all the query blocks that
// read it (each used to transpose its own copy: ~15 % of the kernel's time).
template <typename T>
void transpose_keys(const Tensors<T>& t) {
  const int64_t tiles = context_tiles(t.context), D = t.D;
#pragma omp for schedule(static)
  for (int64_t item = 0; item < t.KVH * tiles; ++item) {
    const int64_t kvh = item / tiles, k0 = item % tiles * KT;
    float* kt = t.kt + item * D * KT;
    for (int64_t j = 0; j < KT; ++j) {
      const bool inside = k0 + j < t.context;
      const T* kr = t.k + (k0 + j) * t.k_stride + kvh * D;
      for (int64_t d = 0; d < D; ++d) kt[d * KT + j] = inside ? to_float(kr[d]) : 0.0f;
    }
  }
}

struct Scratch {
  std::vector<float> q, o, s, vt, m, l;  // vt: a V tile widened to float32
};

// One work item: KV head kvh, query positions q0 .. q0 + QB (clipped to T). bfloat16
// and float16 are widened to float32 on the way in and rounded once on the way out.
template <typename T>
void attend_block(const Tensors<T>& t, int64_t kvh, int64_t q0, float scale, Scratch& s) {
  constexpr bool widen = !std::is_same_v<T, float>;
  const int64_t G = t.H / t.KVH, D = t.D;
  const int64_t nq = std::min(QB, t.queries - q0);
  const int64_t R = nq * G;  // row r = qi * G + g
  const int64_t first_pos = t.context - t.queries + q0;  // position of the block's first query
  s.q.resize(R * D);
  s.o.assign(R * D, 0.0f);
  s.s.resize(R * KT);
  if (widen) s.vt.resize(KT * D);
  s.m.assign(R, -std::numeric_limits<float>::infinity());
  s.l.assign(R, 0.0f);
  for (int64_t qi = 0; qi < nq; ++qi) {
    for (int64_t g = 0; g < G; ++g) {
      load_scaled_row(s.q.data() + (qi * G + g) * D, t.q + (q0 + qi) * t.q_stride + (kvh * G + g) * D, scale, D);
    }
  }
  const int64_t end = first_pos + nq;  // the block's rows see keys [0, end) at most
  for (int64_t k0 = 0; k0 < end; k0 += KT) {
    const int64_t n = std::min(KT, end - k0);
    const float* kt = t.kt + (kvh * context_tiles(t.context) + k0 / KT) * D * KT;  // [D][KT]
    // Keys of this tile that row r sees (rows see up to their own position).
    auto visible = [&](int64_t r) { return std::min(n, std::max<int64_t>(first_pos + r / G - k0 + 1, 0)); };
    product<true>(s.q.data(), D, kt, KT, s.s.data(), KT, R, KT, D, visible);
    for (int64_t r = 0; r < R; ++r) {
      softmax_tile_row(s.s.data() + r * KT, visible(r), KT, s.m[r], s.l[r], s.o.data() + r * D, D);
    }
    const float* vtile;  // the tile's V rows, ldv apart
    int64_t ldv;
    if constexpr (widen) {
      for (int64_t j = 0; j < n; ++j) load_row(s.vt.data() + j * D, t.v + (k0 + j) * t.v_stride + kvh * D, D);
      vtile = s.vt.data();
      ldv = D;
    } else {
      vtile = t.v + k0 * t.v_stride + kvh * D;
      ldv = t.v_stride;
    }
    product<false>(s.s.data(), KT, vtile, ldv, s.o.data(), D, R, D, n, visible);
  }
  for (int64_t qi = 0; qi < nq; ++qi) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = qi * G + g;  // s.l[r] >= 1: every row sees at least its own key
      store_row(t.out + ((q0 + qi) * t.H + kvh * G + g) * D, s.o.data() + r * D, 1.0f / s.l[r], D);
    }
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, double scale) {
  const int64_t queries = q.size(0), KVH = k.size(1), D = q.size(2);
  // Every element is written by transpose_keys: no zero fill first.
  const std::unique_ptr<float[]> kt(new float[KVH * context_tiles(k.size(0)) * D * KT]);
  const Tensors<T> t{q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), out.data_ptr<T>(),
                     q.stride(0),     k.stride(0),     v.stride(0),     queries,
                     k.size(0),       q.size(1),       KVH,             D,
                     kt.get()};
  const int64_t blocks = (queries + QB - 1) / QB, items = blocks * KVH;
  const float fscale = static_cast<float>(scale);
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), items));
#pragma omp parallel num_threads(threads)
  {
    transpose_keys(t);  // ends with the threads' barrier: every tile is ready
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      // The latest blocks first: they see the most context, the short ones fill in.
      const int64_t block = blocks - 1 - item / KVH;
      attend_block<T>(t, item % KVH, block * QB, fscale, scratch);
    }
  }
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "causal_attention: q, k, v must be [rows, heads, D]");
  for (const at::Tensor* x : {&q, &k, &v}) {
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == x->size(2), "causal_attention: each row's heads must be dense");
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == q.scalar_type(),
                "causal_attention: q, k, v must be CPU tensors of one dtype");
  }
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), L = k.size(0), KVH = k.size(1);
  TORCH_CHECK(v.sizes() == k.sizes() && k.size(2) == D, "causal_attention: k and v must be [L, KVH, D] as q's D");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "causal_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(L >= T, "causal_attention: the context (", L, ") is shorter than the queries (", T, ")");
  TORCH_CHECK(D % NB == 0, "causal_attention: head_dim must be a multiple of ", NB);
  at::Tensor out = q.new_empty({T, H, D});
  if (T == 0) return out;
  dispatch_float_types(q.scalar_type(), "causal_attention", [&](auto tag) { run<decltype(tag)>(q, k, v, out, scale); });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("causal_attention", &causal_attention); }
