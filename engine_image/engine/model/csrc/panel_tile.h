// The register tile of the float32 panel kernel (panel_linear.cpp): MR rows of x times
// one panel's slice, its NR columns held in registers over k, the sums stored (or
// carried to the next k block) as the tile ends; WIDEN tiles widen a narrow slice
// (widening.h) as they read it.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "kernel_common.h"
#include "widening.h"

namespace tandem::panels {

using tandem::as_floats;
using tandem::bf16_floats;
using tandem::half_floats;
using tandem::nibble_floats;
using tandem::nibble_values;
using tandem::Narrow;
using tandem::vload;
using tandem::vstore;
using tandem::W;
using tandem::widen;
using tandem::Widening;
using tandem::wvec;

// Rows of the register tile: MR x 3 accumulators, of 32 registers with AVX-512, of 16
// without.
#if defined(__AVX512F__)
constexpr int MR = 8;
#else
constexpr int MR = 4;
#endif
constexpr int NV = 3;        // vectors across a panel
constexpr int NR = NV * W;   // a panel's columns
constexpr int64_t LINE = 64;  // bytes of a cache line
// How many k steps ahead a tile asks for its panel rows in L1. The panel's slice sits
// in L2 (k_block x NR floats do not fit L1), and the L1 prefetcher alone left the FMAs
// waiting on it: on a Xeon, 1,024-row products 3-5 % faster, 64 rows ~2 % (distances
// 16-32 alike, docs/benchmarks.md).
constexpr int64_t L1_AHEAD = 24;

// What one register tile prefetches of the panel the thread computes next: per_k cache
// lines every `every` k steps from `from` on, so that the memory traffic spreads over the
// panel's tiles (`every` rounds down: the last tile or two may fetch nothing). In a burst
// over the first few tiles, the next panel's lines queued behind each other: 7 % slower
// products at 64 rows on a Xeon.
struct Prefetch {
  const char* from = nullptr;
  int64_t per_k = 0;  // lines a time
  int64_t every = 1;  // k steps between times
};

// Where a register tile's sums start from and where they go.
struct Sums {
  const float* from = nullptr;  // earlier k blocks' partial sums, or null: start at 0
  int64_t from_ld = 0, from_cols = 0;  // its row stride; the panel's columns it holds
  float* to = nullptr;
  int64_t to_ld = 0, to_cols = 0;  // the row stride; the output columns this panel fills
  bool silu_mul = false;  // store silu(panel's first half) * its second half
  const float* bias = nullptr;  // added as the sums are stored (the last k block only)
};

// Sums over k of a[0..R) x [0..kc) . b, with b a panel slice [kc, NR] and a's rows lda
// apart, added to `sums.from` and stored at `sums.to`. WIDEN: the tile widens the
// narrow slice (FROM) as it goes, and leaves the floats at wd->out (b) where not null.
template <int R, bool WIDEN, Narrow FROM = Narrow::Codes>
void tile(const float* a, int64_t lda, const float* b, int64_t kc, const Sums& sums, Prefetch pf,
          const Widening* wd) {
  // The lines the tile ends with, its rows of `to` (for writing), asked for now,
  // kc * R * NV FMAs ahead of the stores; without, each missed at the end of the tile.
  // (Earlier k blocks' sums sit in the same lines, except silu_mul's partial buffer.)
  for (int r = 0; r < R; ++r) {
    const float* row = sums.to + r * sums.to_ld;
    for (int64_t i = 0; i < sums.to_cols; i += LINE / sizeof(float)) __builtin_prefetch(row + i, 1, 3);
    __builtin_prefetch(row + sums.to_cols - 1, 1, 3);  // rows need not start on a line
  }
  wvec acc[R][NV];
  for (int r = 0; r < R; ++r) {
    if (!sums.from) {
      for (int v = 0; v < NV; ++v) acc[r][v] = wvec{};
    } else if (sums.from_cols == NR) {
      for (int v = 0; v < NV; ++v) acc[r][v] = vload<wvec>(sums.from + r * sums.from_ld + v * W);
    } else {  // the last panel, past the output's last column
      float row[NR] = {};
      std::memcpy(row, sums.from + r * sums.from_ld, sums.from_cols * sizeof(float));
      for (int v = 0; v < NV; ++v) acc[r][v] = vload<wvec>(row + v * W);
    }
  }
  const char* fetch = pf.from;
  int64_t countdown = pf.per_k ? 1 : -1;  // never 0 without lines to fetch
  const float* scale = WIDEN ? wd->scales : nullptr;
  const float* offset = WIDEN ? wd->offsets : nullptr;
  int64_t in_block = 0;
  const wvec values = FROM == Narrow::Nibbles ? nibble_values(wd->low) : wvec{};  // a nibble's code
  for (int64_t k = 0; k < kc; ++k) {
    const float* bk = b + k * NR;
    wvec b0, b1, b2;
    if constexpr (WIDEN && (FROM == Narrow::Codes || FROM == Narrow::Nibbles)) {
      wvec q0, q1, q2;
      if constexpr (FROM == Narrow::Codes) {
        const int8_t* c = static_cast<const int8_t*>(wd->codes) + k * NR;
        __builtin_prefetch(c + L1_AHEAD * NR, 0, 3);
        q0 = as_floats(c), q1 = as_floats(c + W), q2 = as_floats(c + 2 * W);
      } else {  // rows k and k + 1 share their bytes (k0 is even)
        const uint8_t* c = static_cast<const uint8_t*>(wd->codes) + k / 2 * NR;
        if (k % 2 == 0) {
          __builtin_prefetch(c + L1_AHEAD * NR / 2, 0, 3);
          q0 = nibble_floats<false>(c, values), q1 = nibble_floats<false>(c + W, values);
          q2 = nibble_floats<false>(c + 2 * W, values);
        } else {
          q0 = nibble_floats<true>(c, values), q1 = nibble_floats<true>(c + W, values);
          q2 = nibble_floats<true>(c + 2 * W, values);
        }
      }
      b0 = widen(q0, scale, offset);
      b1 = widen(q1, scale + W, offset ? offset + W : nullptr);
      b2 = widen(q2, scale + 2 * W, offset ? offset + 2 * W : nullptr);
      if (++in_block == wd->block) {
        in_block = 0;
        scale += NR;
        if (offset) offset += NR;
      }
    } else if constexpr (WIDEN) {
      const uint16_t* c = static_cast<const uint16_t*>(wd->codes) + k * NR;
      for (int64_t i = 0; i < NR; i += LINE / 2) __builtin_prefetch(c + L1_AHEAD * NR + i, 0, 3);
      const auto floats = FROM == Narrow::BFloat16 ? bf16_floats : half_floats;
      b0 = floats(c), b1 = floats(c + W), b2 = floats(c + 2 * W);
    } else {
      // Rows are contiguous and the addresses at most a line apart: every line is asked
      // for. Past the slice's end they fetch the next k block's or panel's rows, which the
      // next tile does not read first: harmless, and wrapping round to the slice's first
      // rows (which it does read) measured no faster.
      for (int64_t i = 0; i < NR; i += LINE / sizeof(float)) __builtin_prefetch(bk + L1_AHEAD * NR + i, 0, 3);
      b0 = vload<wvec>(bk), b1 = vload<wvec>(bk + W), b2 = vload<wvec>(bk + 2 * W);
    }
    if constexpr (WIDEN) {
      if (wd->out) {
        float* out = wd->out + k * NR;
        vstore(out, b0), vstore(out + W, b1), vstore(out + 2 * W, b2);
      }
    }
    if (--countdown == 0) {
      for (int64_t i = 0; i < pf.per_k; ++i) __builtin_prefetch(fetch + i * LINE, 0, 2);
      fetch += pf.per_k * LINE, countdown = pf.every;
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const wvec x = tandem::broadcast<wvec>(a[r * lda + k]);
      acc[r][0] += x * b0;
      acc[r][1] += x * b1;
      acc[r][2] += x * b2;
    }
  }
  // Whole panels of plain sums go straight from the registers (a staging row and a
  // memcpy of a run-time length were ~5 % of the tile's time at 576 k).
  if (!sums.silu_mul && sums.to_cols == NR) {
    if (sums.bias) {
      for (int v = 0; v < NV; ++v) {
        const wvec bias = vload<wvec>(sums.bias + v * W);
        for (int r = 0; r < R; ++r) acc[r][v] += bias;
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) vstore(sums.to + r * sums.to_ld + v * W, acc[r][v]);
    return;
  }
  for (int r = 0; r < R; ++r) {
    float row[NR];
    for (int v = 0; v < NV; ++v) vstore(row + v * W, acc[r][v]);
    float* to = sums.to + r * sums.to_ld;
    if (sums.silu_mul) {
#pragma omp simd
      for (int64_t i = 0; i < sums.to_cols; ++i) to[i] = tandem::silu(row[i]) * row[NR / 2 + i];
    } else {
      if (sums.bias) {
        for (int64_t i = 0; i < sums.to_cols; ++i) row[i] += sums.bias[i];
      }
      std::memcpy(to, row, sums.to_cols * sizeof(float));
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const Sums&, Prefetch, const Widening*);

template <bool WIDEN, Narrow FROM, int... R>
constexpr auto make_tiles(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R)>{&tile<R + 1, WIDEN, FROM>...};
}
using Tiles = std::array<TileFn, MR>;
// TILES[r - 1]: the tile of r rows (the last rows of a block may be fewer than MR);
// widening_tiles(from)[r - 1] the same, widening a narrow slice as it reads it.
constexpr Tiles TILES = make_tiles<false, Narrow::Codes>(std::make_integer_sequence<int, MR>{});
inline const Tiles& widening_tiles(Narrow from) {
  static constexpr Tiles codes = make_tiles<true, Narrow::Codes>(std::make_integer_sequence<int, MR>{});
  static constexpr Tiles nibbles = make_tiles<true, Narrow::Nibbles>(std::make_integer_sequence<int, MR>{});
  static constexpr Tiles bf16 = make_tiles<true, Narrow::BFloat16>(std::make_integer_sequence<int, MR>{});
  static constexpr Tiles half = make_tiles<true, Narrow::Half>(std::make_integer_sequence<int, MR>{});
  switch (from) {
    case Narrow::Codes: return codes;
    case Narrow::Nibbles: return nibbles;
    case Narrow::BFloat16: return bf16;
    default: return half;
  }
}

}  // namespace tandem::panels
