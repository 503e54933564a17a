// split_linear: y = x @ W^T in float32 arithmetic on AMX's bfloat16 tiles
// (split_planes.py), for weights given as their quantised checkpoint's int8 codes and
// scales (a GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0), or as one or two stored bfloat16
// "planes" summing to them exactly (a bfloat16 or float16 checkpoint's).
//
//   split_linear(x [M, K], planes, N, sums_block, bias?, silu_mul, codes?, scales?, code_low?,
//                cos?, sin?, rope_columns) -> [M, N]
//
// x is split exactly into three bfloat16 parts, x = x0 + x1 + x2 (8 significant bits
// each, by truncation: float32's 24). Every product of two bfloat16 is exact in float32,
// and tdpbf16ps sums them in float32, so y is a float32 dot product of the exact
// weights, summed in another order than the float32 panels' FMAs (the tests hold y to
// float32's error bound for a dot product against float64).
//
// codes, scales: int8 codes in the planes' layout (below), or uint8 two a byte (codes
//   within 16 of code_low: Q4_0's, Q4_1's; split_planes.py), and each column's scale per
//   block of 32 k ([tiles, k blocks, 16]). Each thread converts a column pair's codes
//   to bfloat16 (small integers: exact; through a table where code_low says every code
//   lies in [code_low, code_low + 32)); the tiles multiply x's three parts by them, 3
//   tdpbf16ps per 16 x 16 x 32 block whatever the code type, and each block's sums take
//   their column's scale in float32 as they leave the tiles (rows_scaled).
//   Against expanding scale * code to two planes (Q8_0: three) and 5 (6) tdpbf16ps a
//   block: chained SmolLM2 products 64 rows 27.7 ms against 31.0-32.2, 1,024 rows 358
//   against 395 (docs/benchmarks.md). AVX-512's FMAs take 256 cycles for the block, a
//   tdpbf16ps 16 at best (~30 here, its tiles loaded from L2).
// planes: stored weights, W = w0 (+ w1): terms xi * wj with i + j > 2 are left out,
//   each below 2^-24 of its product, under float32's rounding of the sum (one plane: 3
//   tdpbf16ps a block, two: 5). [T, KX / 32, J, 16, 32] bfloat16: per tile of 16 output
//   columns and block of 32 k, J planes, each an AMX B tile: row q holds the column
//   pairs (W[n, 2q], W[n, 2q + 1]) of the 16 columns. With codes, only the offsets'
//   columns (the tail). For silu_mul the tiles alternate gate, up, gate, up... over the
//   same 16 columns, and y = silu(x @ gate^T) * (x @ up^T).
//
// Offsets: a Q4_1/Q5_1 weight is scale * code + offset per block of 32 k. The offsets
// ride as extra k: W's planes continue past K with the offsets of each block of
// sums_block k (zero-padded to whole tiles), and x's with its sums over those blocks,
// x_block . (offset, ...) = offset * sum(x_block). sums_block 0: no such columns.
//
// Register blocking, planes: 2 x 2 tiles of C (two 16-row tiles of x by two column tiles),
// the two A tiles of x's parts and the two B tiles of a plane reloaded each step: the 8
// tiles a core has. The four tdpbf16ps of a step are independent, which the tiles'
// latency (~3 tdpbf16ps) needs. Codes: one row tile by two column tiles, twice over (two
// steps in flight, rows_scaled), one A tile and two B tiles.
//
// cos, sin, rope_columns: a fused QKV projection rotates its first rope_columns columns
//   (q's and k's heads, D = cos's last dim each, D a multiple of 32) as rope_ would, each
//   head as soon as its thread has stored the head's columns for a block of rows: the
//   rotation reads them from L1/L2, where rope_ after the product read the whole output
//   back from memory (a 1,024-token SmolLM2 prefill: 6.6 ms of rope_).
//
// Here: the op. x's parts, the output and the planes' register block: split_tiles.h; the
// codes' conversion to bfloat16: coded_tiles.h; their register steps: coded_steps.h.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "amx_tiles.h"
#include "coded_steps.h"
#include "coded_tiles.h"
#include "kernel_common.h"
#include "rotary.h"
#include "split_tiles.h"

#if defined(TANDEM_AMX) && defined(__AVX512BF16__)
namespace {

namespace amx = tandem::amx;
using tandem::coded::CodedTiles;
using tandem::coded::convert_pair;
using tandem::coded::GROUP;
using tandem::coded::PairConversion;
using tandem::coded::rows_scaled;

using tandem::split::KT;
using tandem::split::PARTS;
using tandem::split::Product;
using tandem::split::split_row;
using tandem::split::TILE;
using tandem::split::tile_block;

// x's split parts per thread block of rows stay in L2 beside the planes being read.
constexpr int64_t SPLIT_BYTES = int64_t{1} << 20;
// Rows a thread must get before the threads split the rows rather than the column pairs.
// Split by columns, each thread reads every row of x, half of it from the cache of the
// core that wrote it (the op before split its work too), and writes half of each output
// row; split by rows, each reads and writes only its own rows, but converts every column
// pair's codes. SmolLM2, 2 threads: a 1,024-token prefill 366 ms against 387-390,
// chained products at 1,024 rows 215 against 232, 512 rows 112 against 117, 256 rows 62
// against 64, 128 rows 34.7 against 34.0 (docs/benchmarks.md). The same bits either way.
constexpr int64_t ROW_SPLIT = 128;

// The rotation of a fused QKV product's q and k heads (rope_columns).
struct Rotary {
  const float* cos;  // [M, D], rows cos_stride apart
  const float* sin;
  int64_t cos_stride, sin_stride;
  int64_t D;  // a head's columns
  int64_t pairs;  // column pairs rotated: rope_columns / 32

  int64_t pairs_per_head() const { return D / (2 * amx::COLUMNS); }
  // Whether column pair np is a rotated head's last.
  bool ends_head(int64_t np) const { return (np + 1) % pairs_per_head() == 0 && np < pairs; }
  // Rows [row0, row1) of the head whose last pair is np, rotated in place in y [M, N].
  void rotate(float* y, int64_t N, int64_t np, int64_t row0, int64_t row1) const {
    const int64_t col0 = (np + 1) * 2 * amx::COLUMNS - D;
    for (int64_t m = row0; m < row1; ++m)
      tandem::rope_row<float>(y + m * N + col0, cos + m * cos_stride, sin + m * sin_stride, 1, D);
  }
};

struct PartsTag;     // x's parts
struct ExpandedTag;  // converted codes: a column pair's, or all the thread's (kept)

}  // namespace
#endif  // TANDEM_AMX

at::Tensor split_linear(const at::Tensor& x, const at::Tensor& planes, int64_t N, int64_t sums_block,
                        const c10::optional<at::Tensor>& bias, bool silu_mul, const c10::optional<at::Tensor>& codes,
                        const c10::optional<at::Tensor>& scales, c10::optional<int64_t> code_low,
                        const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
                        int64_t rope_columns) {
#if defined(TANDEM_AMX) && defined(__AVX512BF16__)
  TORCH_CHECK(amx::permitted(), "split_linear: this process may not use AMX tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "split_linear: x must be float32 [rows, in_features] with a dense last dim");
  TORCH_CHECK(planes.dim() == 5 && planes.scalar_type() == at::kBFloat16 && planes.is_contiguous() &&
                  planes.size(3) == amx::ROWS && planes.size(4) == KT && planes.size(2) >= 1 && planes.size(2) <= 3,
              "split_linear: planes must be bfloat16 [tiles, k blocks, 1 to 3 planes, 16, 32] (split_planes.py)");
  const int64_t M = x.size(0), K = x.size(1), T = planes.size(0);
  TORCH_CHECK(codes.has_value() == scales.has_value(), "split_linear: codes come with their scales");
  const int64_t KBC = codes ? codes->size(1) : 0;  // k blocks from codes, then from planes
  const bool nibbles = codes && codes->scalar_type() == at::kByte;
  if (codes) {
    TORCH_CHECK(codes->dim() == 4 && codes->is_contiguous() && codes->size(0) == T && codes->size(2) == amx::ROWS &&
                    ((codes->scalar_type() == at::kChar && codes->size(3) == KT) ||
                     (nibbles && codes->size(3) == KT / 2)),
                "split_linear: codes must be int8 [tiles, k blocks, 16, 32], or uint8 [tiles, k blocks, 16, 16] "
                "two a byte (split_planes.py)");
    TORCH_CHECK(!nibbles || code_low, "split_linear: codes two a byte come with code_low, the least code");
    TORCH_CHECK(scales->dim() == 3 && scales->scalar_type() == at::kFloat && scales->is_contiguous() &&
                    scales->size(0) == T && scales->size(1) == KBC && scales->size(2) == amx::COLUMNS,
                "split_linear: scales must be float32 [tiles, k blocks, 16]");
  }
  TORCH_CHECK(!code_low || (codes && *code_low >= -128 && *code_low <= 127),
              "split_linear: code_low comes with codes and is an int8 value");
  const int64_t KB = KBC + planes.size(1), J = planes.size(2);
  TORCH_CHECK(K % KT == 0, "split_linear: in_features ", K, " must be a multiple of ", KT);
  TORCH_CHECK(sums_block == 0 || (sums_block % 16 == 0 && K % sums_block == 0),
              "split_linear: sums_block must be 0 or a multiple of 16 dividing in_features");
  const int64_t sum_cols = sums_block ? (K / sums_block + KT - 1) / KT * KT : 0;
  TORCH_CHECK(KB * KT == K + sum_cols, "split_linear: the planes cover ", KB * KT, " k, x with its sums ",
              K + sum_cols);
  const int64_t per_col_tile = silu_mul ? 2 : 1;
  TORCH_CHECK(T % per_col_tile == 0 && N > (T / per_col_tile - 1) * amx::COLUMNS &&
                  N <= T / per_col_tile * amx::COLUMNS,
              "split_linear: out_features ", N, " does not match ", T, " column tiles", silu_mul ? " (gated)" : "");
  if (bias) {
    TORCH_CHECK(!silu_mul, "split_linear: silu_mul takes no bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "split_linear: bias must be float32 [out_features]");
  }
  std::optional<Rotary> rotary;
  TORCH_CHECK(cos.has_value() == sin.has_value() && cos.has_value() == (rope_columns > 0),
              "split_linear: cos and sin come together, with rope_columns > 0");
  if (cos) {
    const int64_t D = cos->size(-1);
    TORCH_CHECK(!silu_mul, "split_linear: a gated product takes no rotation");
    for (const at::Tensor* t : {&*cos, &*sin}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() >= 2 && t->size(0) == M && t->numel() == M * D &&
                      t->stride(-1) == 1 && t->size(-1) == D,
                  "split_linear: cos and sin must be float32 [rows, (1,) head_dim] with a dense last dim");
    }
    TORCH_CHECK(D > 0 && D % (2 * amx::COLUMNS) == 0, "split_linear: the rotated heads' dim ", D,
                " must be a multiple of ", 2 * amx::COLUMNS);
    TORCH_CHECK(rope_columns % D == 0 && rope_columns <= N, "split_linear: rope_columns ", rope_columns,
                " must be whole heads of ", D, " within the ", N, " out_features");
    rotary = Rotary{cos->data_ptr<float>(), sin->data_ptr<float>(), cos->stride(0), sin->stride(0), D,
                    rope_columns / (2 * amx::COLUMNS)};
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const int64_t MT = (M + amx::ROWS - 1) / amx::ROWS;
  const int64_t row_tile_elems = KB * PARTS * TILE;
  // An output past the threads' L2s cannot stay in cache for the op after it: its whole
  // tiles are stored non-temporally, without reading the lines first (a 1,024-token
  // SmolLM2 prefill's gated product, 6.3 MB). Smaller ones stay plain: the op after
  // reads them from cache (a prefill's o and down, 2.4 MB, each thread's rows its own:
  // the prefill 351.0 / 359.9 ms best / median, against 365.8 / 370.4 with them
  // streamed too; decode's outputs streamed measured ~1 % slower). Not where the
  // rotation reads q and k back.
  const bool stream =
      !rotary && M * N * static_cast<int64_t>(sizeof(float)) > at::get_num_threads() * tandem::l2_bytes();
  const Product p{reinterpret_cast<const uint16_t*>(planes.data_ptr()), KB, J, M, N,
                  out.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr, silu_mul, stream};
  const CodedTiles coded{codes ? static_cast<const int8_t*>(codes->data_ptr()) : nullptr,
                         scales ? scales->data_ptr<float>() : nullptr,
                         p.planes,
                         KBC,
                         planes.size(1),
                         code_low.has_value(),
                         nibbles,
                         !code_low  ? _mm512_setzero_si512()
                         : nibbles ? tandem::coded::nibble_table(*code_low)
                                   : tandem::coded::code_table(*code_low)};
  const int64_t tile_elems = KB * J * TILE;  // a column tile's planes
  const int64_t coded_tile_elems = KBC * TILE + (KB - KBC) * J * TILE;  // its converted codes, then tail
  const float* xp = x.data_ptr<float>();
  const int64_t lda = x.stride(0);
  // Blocks of row tile pairs whose parts fit SPLIT_BYTES; within one, each thread runs
  // over its column tile pairs (all of them where it has rows of its own), and for each
  // over the block's rows.
  const int64_t pairs_m = (MT + 1) / 2, pairs_n = (T + 1) / 2;
  const int64_t block_pairs = std::max<int64_t>(1, SPLIT_BYTES / (2 * row_tile_elems * 2));
  const bool by_rows = at::get_num_threads() > 1 && M >= ROW_SPLIT * at::get_num_threads();
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), by_rows ? pairs_m : pairs_n));
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    // Rotated heads never straddle two threads: bounds within them fall on a head's start.
    const auto bound = [&](int64_t i) {
      const int64_t b = pairs_n * i / nt;
      if (!rotary || b >= rotary->pairs) return b;
      const int64_t per = rotary->pairs_per_head();
      return (b + per / 2) / per * per;
    };
    const int64_t n_begin = by_rows ? 0 : bound(t), n_end = by_rows ? pairs_n : bound(t + 1);
    const int64_t m_begin = by_rows ? pairs_m * t / nt : 0, m_end = by_rows ? pairs_m * (t + 1) / nt : pairs_m;
    const amx::Tiles tiles{8};
    // The thread's column pairs' converted codes: where there are several blocks of rows and
    // the pairs fit this core's L2, converted for the first block and kept for the rest
    // (SmolLM2's 1,024-row products 2-3 % faster, its down projection, K 1,536 in 11
    // blocks, 4-6 %: docs/benchmarks.md); else two pairs' (the one multiplied, the next),
    // converted again for each block.
    const int64_t my_pairs = n_end - n_begin, pair_elems = 2 * coded_tile_elems;
    const bool keep = codes && m_end - m_begin > block_pairs &&
                      my_pairs * pair_elems * static_cast<int64_t>(sizeof(uint16_t)) <= tandem::l2_bytes();
    uint16_t* expanded = codes ? amx::thread_buffer<ExpandedTag>((keep ? my_pairs : 2) * pair_elems) : nullptr;
    // Each thread splits the rows it multiplies itself, into its own buffer: the parts
    // another core wrote would reach this one line by line from that core's cache.
    uint16_t* parts = amx::thread_buffer<PartsTag>(std::min(MT, 2 * block_pairs) * row_tile_elems);
    for (int64_t mb = m_begin; mb < m_end; mb += block_pairs) {
      const int64_t first_tile = 2 * mb, last_tile = std::min(MT, 2 * std::min(mb + block_pairs, m_end));
      for (int64_t r = first_tile * amx::ROWS; r < last_tile * amx::ROWS; ++r) {
        uint16_t* row = parts + (r / amx::ROWS - first_tile) * row_tile_elems + r % amx::ROWS * KT;
        if (r < M) {
          split_row(xp + r * lda, K, sums_block, row);
        } else {  // rows past M: zeros, whose sums are never stored
          for (int64_t b = 0; b < KB * PARTS; ++b) std::memset(row + b * TILE, 0, KT * sizeof(uint16_t));
        }
      }
      for (int64_t np = n_begin; np < n_end; ++np) {
        const int64_t c0 = 2 * np;
        const bool two_n = c0 + 1 < T;
        if (codes) {
          // A pair's codes are converted while the tiles work on the pair before
          // (PairConversion), the thread's first pair before its products. Kept pairs have a
          // place each; else two places take turns.
          const bool converting = !keep || mb == m_begin;
          const auto conversion = [&](int64_t pair) {
            const int64_t c = 2 * pair;
            PairConversion job{&coded, c, c + 1 < T, expanded, coded_tile_elems, J, {}, {}};
            job.out += (keep ? pair - n_begin : (pair - n_begin) % 2) * pair_elems;
            if (pair + 1 < n_end) job.ahead0 = c + 2;
            if (pair + 1 < n_end && c + 3 < T) job.ahead1 = c + 3;
            return job;
          };
          const PairConversion this_pair = conversion(np);
          if (converting && np == n_begin) convert_pair(this_pair);
          std::optional<PairConversion> next;
          if (converting && np + 1 < n_end) next = conversion(np + 1);
          const uint16_t* pair = this_pair.out;
          const float* s0 = coded.scales + c0 * KBC * amx::COLUMNS;
          const float* s1 = two_n ? s0 + KBC * amx::COLUMNS : s0;
          for (int64_t m0 = first_tile; m0 < last_tile; m0 += GROUP) {
            const uint16_t* a = parts + (m0 - first_tile) * row_tile_elems;
            const int64_t G = std::min(GROUP, last_tile - m0);
            const PairConversion* n = m0 == first_tile && next ? &*next : nullptr;  // once a pair
            if (two_n) rows_scaled<true>(p, a, row_tile_elems, m0, G, c0, pair, coded_tile_elems, s0, s1, KBC, n);
            else rows_scaled<false>(p, a, row_tile_elems, m0, G, c0, pair, coded_tile_elems, s0, s1, KBC, n);
          }
        } else {
          const uint16_t* b = p.planes + c0 * tile_elems;
          for (int64_t m0 = first_tile; m0 < last_tile; m0 += 2) {
            const uint16_t* a = parts + (m0 - first_tile) * row_tile_elems;
            const bool two_m = m0 + 1 < MT;
            if (two_m && two_n) tile_block<true, true>(p, a, m0, c0, b);
            else if (two_m) tile_block<true, false>(p, a, m0, c0, b);
            else if (two_n) tile_block<false, true>(p, a, m0, c0, b);
            else tile_block<false, false>(p, a, m0, c0, b);
          }
        }
        if (rotary && rotary->ends_head(np))
          rotary->rotate(p.y, N, np, first_tile * amx::ROWS, std::min(M, last_tile * amx::ROWS));
      }
    }
    if (stream) _mm_sfence();  // the streamed stores seen before the op returns
  }
  return out;
#else
  TORCH_CHECK(false, "split_linear: the kernels were built without AMX");
  (void)x, (void)planes, (void)N, (void)sums_block, (void)bias, (void)silu_mul, (void)codes, (void)scales;
  (void)code_low, (void)cos, (void)sin, (void)rope_columns;
  return {};
#endif
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("split_linear", &split_linear); }
