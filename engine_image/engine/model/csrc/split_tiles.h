// What split_linear's two kinds of weight share on AMX's tiles (split_linear.cpp): x's
// rows split into the A tiles' bfloat16 parts, the product's output (Product,
// store_sums), and the planes' k blocks (block_sums, which the codes' offsets tail takes
// too); with the planes' own register block (tile_block).
#pragma once

#include "amx_tiles.h"

#if defined(TANDEM_AMX) && defined(__AVX512BF16__)
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernel_common.h"

namespace tandem::split {

namespace amx = tandem::amx;

constexpr int PARTS = amx::PARTS;        // x's bfloat16 parts
constexpr int64_t TILE = amx::TILE_ELEMS;  // bfloat16 in a tile (512)
constexpr int64_t KT = amx::TILE_K;        // k a tile covers (32)

// The three bfloat16 parts of 32 floats, stored as rows of tiles t, t + TILE, t + 2 TILE.
inline void split32(const float* src, uint16_t* t) {
  amx::split_parts(_mm512_loadu_ps(src), _mm512_loadu_ps(src + 16), t, TILE);
}

// Row m of x into the A tiles: parts [row tile][KX / 32][3][16][32].
inline void split_row(const float* x, int64_t K, int64_t sums_block, uint16_t* row) {
  const int64_t full = K / KT;
  for (int64_t b = 0; b < full; ++b) split32(x + b * KT, row + b * PARTS * TILE);
  if (!sums_block) return;
  alignas(64) float sums[KT];
  for (int64_t b0 = 0, kb = full; b0 < K / sums_block; b0 += KT, ++kb) {
    std::fill(sums, sums + KT, 0.0f);
    for (int64_t b = b0; b < std::min(K / sums_block, b0 + KT); ++b) {
      const float* xb = x + b * sums_block;
      __m512 acc = _mm512_loadu_ps(xb);
      for (int64_t i = 16; i < sums_block; i += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(xb + i));
      sums[b - b0] = _mm512_reduce_add_ps(acc);
    }
    split32(sums, row + kb * PARTS * TILE);
  }
}

struct Product {
  const uint16_t* planes;  // [T][KB][J][16][32]
  int64_t KB, J, M, N;
  float* y;
  const float* bias;
  bool silu_mul;
  bool stream = false;  // whole tiles of output stored non-temporally (split_linear)
};

// C tiles 0..3 += the terms of k block kb: A tiles 4, 5 (rows m0, m1), B tiles 6, 7 (column
// tiles c0, c1). TWO_M / TWO_N: whether the second row / column tile exists.
// a_step, b_step: from row tile m0's parts to m0 + 1's, from column tile c0's planes to
// c0 + 1's; `blocks` k blocks of J planes each.
template <bool TWO_M, bool TWO_N>
inline void block_sums(const uint16_t* a0, int64_t a_step, const uint16_t* b0, int64_t b_step, int64_t blocks,
                       int64_t J) {
  const uint16_t* a1 = a0 + a_step;
  const uint16_t* b1 = b0 + b_step;
  constexpr int64_t LD = amx::ROW_BYTES;
  for (int64_t kb = 0; kb < blocks; ++kb, a0 += PARTS * TILE, a1 += PARTS * TILE, b0 += J * TILE, b1 += J * TILE) {
    for (int64_t s = 0; s < PARTS; ++s) {  // terms by size: xi * wj with i + j = s
      for (int64_t j = 0; j <= std::min<int64_t>(s, J - 1); ++j) {
        const int64_t i = s - j;
        _tile_loadd(4, a0 + i * TILE, LD);
        _tile_loadd(6, b0 + j * TILE, LD);
        _tile_dpbf16ps(0, 4, 6);
        if constexpr (TWO_N) {
          _tile_loadd(7, b1 + j * TILE, LD);
          _tile_dpbf16ps(1, 4, 7);
        }
        if constexpr (TWO_M) {
          _tile_loadd(5, a1 + i * TILE, LD);
          _tile_dpbf16ps(2, 5, 6);
          if constexpr (TWO_N) _tile_dpbf16ps(3, 5, 7);
        }
      }
    }
  }
}

// Where C tile `tile` (rows from m_tile, columns from column tile c) goes.
inline void store_tile(const Product& p, const float (*c)[amx::COLUMNS], int64_t m_tile, int64_t col0, int64_t cols) {
  const int64_t rows = std::min<int64_t>(amx::ROWS, p.M - m_tile * amx::ROWS);
  for (int64_t r = 0; r < rows; ++r) {
    float* to = p.y + (m_tile * amx::ROWS + r) * p.N + col0;
    if (p.stream && !p.bias && cols == amx::COLUMNS && (reinterpret_cast<uintptr_t>(to) & 63) == 0) {
      _mm512_stream_ps(to, _mm512_load_ps(c[r]));
      continue;
    }
    if (p.bias) {
      for (int64_t i = 0; i < cols; ++i) to[i] = c[r][i] + p.bias[col0 + i];
    } else {
      std::memcpy(to, c[r], cols * sizeof(float));
    }
  }
}

inline void store_gated(const Product& p, const float (*g)[amx::COLUMNS], const float (*u)[amx::COLUMNS],
                        int64_t m_tile, int64_t col0, int64_t cols) {
  const int64_t rows = std::min<int64_t>(amx::ROWS, p.M - m_tile * amx::ROWS);
  for (int64_t r = 0; r < rows; ++r) {
    float* to = p.y + (m_tile * amx::ROWS + r) * p.N + col0;
    if (p.stream && cols == amx::COLUMNS && (reinterpret_cast<uintptr_t>(to) & 63) == 0) {
      alignas(64) float t[amx::COLUMNS];
#pragma omp simd
      for (int64_t i = 0; i < cols; ++i) t[i] = tandem::silu(g[r][i]) * u[r][i];
      _mm512_stream_ps(to, _mm512_load_ps(t));
      continue;
    }
#pragma omp simd
    for (int64_t i = 0; i < cols; ++i) to[i] = tandem::silu(g[r][i]) * u[r][i];
  }
}

// Sums c (C tiles 0..3 as tile_block numbers them) to the output, through silu_mul or bias.
template <bool TWO_M, bool TWO_N>
inline void store_sums(const Product& p, const float (*c)[amx::ROWS][amx::COLUMNS], int64_t m0, int64_t c0) {
  if (p.silu_mul) {  // the column tiles are gate, up of the same columns
    const int64_t col0 = c0 / 2 * amx::COLUMNS, cols = std::min<int64_t>(amx::COLUMNS, p.N - col0);
    store_gated(p, c[0], c[1], m0, col0, cols);
    if constexpr (TWO_M) store_gated(p, c[2], c[3], m0 + 1, col0, cols);
    return;
  }
  for (int64_t n = 0; n < (TWO_N ? 2 : 1); ++n) {
    const int64_t col0 = (c0 + n) * amx::COLUMNS, cols = std::min<int64_t>(amx::COLUMNS, p.N - col0);
    store_tile(p, c[n], m0, col0, cols);
    if (TWO_M) store_tile(p, c[2 + n], m0 + 1, col0, cols);
  }
}

// The C tiles of row tiles m0 (m0 + 1), whose parts start at a, by column tiles c0
// (c0 + 1), whose planes start at b, summed over every k block and stored.
template <bool TWO_M, bool TWO_N>
inline void tile_block(const Product& p, const uint16_t* a, int64_t m0, int64_t c0, const uint16_t* b) {
  _tile_zero(0);
  if constexpr (TWO_N) _tile_zero(1);
  if constexpr (TWO_M) _tile_zero(2);
  if constexpr (TWO_M && TWO_N) _tile_zero(3);
  block_sums<TWO_M, TWO_N>(a, p.KB * PARTS * TILE, b, p.KB * p.J * TILE, p.KB, p.J);
  constexpr int64_t LD = amx::ROW_BYTES;
  const int64_t ld = p.N * static_cast<int64_t>(sizeof(float));
  // Whole tiles of plain sums go straight to the output; the rest through c.
  const bool whole = !p.stream && !p.silu_mul && !p.bias && (m0 + (TWO_M ? 2 : 1)) * amx::ROWS <= p.M &&
                     (c0 + (TWO_N ? 2 : 1)) * amx::COLUMNS <= p.N;
  if (whole) {
    float* y = p.y + m0 * amx::ROWS * p.N + c0 * amx::COLUMNS;
    _tile_stored(0, y, ld);
    if constexpr (TWO_N) _tile_stored(1, y + amx::COLUMNS, ld);
    if constexpr (TWO_M) _tile_stored(2, y + amx::ROWS * p.N, ld);
    if constexpr (TWO_M && TWO_N) _tile_stored(3, y + amx::ROWS * p.N + amx::COLUMNS, ld);
    return;
  }
  alignas(64) float c[4][amx::ROWS][amx::COLUMNS];
  _tile_stored(0, c[0], LD);
  if constexpr (TWO_N) _tile_stored(1, c[1], LD);
  if constexpr (TWO_M) _tile_stored(2, c[2], LD);
  if constexpr (TWO_M && TWO_N) _tile_stored(3, c[3], LD);
  store_sums<TWO_M, TWO_N>(p, c, m0, c0);
}

}  // namespace tandem::split
#endif  // TANDEM_AMX && __AVX512BF16__
