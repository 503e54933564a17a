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
// time, MR rows at a time (attend_rows): their scores against the tile's K
// (transposed once per call, tile by tile, for all the blocks that read it) stay in
// registers through an online softmax step, and the probabilities times the tile's V
// go into float32 accumulators. Scores are kept in log2 units (the query scale
// includes log2(e)), so the softmax's exponentials are powers of two.
//
// Measured on SmolLM2-135M's shapes (1,024 tokens, 9 heads over 3 KV heads, D 64,
// AMD Zen 4, docs/benchmarks.md): the products run at ~95 % of the FMA units' rate,
// the exponentials take ~15 % of the time. One thread: 14.2-14.9 ms a layer against
// 16.1-18.0 for the kernel before (scores in memory, then a softmax pass). Two
// threads: 7.3-7.9 ms against 11.8-14.3 for torch's flash attention on CPU (SDPA).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <limits>
#include <memory>
#include <numbers>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernel_common.h"

namespace {

using namespace tandem;

constexpr int64_t QB = 64;  // query positions per work item
constexpr int TV = 4;  // vectors across a context tile
constexpr int64_t KT = TV * W;  // context tokens per tile (64 with AVX-512)
// Query rows per register tile: MR x TV score accumulators, then MR x (up to) 4 of the
// output, of 32 registers with AVX-512 (29 of them), of 16 without. (6 rows against 4:
// no faster on AMD Zen 4, 4-15 % faster on an Intel Xeon, docs/benchmarks.md.)
#if defined(__AVX512F__)
constexpr int MR = 6;
#else
constexpr int MR = 2;
#endif
// head_dim's multiple (attention.py's PREFILL_HEAD_DIM_MULTIPLE): add_values takes D
// 2 or 4 vectors at a time.
constexpr int64_t HEAD_DIM_MULTIPLE = 32;
static_assert(HEAD_DIM_MULTIPLE % (2 * W) == 0);

// What a register tile of R query rows reads and keeps across one context tile.
struct Rows {
  const float* q;  // [R][D], scaled by the softmax scale times log2(e)
  float* o;  // [R][D], the unnormalised outputs so far
  float* m;  // [R], the running max of each row's scores (log2 units)
  float* l;  // [R], the running sum of 2^(score - m)
  const int64_t* visible;  // [R], the tile's keys each row sees (the rest masked)
};

// o[r][0 .. NV * W) = o[r][..] * corr[r] + sum over j < depth of p[r][j] * v[j][..].
// Not inlined: inside attend_rows the compiler spilled the V vectors to the stack
// (10.6 against 8.2 ms a layer).
template <int R, int NV>
__attribute__((noinline)) void add_values(const float* p, const float* v, int64_t ldv, int64_t depth,
                                          const float* corr, float* o, int64_t D) {
  wvec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = vload<wvec>(o + r * D + c * W) * corr[r];
  for (int64_t j = 0; j < depth; ++j) {
    wvec vj[NV];
    for (int c = 0; c < NV; ++c) vj[c] = vload<wvec>(v + j * ldv + c * W);
    for (int r = 0; r < R; ++r) {
      const wvec pr = broadcast<wvec>(p[r * KT + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] += pr * vj[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) vstore(o + r * D + c * W, acc[r][c]);
}

// R query rows against one context tile: their scores against the tile's first C * W
// keys (kt [D][KT]; the rows see no further) held in registers, masked, an online
// softmax step on them, and the probabilities times the tile's values (v, rows ldv
// apart) added to the rows' outputs. The scores never reach memory; the R rows'
// softmax steps are independent, so their exps overlap.
template <int R, int C>
void attend_rows(const Rows& rows, const float* kt, const float* v, int64_t ldv, int64_t D) {
  wvec s[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) s[r][c] = wvec{};
  for (int64_t d = 0; d < D; ++d) {
    wvec k[C];
    for (int c = 0; c < C; ++c) k[c] = vload<wvec>(kt + d * KT + c * W);
    for (int r = 0; r < R; ++r) {
      const wvec qr = broadcast<wvec>(rows.q[r * D + d]);
      for (int c = 0; c < C; ++c) s[r][c] += qr * k[c];
    }
  }
  // Each row's new running max; masked scores become -inf.
  using RowVector = typename Vectors<sizeof(float) * std::bit_ceil(unsigned{R > 1 ? R : 2})>::floats;  // a row a lane
  RowVector previous = {}, latest = {};
  const wint lane = lanes<wint>();
  const wvec masked = broadcast<wvec>(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < R; ++r) {
    const int32_t lim = static_cast<int32_t>(rows.visible[r]);  // a tile's width: small
    if (lim < C * W) {
      for (int c = 0; c < C; ++c) s[r][c] = lane + c * W < lim ? s[r][c] : masked;
    }
    wvec top = s[r][0];
    for (int c = 1; c < C; ++c) top = s[r][c] > top ? s[r][c] : top;
    previous[r] = rows.m[r];
    latest[r] = std::max(previous[r], hmax(top));  // -inf while a row has seen no key
  }
  // What each row's earlier sums are rescaled by: 1 where the max holds (and for rows
  // that have seen no key yet: their sums are 0), one vector exp for all the rows.
  const RowVector corr = vexp2_nonpositive(previous == latest ? RowVector{} : previous - latest);
  alignas(64) float p[R * KT];  // probabilities, for add_values to broadcast
  int64_t depth = 0;  // the keys any row sees
  for (int r = 0; r < R; ++r) {
    const int64_t lim = rows.visible[r];
    depth = std::max(depth, lim);
    const wvec top = broadcast<wvec>(latest[r]);
    wvec sum = {};
    for (int c = 0; c < C; ++c) {
      wvec e = vexp2_nonpositive(s[r][c] - top);
      // Masked lanes: the exp gives 2^-126 there (or NaN where a row's max is still
      // -inf, which cannot happen: every row sees a key of the first tile).
      if (lim < (c + 1) * W) e = lane + c * W < static_cast<int32_t>(lim) ? e : wvec{};
      vstore(p + r * KT + c * W, e);
      sum += e;
    }
    rows.l[r] = rows.l[r] * corr[r] + hsum(sum);
    rows.m[r] = latest[r];
  }
  float scales[R];  // corr, for add_values
  for (int r = 0; r < R; ++r) scales[r] = corr[r];
  for (int64_t d0 = 0; d0 < D;) {  // D is a multiple of 2 * W (HEAD_DIM_MULTIPLE)
    if (D - d0 >= 4 * W) {
      add_values<R, 4>(p, v + d0, ldv, depth, scales, rows.o + d0, D);
      d0 += 4 * W;
    } else {
      add_values<R, 2>(p, v + d0, ldv, depth, scales, rows.o + d0, D);
      d0 += 2 * W;
    }
  }
}

using RowsFn = void (*)(const Rows&, const float*, const float*, int64_t, int64_t);

template <int R, int... C>
constexpr std::array<RowsFn, TV> row_tiles(std::integer_sequence<int, C...>) {
  return {&attend_rows<R, C + 1>...};
}
template <int... R>
constexpr auto make_row_tiles(std::integer_sequence<int, R...>) {
  return std::array<std::array<RowsFn, TV>, MR>{row_tiles<R + 1>(std::make_integer_sequence<int, TV>{})...};
}
// ROW_TILES[r - 1][c - 1]: the tile of r rows (a block's last rows may be fewer than
// MR) that see c vectors of keys at most (the diagonal tile's early rows see fewer).
constexpr auto ROW_TILES = make_row_tiles(std::make_integer_sequence<int, MR>{});

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
  std::vector<float> q, o, vt, m, l;  // vt: a V tile widened to float32
  std::vector<int64_t> visible;
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
  if (widen) s.vt.resize(KT * D);
  s.m.assign(R, -std::numeric_limits<float>::infinity());
  s.l.assign(R, 0.0f);
  s.visible.resize(R);
  for (int64_t qi = 0; qi < nq; ++qi) {
    for (int64_t g = 0; g < G; ++g) {
      load_scaled_row(s.q.data() + (qi * G + g) * D, t.q + (q0 + qi) * t.q_stride + (kvh * G + g) * D, scale, D);
    }
  }
  const int64_t end = first_pos + nq;  // the block's rows see keys [0, end) at most
  for (int64_t k0 = 0; k0 < end; k0 += KT) {
    const int64_t n = std::min(KT, end - k0);
    const float* kt = t.kt + (kvh * context_tiles(t.context) + k0 / KT) * D * KT;  // [D][KT]
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
    // Keys of this tile that row r sees (rows see up to their own position).
    for (int64_t qi = 0; qi < nq; ++qi) {
      const int64_t seen = std::min(n, std::max<int64_t>(first_pos + qi - k0 + 1, 0));
      for (int64_t g = 0; g < G; ++g) s.visible[qi * G + g] = seen;
    }
    for (int64_t r = 0; r < R; r += MR) {
      const int64_t rows = std::min<int64_t>(MR, R - r);
      const int64_t seen = s.visible[r + rows - 1];  // the last row sees the most
      if (seen == 0) continue;
      const Rows tile{s.q.data() + r * D, s.o.data() + r * D, s.m.data() + r, s.l.data() + r, s.visible.data() + r};
      ROW_TILES[rows - 1][(seen + W - 1) / W - 1](tile, kt, vtile, ldv, D);
    }
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
  const float fscale = static_cast<float>(scale * std::numbers::log2e);  // scores in log2 units
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), items));
#pragma omp parallel num_threads(threads)
  {
    const FlushDenormals flush;
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
  check_causal_inputs("causal_attention", q, k, v);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(D % HEAD_DIM_MULTIPLE == 0, "causal_attention: head_dim must be a multiple of ", HEAD_DIM_MULTIPLE);
  at::Tensor out = q.new_empty({T, H, D});
  if (T == 0) return out;
  dispatch_float_types(q.scalar_type(), "causal_attention", [&](auto tag) { run<decltype(tag)>(q, k, v, out, scale); });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("causal_attention", &causal_attention); }
