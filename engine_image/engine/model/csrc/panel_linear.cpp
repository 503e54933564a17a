// panel_linear: y = x @ W^T (+ bias) in float32, over a copy of W packed into column
// panels. The CPU's projections run on it (linear.py): decode steps, prefills, the LM head.
//
//   pack_panels(W [N, K]) -> panels [P, K, NR]: panel p holds W's rows p*NR..p*NR+NR-1
//     (zero past N), transposed, so that the kernel reads each panel front to back
//     (also for narrow panels' int8 codes and their float32 scales and offsets).
//   panel_linear(x [M, K], panels, N, bias?) -> [M, N]
//   pack_gated_panels(gate, up [N, K]) and panel_linear(x, panels, N, silu_mul=True):
//     SwiGLU's silu(x @ gate^T) * (x @ up^T) in one product, each panel holding half
//     gate, half up, so that the [M, 2N] product never reaches memory (it was 2 % of
//     a SmolLM2 prefill, reading it back for silu_mul).
//   panel_linear(x, panels, N, bias?, silu_mul, codes, scales?, offsets?, code_low?): the
//     same product, for up to WIDEN_ROWS rows (small decode steps) from the weight's
//     narrow panels (coded_weight.py): int8 codes [P, K, NR] with per-block scales (and
//     offsets) [P, K / block, NR], as a quantised checkpoint stores the weight (uint8
//     [P, K / 2, NR] with code_low where they lie within 16 values: two a byte), or
//     bfloat16/float16 panels, widened in the kernel to exactly the float32 panels'
//     values: the same bits, a quarter or half of the bytes streamed.
//
// Why not oneDNN's packed inner product (which the engine used before, and still uses
// for bfloat16): at decode batch sizes the product is bound by streaming the weights
// in from memory, and oneDNN's blocked layout streams them at ~5 GB/s. A panel is
// contiguous, the hardware prefetcher follows it, and the kernel prefetches the next
// one while it computes this one. Measured on SmolLM2-135M's projections, 2 threads,
// AMD Zen 4, weights not in cache (docs/benchmarks.md): 64 rows 86 ms a step against
// oneDNN's 93.5, 1 row 13 ms against 27; 1,024 rows the same.
//
// The register tile (panel_tile.h) is MR rows x NR columns: NV vectors of W floats per
// row, summed over k in order (results differ from F.linear by summation order only).
// The threads split the columns by panels, or the rows where there are many (ROW_SPLIT);
// rows and k are blocked so that a thread's slice of x and its current panel stay in its
// L2. (Smaller k blocks, to keep a panel's slice in L1, and x packed in tile order both
// measured slower.)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernel_common.h"
#include "panel_tile.h"
#include "widening.h"

namespace {

using namespace tandem::panels;  // MR, NR, the register tiles (panel_tile.h)

constexpr int64_t A_BLOCK_FLOATS = 96 * 1024;  // x's rows per block: MB x k_block floats (384 KiB)
// Rows a thread must get before the threads split the rows rather than the panels. Split
// by panels, every thread reads every row of x, half of them from the cache of the core
// that wrote them (the product or norm before split its work too); split by rows, a
// thread reads only its own rows but streams all the panels. Chained 1,024-row products
// (a prefill's) 4-8 % faster so on a Xeon; at 64-256 rows the weights' traffic costs
// more than it saves (docs/benchmarks.md). The results are the same either way.
constexpr int64_t ROW_SPLIT = 256;
// The most rows a product widens narrow panels for (NarrowPanels below). The widening
// costs the first row tile of each panel slice a few vector operations a k step,
// which more rows share, while the bytes it saves matter less as the rows' arithmetic
// grows. Chained SmolLM2-shaped products from codes against float32 panels, a Xeon:
// 8 rows 1.6x as fast, 16 1.45x, 32 1.15x, 48 0.96x, 64 0.94x; 1,024 rows 0.88x
// (docs/benchmarks.md).
constexpr int64_t WIDEN_ROWS = 32;

// The most k a block takes: a panel's slice (k x NR floats) gets a sixth of this core's
// L2, beside x's block and the next panel's slice coming in. Where L2 is 2 MiB (a Xeon)
// the down projection's 1,536 k are one block: its 1,024-row product 6 % faster than in
// two, a prefill 1-2 %; where it is 1 MiB (AMD Zen 4) they stay two blocks of 768.
int64_t most_k_per_block() {
  static const int64_t most =
      std::max<int64_t>(256, tandem::l2_bytes() / 6 / (NR * static_cast<int64_t>(sizeof(float))));
  return most;
}

// Float32 weights, and the int8 codes and float32 scales (or offsets) of narrow panels
// (coded_weight.py), which take the same layout: a scale's row is a block of k.
bool packable_type(const at::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kChar; }

at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && packable_type(weight),
              "pack_panels: expected a float32 weight [out_features, in_features] (or int8 codes)");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + NR - 1) / NR;
  return at::constant_pad_nd(weight, {0, 0, 0, P * NR - N}).view({P, NR, K}).transpose(1, 2).contiguous();
}

// For panel_linear's silu_mul: each panel holds NR / 2 rows of gate, then the same rows
// of up, so that a tile has both halves of its outputs in registers.
at::Tensor pack_gated_panels(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && packable_type(gate) && up.sizes() == gate.sizes() &&
                  up.scalar_type() == gate.scalar_type(),
              "pack_gated_panels: expected float32 gate and up weights of one shape [out_features, in_features]"
              " (or int8 codes)");
  constexpr int64_t H = NR / 2;
  const int64_t N = gate.size(0), K = gate.size(1), P = (N + H - 1) / H;
  auto halves = [&](const at::Tensor& w) { return at::constant_pad_nd(w, {0, 0, 0, P * H - N}).view({P, H, K}); };
  return at::cat({halves(gate), halves(up)}, 1).transpose(1, 2).contiguous();
}

// Where a thread's panel slices come from. Float32 panels are read in place.
struct FloatPanels {
  const float* panels;
  int64_t K;
  const float* slice(int64_t p, int64_t k0) const { return panels + (p * K + k0) * NR; }
  // The bytes a slice is read from, for the prefetch of the next one.
  const char* source(int64_t p, int64_t k0) const { return reinterpret_cast<const char*>(slice(p, k0)); }
  int64_t source_bytes(int64_t kc) const { return kc * NR * static_cast<int64_t>(sizeof(float)); }
};

// Narrow panels (coded_weight.py): the float32 panels' values in fewer bytes, exactly.
// Codes: each weight an int8 code with a scale, and optionally an offset, for each run
// of `block` k of each column, as a quantised checkpoint stores them; the weight is
// scale * code (+ offset), exactly the value the loader's dequantisation gives
// (widening.h): ~1.1 bytes a weight; Nibbles: the same codes two a byte, rows k and
// k + 1 of a column in one (~0.6 bytes a weight). BFloat16, Half: weights that are
// exactly such values (a bfloat16 checkpoint loaded in float32): 2 bytes. The first
// row tile of a slice widens it into the thread's buffer as it multiplies by it; the
// other tiles read the buffer.
struct NarrowPanels {
  Narrow from;
  const char* codes;  // [P, K, NR] of int8, bfloat16 or float16; Nibbles: [P, K / 2, NR]
  int64_t code_bytes;  // 1 or 2; Nibbles: 1 for two rows
  const float* scales;  // Codes, Nibbles: [P, K / block, NR]
  const float* offsets;  // same, or null: no offset
  int64_t K, blocks_per_k;  // K / block
  int64_t code_block;
  float low;  // Nibbles: the least code
  float* buffer;  // the thread's, k_block x NR floats

  Widening widening(int64_t p, int64_t k0) const {
    const int64_t b = p * blocks_per_k + k0 / code_block;
    return {source(p, k0), scales ? scales + b * NR : nullptr, offsets ? offsets + b * NR : nullptr, code_block,
            low, buffer};
  }
  // Rows per byte row: Nibbles' k0 is even (a whole code block's).
  int64_t per_row() const { return from == Narrow::Nibbles ? 2 : 1; }
  const char* source(int64_t p, int64_t k0) const { return codes + (p * K + k0) / per_row() * NR * code_bytes; }
  int64_t source_bytes(int64_t kc) const { return kc / per_row() * NR * code_bytes; }
};

// One thread's share of the product: its panels (or rows), each k block's slices from
// `src`, computed by the register tiles.
struct Work {
  const float* a;
  int64_t lda, M, K, N, P, OC, k_block, MB, partial_ld;
  float* c;
  float* pc;
  bool silu_mul, by_rows;
  const float* bias;
};

template <typename Source>
void thread_share(const Work& w, const Source& src, int64_t t, int64_t nt) {
  // Each thread owns a contiguous run of panels (its columns of the output), or of
  // whole register tiles of rows.
  const int64_t M = w.M, K = w.K, N = w.N, P = w.P, MB = w.MB;
  const int64_t p0 = w.by_rows ? 0 : P * t / nt, p1 = w.by_rows ? P : P * (t + 1) / nt;
  const int64_t row_tiles = (M + MR - 1) / MR;
  const int64_t m_begin = w.by_rows ? row_tiles * t / nt * MR : 0;
  const int64_t m_end = w.by_rows ? std::min(M, row_tiles * (t + 1) / nt * MR) : M;
  for (int64_t k0 = 0; k0 < K; k0 += w.k_block) {
    const int64_t kc = std::min(w.k_block, K - k0);
    const bool last = k0 + kc == K;
    for (int64_t m0 = m_begin; m0 < m_end; m0 += MB) {
      const int64_t rows = std::min(MB, m_end - m0);
      const int64_t tiles = (rows + MR - 1) / MR;
      // The next panel's slice: spread its lines over the tiles.
      const int64_t lines = (src.source_bytes(kc) + LINE - 1) / LINE;  // >= 1
      const int64_t steps = tiles * kc;  // k steps over the tiles
      const int64_t per_k = (lines + steps - 1) / steps, every = std::max<int64_t>(1, steps / lines);
      const int64_t tile_lines = (kc + every - 1) / every * per_k;
      for (int64_t p = p0; p < p1; ++p) {
        constexpr bool coded = std::is_same_v<Source, NarrowPanels>;
        Widening wd;
        const float* slice;
        if constexpr (coded) {
          wd = src.widening(p, k0), slice = wd.out;
          // A lone row tile (up to 8 rows) is the only reader of its floats: not
          // storing them made 1-4 row products 15-20 % faster.
          if (tiles == 1) wd.out = nullptr;
        } else {
          slice = src.slice(p, k0);
        }
        // The panel computed next: this one's neighbour, else the run's first panel
        // for the next block of rows (it has left L2 since this block began).
        const char* next = p + 1 < p1 ? src.source(p + 1, k0) : m0 + MB < m_end ? src.source(p0, k0) : nullptr;
        // The panel's columns in the partial sums; in the output, once the last k block is in.
        const int64_t partial_cols = std::min<int64_t>(NR, w.partial_ld - p * NR);
        for (int64_t ti = 0; ti < tiles; ++ti) {
          const int64_t m = m0 + ti * MR;
          Sums sums;
          if (k0 > 0) sums = {w.pc + m * w.partial_ld + p * NR, w.partial_ld, partial_cols};
          if (last) {
            sums.to = w.c + m * N + p * w.OC, sums.to_ld = N, sums.to_cols = std::min(w.OC, N - p * w.OC);
            sums.silu_mul = w.silu_mul;
            if (w.bias) sums.bias = w.bias + p * w.OC;
          } else {
            sums.to = w.pc + m * w.partial_ld + p * NR, sums.to_ld = w.partial_ld, sums.to_cols = partial_cols;
          }
          Prefetch pf;
          if (next && ti * tile_lines < lines) pf = {next + ti * tile_lines * LINE, per_k, every};
          const Tiles* tiles = &TILES;
          if constexpr (coded) {
            if (ti == 0) tiles = &widening_tiles(src.from);
          }
          (*tiles)[std::min<int64_t>(MR, M - m) - 1](w.a + m * w.lda + k0, w.lda, slice, kc, sums, pf, &wd);
        }
      }
    }
  }
}

// A thread's buffer for widened slices: OpenMP's threads persist, so it is allocated
// once per thread, not per product (a fresh one each call faulted in its pages).
float* widening_buffer(int64_t floats) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N, const c10::optional<at::Tensor>& bias,
                        bool silu_mul, const c10::optional<at::Tensor>& codes, const c10::optional<at::Tensor>& scales,
                        const c10::optional<at::Tensor>& offsets, c10::optional<int64_t> code_low) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "panel_linear: x must be float32 [rows, in_features] with a dense last dim");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == NR && panels.scalar_type() == at::kFloat &&
                  panels.is_contiguous(),
              "panel_linear: panels must come from pack_panels");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  const int64_t OC = silu_mul ? NR / 2 : NR;  // output columns per panel
  TORCH_CHECK(panels.size(1) == K, "panel_linear: x has ", K, " features, the weight ", panels.size(1));
  TORCH_CHECK(N > (P - 1) * OC && N <= P * OC, "panel_linear: out_features ", N, " does not match the packed weight (",
              P, " panels of ", OC, " output columns)");
  // int8 codes (uint8, two a byte) come with scales (and maybe offsets); bfloat16 or
  // float16 ones alone.
  const at::ScalarType code_type = codes ? codes->scalar_type() : at::kFloat;
  const Narrow from = code_type == at::kChar       ? Narrow::Codes
                      : code_type == at::kByte     ? Narrow::Nibbles
                      : code_type == at::kBFloat16 ? Narrow::BFloat16
                                                   : Narrow::Half;
  const bool coded = code_type == at::kChar || code_type == at::kByte;
  TORCH_CHECK(!codes || coded || code_type == at::kBFloat16 || code_type == at::kHalf,
              "panel_linear: codes must be int8 (or uint8, two a byte), bfloat16 or float16 panels");
  TORCH_CHECK((codes && coded) == scales.has_value() && (scales || !offsets),
              "panel_linear: int8 codes come with scales (and offsets only with both), 16-bit ones alone");
  TORCH_CHECK((from == Narrow::Nibbles) == code_low.has_value(),
              "panel_linear: code_low comes with codes two a byte (uint8), and they with it");
  int64_t code_block = 1;
  if (codes) {
    const bool shaped = from == Narrow::Nibbles
                            ? codes->dim() == 3 && codes->size(0) == P && codes->size(1) * 2 == K && codes->size(2) == NR
                            : codes->sizes() == panels.sizes();
    TORCH_CHECK(shaped && codes->is_contiguous(),
                "panel_linear: codes must be panels shaped as the float32 ones (pack_coded), two a byte: half "
                "the rows");
  }
  if (scales) {
    TORCH_CHECK(scales->dim() == 3 && scales->size(0) == P && scales->size(2) == NR && scales->size(1) > 0 &&
                    K % scales->size(1) == 0 && scales->scalar_type() == at::kFloat && scales->is_contiguous(),
                "panel_linear: scales must be float32 [panels, in_features / block, ", NR, "]");
    TORCH_CHECK(from != Narrow::Nibbles || (K / scales->size(1)) % 2 == 0,
                "panel_linear: codes two a byte need blocks of an even number of inputs");
    TORCH_CHECK(!offsets || (offsets->sizes() == scales->sizes() && offsets->scalar_type() == at::kFloat &&
                             offsets->is_contiguous()),
                "panel_linear: offsets must be shaped as the scales");
    code_block = K / scales->size(1);
  }
  if (bias) {
    TORCH_CHECK(!silu_mul, "panel_linear: silu_mul takes no bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "panel_linear: bias must be float32 [out_features]");
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  if (K == 0) {  // an empty sum (and silu(0) * 0 is 0)
    bias ? out.copy_(bias->expand({M, N})) : out.zero_();
    return out;
  }
  const int64_t most_threads = at::get_num_threads();
  const bool by_rows = most_threads > 1 && M >= ROW_SPLIT * most_threads;
  const bool widen = codes && M <= WIDEN_ROWS;
  // K in equal blocks (576 is one; 1,536 one or two, by L2): a short last block would
  // cost a pass over the output for little work. Widened, the blocks hold whole code
  // blocks (a slice's scales change only between them).
  const int64_t most_k = most_k_per_block();
  const int64_t k_blocks = (K + most_k - 1) / most_k;
  const int64_t unit = widen ? code_block : 1;
  const int64_t k_block = ((K + k_blocks - 1) / k_blocks + unit - 1) / unit * unit;
  const int64_t MB = std::max<int64_t>(MR, A_BLOCK_FLOATS / k_block / MR * MR);
  // Sums between k blocks: in the output, except that silu_mul's keeps half a panel's
  // columns, so that its partial sums need whole panels of their own.
  at::Tensor partial = silu_mul && k_block < K ? at::empty({M, P * NR}, x.options()) : out;
  const Work w{x.data_ptr<float>(), x.stride(0), M, K, N, P, OC, k_block, MB, partial.size(1),
               out.data_ptr<float>(), partial.data_ptr<float>(), silu_mul, by_rows,
               bias ? bias->data_ptr<float>() : nullptr};
  const int threads = static_cast<int>(by_rows ? most_threads : std::min(most_threads, P));
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    if (widen) {
      const NarrowPanels src{from,
                            static_cast<const char*>(codes->data_ptr()),
                            static_cast<int64_t>(codes->element_size()),
                            scales ? scales->data_ptr<float>() : nullptr,
                            offsets ? offsets->data_ptr<float>() : nullptr,
                            K,
                            scales ? scales->size(1) : K,
                            code_block,
                            static_cast<float>(code_low.value_or(0)),
                            widening_buffer(k_block * NR)};
      thread_share(w, src, t, nt);
    } else {
      thread_share(w, FloatPanels{panels.data_ptr<float>(), K}, t, nt);
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("pack_gated_panels", &pack_gated_panels);
  m.impl("panel_linear", &panel_linear);
}
