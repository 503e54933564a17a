// split_causal_attention: causal_attention's contract (prefill_attention.cpp) for float32
// q, k, v, computed in float32 arithmetic on AMX's bfloat16 tiles, as split_linear.cpp
// computes the projections: every float32 operand split exactly into three bfloat16 parts
// (amx::split_parts), the terms ai * bj with i + j <= 2 multiplied on the tiles (6
// tdpbf16ps a 16 x 16 x 32 block; the others lie below 2^-24 of their product), summed in
// float32. Built with cpu_kernels.cpp, which declares the op.
//
// One work item per (KV head, block of QB = 32 query positions), as the FMA kernel's,
// for the KV head's G query heads, each as two 16-row tiles of queries, head by head:
//   1. scores S [32, keys seen] = Q K^T on the tiles (log2 units: the query scale
//      includes log2(e)), stored to the thread's buffer;
//   2. each row's softmax over its visible keys in float32 (max, exp2, sum: exact max,
//      no online rescaling, as the whole row is at hand), its probabilities split into
//      the three parts of P's A tiles (masked keys: zeros): RowSoftmax, run in small
//      steps between the tile instructions of the next head's QK (the last head's:
//      the first head's PV), so that the vector units work while the tiles multiply;
//   3. O [32, D] = P V on the tiles, divided by each row's sum on the way out.
// K and V are split once per call into B-tile planes that every block reads (K's:
// [KVH][key tiles of 16][D / 32][3][16 head-dim pairs][16 keys][2]; V's:
// [KVH][key blocks of 32][D / 16][3][16 key pairs][16 head dims][2]), zero past the
// context.
//
// Register blocking: 2 x 2 C tiles (the two row tiles by two column tiles: 32 keys of S,
// or 32 head dims of O), two A tiles and two B tiles reloaded each term, the 8 tiles a
// core has; a part of A is loaded once for the planes of B it meets.
//
// Measured (SmolLM2's 1,024-token prefill layer, a Xeon, 2 threads): 2.6-3.4 ms (the
// machine's speed moves by ~20 %), against the FMA kernel's 3.8-4.9. In one process,
// in turn: the tiles alone ~2.2 ms a layer (QK ~7.7 ns a tdpbf16ps, PV ~10: their A and
// B tiles from L2; ~4.9 ns from L1); the softmax adds ~0.7 ms run between the tiles'
// instructions, ~1.2 run on its own (docs/benchmarks.md).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numbers>

#include "amx_tiles.h"
#include "kernel_common.h"

#if defined(TANDEM_AMX) && defined(__AVX512BF16__) && defined(__AVX512F__)
namespace {

namespace amx = tandem::amx;
using namespace tandem;

constexpr int PARTS = amx::PARTS;
constexpr int64_t TILE = amx::TILE_ELEMS;  // bfloat16 in a tile (512)
constexpr int64_t KB = amx::TILE_K;        // k a tile covers: keys of P, head dims of Q (32)
constexpr int64_t COLS = amx::COLUMNS;     // C's columns: keys of S, head dims of O (16)
constexpr int64_t QB = 2 * amx::ROWS;      // query positions per work item: two row tiles
constexpr int64_t LD = amx::ROW_BYTES;

struct Shapes {
  int64_t queries, context, H, KVH, D;
  int64_t key_blocks;  // of KB keys, covering the context
  int64_t DB() const { return D / KB; }     // head-dim blocks of a Q tile row
  int64_t DT() const { return D / COLS; }   // head-dim tiles of O
  // Each KV head's planes: K's (two key tiles a key block), then V's.
  int64_t k_elems() const { return key_blocks * 2 * DB() * PARTS * TILE; }
  int64_t v_elems() const { return key_blocks * DT() * PARTS * TILE; }
  int64_t head_elems() const { return k_elems() + v_elems(); }
};

// K's planes of key tile kt (16 keys) of one head: B tiles whose row q holds, for each of
// the 16 keys, the pair of head dims (32 db + 2q, 32 db + 2q + 1): the transpose, in pairs,
// of the keys' split rows.
void split_key_tile(const float* k, int64_t k_stride, int64_t first, int64_t context, const Shapes& s,
                    uint16_t* planes) {
  alignas(64) uint32_t rows[amx::COLUMNS][PARTS][amx::PAIRS];  // a key's parts of one db
  for (int64_t db = 0; db < s.DB(); ++db) {
    for (int64_t n = 0; n < amx::COLUMNS; ++n) {
      uint16_t* row = reinterpret_cast<uint16_t*>(rows[n]);
      if (first + n < context) {
        const float* src = k + (first + n) * k_stride + db * KB;
        amx::split_parts(_mm512_loadu_ps(src), _mm512_loadu_ps(src + 16), row, KB);
      } else {
        std::memset(row, 0, sizeof(rows[n]));
      }
    }
    uint32_t* out = reinterpret_cast<uint32_t*>(planes + db * PARTS * TILE);
    for (int p = 0; p < PARTS; ++p, out += TILE / 2) {
      for (int q = 0; q < amx::PAIRS; ++q)
        for (int n = 0; n < amx::COLUMNS; ++n) out[q * amx::COLUMNS + n] = rows[n][p][q];
    }
  }
}

// P's rows hold each key block's parts in amx::LaneInterleaved's order (vpackusdw: per
// 128-bit lane, 4 keys of the first 16, then 4 of the next; against vcvtne2ps2bf16 in key
// order, no clear difference measured), and V's planes pair their keys in the same order:
// the key (of a block's 32) at position w of a row.
constexpr int64_t key_at(int64_t w) { return w / 8 * 4 + w % 4 + (w % 8 >= 4 ? 16 : 0); }

// V's planes of key block b (32 keys) of one head: B tiles whose row q holds, for each of
// 16 head dims, the pair of keys at positions 2q and 2q + 1 of P's rows (key_at): each
// part's bits of the first in a pair's low half, of the second in its high half.
void split_value_block(const float* v, int64_t v_stride, int64_t first, int64_t context, const Shapes& s,
                       uint16_t* planes) {
  for (int64_t dt = 0; dt < s.DT(); ++dt) {
    uint16_t* tile = planes + dt * PARTS * TILE;
    for (int q = 0; q < amx::PAIRS; ++q) {
      const int64_t k0 = first + key_at(2 * q), k1 = first + key_at(2 * q + 1);
      const __m512 a = k0 < context ? _mm512_loadu_ps(v + k0 * v_stride + dt * COLS) : _mm512_setzero_ps();
      const __m512 b = k1 < context ? _mm512_loadu_ps(v + k1 * v_stride + dt * COLS) : _mm512_setzero_ps();
      amx::split_parts(a, b, tile + q * 2 * COLS, TILE, amx::Pairs{});
    }
  }
}

// C tiles 0..3 = sum over `blocks` k blocks of the terms ai * bj (i + j <= 2): A tiles 4, 5
// (row tiles 0, 1: a0 and a0 + a_step, PARTS tiles a block), B tiles 6, 7 (column tiles 0, 1:
// b0 and b0 + b_step, PARTS tiles a block, blocks b_block apart).
// Between each term's four tdpbf16ps, `between()`: vector work that runs while they are on
// the tiles (the tiles take ~17 ns for four; the vector units are otherwise idle).
template <class Between>
inline void products(const uint16_t* a0, int64_t a_step, const uint16_t* b0, int64_t b_step, int64_t b_block,
                     int64_t blocks, Between&& between) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < blocks; ++kb, a0 += PARTS * TILE, b0 += b_block) {
    for (int i = 0; i < PARTS; ++i) {
      _tile_loadd(4, a0 + i * TILE, LD);
      _tile_loadd(5, a0 + a_step + i * TILE, LD);
      for (int j = 0; i + j < PARTS; ++j) {
        _tile_loadd(6, b0 + j * TILE, LD);
        _tile_loadd(7, b0 + b_step + j * TILE, LD);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        between();
      }
    }
  }
}

constexpr int64_t TERMS = PARTS * (PARTS + 1) / 2;  // ai * bj with i + j <= 2: 6

// C tiles 0..3 to the 32 x 32 block at c (rows ldc floats apart).
inline void store_block(float* c, int64_t ldc) {
  const int64_t stride = ldc * static_cast<int64_t>(sizeof(float));
  _tile_stored(0, c, stride);
  _tile_stored(1, c + COLS, stride);
  _tile_stored(2, c + amx::ROWS * ldc, stride);
  _tile_stored(3, c + amx::ROWS * ldc + COLS, stride);
}

// One query head's softmax over its QB rows of scores, in small steps (a row's max, or
// one key block of a row's probabilities) so that it can run between the tile
// instructions of another head's products: each row's exact softmax over its visible
// keys (max, exp2, sum in float32, the whole row at hand: no online rescaling), its
// probabilities split into P's A tiles (masked keys and rows past the queries: zeros),
// its sum to `sums`.
class RowSoftmax {
 public:
  RowSoftmax() = default;  // nothing to do
  RowSoftmax(const float* scores, int64_t ld, int64_t blocks, int64_t first_pos, int64_t nq, uint16_t* p,
             int64_t p_tile, float* sums)
      : scores_(scores), ld_(ld), blocks_(blocks), first_pos_(first_pos), nq_(nq), p_(p), p_tile_(p_tile),
        sums_(sums), rows_(QB) {}

  int64_t steps() const { return rows_ * (blocks_ + 1); }  // at most, from the start
  void run(int64_t n) {
    for (; n > 0 && r_ < rows_; --n) step();
  }
  void finish() { run(steps()); }

 private:
  using V = wvec;  // 16 lanes with AVX-512

  uint16_t* row_tiles(int64_t r) const { return p_ + r / amx::ROWS * p_tile_ + r % amx::ROWS * KB; }

  void step() {
    const int32_t limit = static_cast<int32_t>(first_pos_ + r_ + 1);  // keys row r_ sees
    const float* s = scores_ + r_ * ld_;
    if (r_ >= nq_) {  // past the queries: zeros, never stored
      uint16_t* dst = row_tiles(r_);
      for (int64_t b = 0; b < blocks_ * PARTS; ++b) std::memset(dst + b * TILE, 0, KB * sizeof(uint16_t));
      ++r_;
    } else if (b_ < 0) {
      row_max(s, limit);
      b_ = 0;
    } else {
      const wint lane = lanes<wint>();
      const int32_t j = static_cast<int32_t>(b_ * KB);
      V e[2];
      for (int h = 0; h < 2; ++h) {
        const int32_t jh = j + h * W;
        e[h] = jh < limit ? vexp2_nonpositive(vload<V>(s + jh) - max_) : V{};
        if (jh + W > limit) e[h] = lane + jh < limit ? e[h] : V{};
        sum_ += e[h];
      }
      amx::split_parts((__m512)e[0], (__m512)e[1], row_tiles(r_) + b_ * PARTS * TILE, TILE,
                       amx::LaneInterleaved{});
      if (++b_ == blocks_) {
        sums_[r_++] = hsum(sum_);
        b_ = -1;
      }
    }
  }

  // Two chains for vmaxps's latency; whole vectors, then the last one's visible lanes.
  void row_max(const float* s, int32_t limit) {
    const wint lane = lanes<wint>();
    const int32_t whole = limit / W * W;
    V top0 = broadcast<V>(-std::numeric_limits<float>::infinity()), top1 = top0;
    int32_t j = 0;
    for (; j + W < whole; j += 2 * W) {
      const V x0 = vload<V>(s + j), x1 = vload<V>(s + j + W);
      top0 = x0 > top0 ? x0 : top0;
      top1 = x1 > top1 ? x1 : top1;
    }
    for (; j < limit; j += W) {
      const V x = vload<V>(s + j);
      top0 = lane + j < limit && x > top0 ? x : top0;
    }
    max_ = broadcast<V>(hmax(top0 > top1 ? top0 : top1));
    sum_ = V{};
  }

  const float* scores_ = nullptr;
  int64_t ld_ = 0, blocks_ = 0, first_pos_ = 0, nq_ = 0;
  uint16_t* p_ = nullptr;
  int64_t p_tile_ = 0;
  float* sums_ = nullptr;
  int64_t rows_ = 0;  // QB, or 0: nothing to do
  int64_t r_ = 0;     // the row in progress
  int64_t b_ = -1;    // its next key block, or -1: its max first
  V max_{}, sum_{};
};

struct QTag;  // thread buffers: the queries' A tiles,
struct PTag;  // the probabilities',
struct STag;  // the scores, then the outputs,
struct SumTag;  // the probabilities' sums

struct Problem {
  const float* q;
  float* out;  // [T, H, D] contiguous
  int64_t q_stride;
  const uint16_t* planes;  // every KV head's K and V planes
  float scale;  // softmax scale times log2(e)
  Shapes s;
};

// Query positions q0 .. q0 + QB (clipped to T) of KV head h's G query heads.
void attend_block(const Problem& pr, int64_t h, int64_t q0) {
  const Shapes& s = pr.s;
  const int64_t G = s.H / s.KVH, D = s.D;
  const int64_t nq = std::min(QB, s.queries - q0);
  const int64_t first_pos = s.context - s.queries + q0;
  const int64_t blocks = (first_pos + nq + KB - 1) / KB;  // key blocks the rows see
  const int64_t ld = blocks * KB;  // scores per row in the buffer
  const int64_t q_tile = s.DB() * PARTS * TILE, p_tile = blocks * PARTS * TILE;
  // Each query head's: two row tiles of Q's parts, QB rows of scores (then outputs).
  uint16_t* qa = amx::thread_buffer<QTag>(G * 2 * q_tile);
  uint16_t* pa = amx::thread_buffer<PTag>(G * 2 * p_tile);  // each head's P tiles
  const int64_t sc_head = QB * std::max(ld, D);
  float* sc = reinterpret_cast<float*>(amx::thread_buffer<STag>(2 * G * sc_head));
  alignas(64) float x[KB];  // a query row's KB head dims, scaled
  const uint16_t* kp = pr.planes + h * s.head_elems();
  const uint16_t* vp = kp + s.k_elems();
  const int64_t k_block = 2 * s.DB() * PARTS * TILE;  // a key block's K planes
  for (int64_t g = 0; g < G; ++g) {
    const int64_t head = h * G + g;
    for (int64_t r = 0; r < QB; ++r) {
      uint16_t* dst = qa + (2 * g + r / amx::ROWS) * q_tile + r % amx::ROWS * KB;
      for (int64_t db = 0; db < s.DB(); ++db) {
        if (r < nq) {
          load_scaled_row(x, pr.q + (q0 + r) * pr.q_stride + head * D + db * KB, pr.scale, KB);
        } else {
          std::fill(x, x + KB, 0.0f);  // rows past the queries: never stored
        }
        amx::split_parts(_mm512_load_ps(x), _mm512_load_ps(x + 16), dst + db * PARTS * TILE, TILE);
      }
    }
  }
  // The tiles multiply head by head, QK then PV, and each head's softmax runs on the
  // vector units between the tile instructions of the phase after its QK:
  //   QK 0 | QK 1 + softmax 0 | ... | QK G-1 + softmax G-2 | PV 0 + softmax G-1 | PV 1 | ...
  float* sums = reinterpret_cast<float*>(amx::thread_buffer<SumTag>(2 * G * QB));  // each head's rows'
  const auto softmax = [&](int64_t g) {
    return RowSoftmax(sc + g * sc_head, ld, blocks, first_pos, nq, pa + g * 2 * p_tile, p_tile, sums + g * QB);
  };
  // Spread a softmax's steps evenly over a phase's `calls` (each between four tdpbf16ps).
  const auto alongside = [](RowSoftmax& work, int64_t calls) {
    const int64_t each = (work.steps() + calls - 1) / calls;
    return [&work, each] { work.run(each); };
  };
  RowSoftmax pending;  // the head before's
  for (int64_t g = 0; g < G; ++g) {
    const auto between = alongside(pending, blocks * s.DB() * TERMS);
    for (int64_t b = 0; b < blocks; ++b) {
      products(qa + 2 * g * q_tile, q_tile, kp + b * k_block, s.DB() * PARTS * TILE, PARTS * TILE, s.DB(), between);
      store_block(sc + g * sc_head + b * KB, ld);
    }
    pending.finish();
    pending = softmax(g);
  }
  for (int64_t g = 0; g < G; ++g) {
    float* scores = sc + g * sc_head;
    if (g == G - 1) pending.finish();  // the last head's softmax: its own PV is next
    const auto between = alongside(pending, s.DT() / 2 * blocks * TERMS);
    for (int64_t d0 = 0; d0 < s.DT(); d0 += 2) {
      products(pa + g * 2 * p_tile, p_tile, vp + d0 * PARTS * TILE, PARTS * TILE, s.DT() * PARTS * TILE, blocks,
               between);
      store_block(scores + d0 * COLS, D);
    }
    for (int64_t r = 0; r < nq; ++r) {  // sums >= 1: every row sees its own key
      store_row(pr.out + ((q0 + r) * s.H + h * G + g) * D, scores + r * D, 1.0f / sums[g * QB + r], D);
    }
  }
}

void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, double scale) {
  Shapes s{q.size(0), k.size(0), q.size(1), k.size(1), q.size(2), 0};
  s.key_blocks = (s.context + KB - 1) / KB;
  const std::unique_ptr<uint16_t[]> planes(new uint16_t[s.KVH * s.head_elems()]);
  const Problem pr{q.data_ptr<float>(), out.data_ptr<float>(), q.stride(0), planes.get(),
                   static_cast<float>(scale * std::numbers::log2e), s};
  const float* kd = k.data_ptr<float>();
  const float* vd = v.data_ptr<float>();
  const int64_t splits = s.KVH * s.key_blocks;
  const int64_t blocks = (s.queries + QB - 1) / QB, items = blocks * s.KVH;
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), std::max(items, splits)));
#pragma omp parallel num_threads(threads)
  {
    const FlushDenormals flush;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < splits; ++i) {
      const int64_t h = i / s.key_blocks, b = i % s.key_blocks;
      uint16_t* kp = planes.get() + h * s.head_elems();
      for (int t = 0; t < 2; ++t) {
        split_key_tile(kd + h * s.D, k.stride(0), b * KB + t * COLS, s.context, s,
                       kp + (2 * b + t) * s.DB() * PARTS * TILE);
      }
      split_value_block(vd + h * s.D, v.stride(0), b * KB, s.context, s,
                        kp + s.k_elems() + b * s.DT() * PARTS * TILE);
    }  // the barrier: every plane is ready
    const amx::Tiles tiles{8};
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      // A KV head's blocks in turn, so that its K and V planes stay in the threads' L2s
      // (SmolLM2's, 1,024 tokens: 768 KB a head, 2.3 MB all three; the heads taken in
      // turn, a layer took 2.87 against 2.68 ms); the latest blocks first: they see
      // the most context, the short ones fill in.
      attend_block(pr, item / blocks, (blocks - 1 - item % blocks) * QB);
    }
  }
}

}  // namespace
#endif  // TANDEM_AMX

at::Tensor split_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  tandem::check_causal_inputs("split_causal_attention", q, k, v);
  TORCH_CHECK(q.scalar_type() == at::kFloat, "split_causal_attention: q, k, v must be float32");
  TORCH_CHECK(q.size(2) % 32 == 0, "split_causal_attention: head_dim must be a multiple of 32");
  at::Tensor out = q.new_empty({q.size(0), q.size(1), q.size(2)});
#if defined(TANDEM_AMX) && defined(__AVX512BF16__) && defined(__AVX512F__)
  TORCH_CHECK(tandem::amx::permitted(), "split_causal_attention: the OS does not grant this process AMX's tiles");
  if (q.size(0) > 0) run(q, k, v, out, scale);
  return out;
#else
  TORCH_CHECK(false, "split_causal_attention: the kernels were built without AMX");
  (void)scale;
  return out;
#endif
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("split_causal_attention", &split_causal_attention); }
