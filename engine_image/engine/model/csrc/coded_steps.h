// The codes' register steps of split_linear.cpp: x's parts times a column pair's codes
// (converted to bfloat16 by coded_tiles.h) on AMX's tiles, each code block's sums scaled
// by their columns' scales as they leave the tiles, while the vector units convert the
// next pair's codes.
#pragma once

#include "amx_tiles.h"
#include "coded_tiles.h"
#include "split_tiles.h"

#if defined(TANDEM_AMX) && defined(__AVX512BF16__)
#include <cstdint>
#include <optional>

namespace tandem::coded {

using tandem::split::block_sums;
using tandem::split::KT;
using tandem::split::PARTS;
using tandem::split::Product;
using tandem::split::store_sums;
using tandem::split::TILE;

// Block kb's sums out of C tiles BASE (and BASE + 1), through c, into acc, each column's
// scale applied. (The tile intrinsics name their registers by literal: hence the chains.)
template <int BASE, bool TWO_N>
inline void scaled_out(float (*acc)[amx::ROWS][amx::COLUMNS], float (*c)[amx::ROWS][amx::COLUMNS],
                       const float* s0, const float* s1, int64_t kb) {
  constexpr int64_t LD = amx::ROW_BYTES;
  if constexpr (BASE == 0) {
    _tile_stored(0, c[0], LD);
    if constexpr (TWO_N) _tile_stored(1, c[1], LD);
  } else {
    _tile_stored(2, c[0], LD);
    if constexpr (TWO_N) _tile_stored(3, c[1], LD);
  }
  for (int n = 0; n < (TWO_N ? 2 : 1); ++n) {
    const __m512 d = _mm512_loadu_ps((n ? s1 : s0) + kb * amx::COLUMNS);
    for (int r = 0; r < amx::ROWS; ++r)
      _mm512_store_ps(acc[n][r], _mm512_fmadd_ps(_mm512_load_ps(c[n][r]), d, _mm512_load_ps(acc[n][r])));
  }
}

// Row tiles that share each code block's B tiles (rows_scaled); their accumulators, 2 KiB
// each, stay in L1 beside the tiles' operands. (8 against 4: chained 1,024-row SmolLM2
// products 1-6 % faster; a decode step's 64 rows are 4 row tiles.)
constexpr int64_t GROUP = 8;

// Step (kb, m) on the tiles: row tile m's parts (at a) times code block kb's B tiles 6, 7
// (loaded when load_b: at the group's first row tile), into C tiles BASE, BASE + 1 from zero.
template <int BASE, bool TWO_N>
inline void coded_step(const uint16_t* a, const uint16_t* b0, const uint16_t* b1, int64_t kb, bool load_b) {
  constexpr int64_t LD = amx::ROW_BYTES;
  if (load_b) {
    _tile_loadd(6, b0 + kb * TILE, LD);
    if constexpr (TWO_N) _tile_loadd(7, b1 + kb * TILE, LD);
  }
  if constexpr (BASE == 0) {
    _tile_zero(0);
    if constexpr (TWO_N) _tile_zero(1);
  } else {
    _tile_zero(2);
    if constexpr (TWO_N) _tile_zero(3);
  }
  for (int i = 0; i < PARTS; ++i) {
    _tile_loadd(4, a + (kb * PARTS + i) * TILE, LD);
    if constexpr (BASE == 0) {
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (TWO_N) _tile_dpbf16ps(1, 4, 7);
    } else {
      _tile_dpbf16ps(2, 4, 6);
      if constexpr (TWO_N) _tile_dpbf16ps(3, 4, 7);
    }
  }
}

// A column pair's codes on their way to bfloat16: its tiles' codes to `out` (the second
// tile_elems on), the thread's following pair (ahead) asked for in L2 as they go. The
// thread's first pair is converted whole before its products; each pair after it a code
// block at a time, while the tiles work on the pair before (rows_scaled).
struct PairConversion {
  const CodedTiles* w;
  int64_t c0;  // its first column tile
  bool two;  // whether it has a second
  uint16_t* out;
  int64_t tile_elems;  // a column tile's converted codes and tail
  int64_t tail_planes;
  std::optional<int64_t> ahead0, ahead1;  // the column tiles of the following pair
};

inline void convert_pair_block(const PairConversion* job, int64_t kb) {
  if (!job) return;
  const auto ahead = [](const std::optional<int64_t>& tile) { return tile ? &*tile : nullptr; };
  convert_block(*job->w, job->c0, kb, job->out + kb * TILE, ahead(job->ahead0));
  if (job->two) convert_block(*job->w, job->c0 + 1, kb, job->out + job->tile_elems + kb * TILE, ahead(job->ahead1));
}

inline void copy_tails(const PairConversion* job) {
  if (!job) return;
  copy_tail(*job->w, job->c0, job->out, job->tail_planes);
  if (job->two) copy_tail(*job->w, job->c0 + 1, job->out + job->tile_elems, job->tail_planes);
}

inline void convert_pair(const PairConversion& job) {
  for (int64_t kb = 0; kb < job.w->KBC; ++kb) convert_pair_block(&job, kb);
  copy_tails(&job);
}

// The product's sums for codes, G <= GROUP row tiles from m0 (x's parts at a, a_step
// apart) by column tiles c0 (c0 + 1): b holds c0's codes as bfloat16 [KBC][16][32], then
// its tail's planes [KBO][J][16][32], and c0 + 1's the same b_step on; s0 (s1) their
// scales [KBC][16]. Per code block kb and row tile, the parts of x
// times the codes themselves (one plane, exact) on the tiles, 3 tdpbf16ps whatever the
// codes' type, then each column's scale applied in float32 as the sums leave them. The
// steps (kb, m) alternate between C tiles 0, 1 and 2, 3, so that one step's sums leave
// the tiles (scaled into acc on the vector units) while the next step's are on them; a
// code block's B tiles serve the group's row tiles in turn. Chained SmolLM2 products
// (docs/benchmarks.md): the alternation, against two row tiles by two column tiles whose
// sums were scaled before the next block began, 5-7 % faster at 64 rows and 2-10 % at
// 1,024; the shared B tiles, against loading them for each row tile, a further 4-6 % and
// 5-11 % (groups of 4). The offsets' tail (planes) is summed first, across its blocks, as block_sums
// does for planes. `next`: the pair whose codes to convert meanwhile, a block with each of
// this pair's (or none): the vector units' conversion between the tiles' steps, against a
// pair converted before its products, chained 64-row products 5 % faster, with the
// windowed codes' table 6-8 %, 16 rows 12-18 %, 1,024 rows 0-1 % (their codes are kept).
template <bool TWO_N>
void rows_scaled(const Product& p, const uint16_t* a, int64_t a_step, int64_t m0, int64_t G, int64_t c0,
                 const uint16_t* b, int64_t b_step, const float* s0, const float* s1, int64_t KBC,
                 const PairConversion* next) {
  constexpr int64_t LD = amx::ROW_BYTES;
  alignas(64) float acc[GROUP][2][amx::ROWS][amx::COLUMNS];
  alignas(64) float c[2][amx::ROWS][amx::COLUMNS];
  for (int64_t m = 0; m < G; ++m) {
    _tile_zero(0);
    if constexpr (TWO_N) _tile_zero(1);
    if (p.KB > KBC)
      block_sums<false, TWO_N>(a + m * a_step + KBC * PARTS * TILE, 0, b + KBC * TILE, b_step, p.KB - KBC, p.J);
    _tile_stored(0, acc[m][0], LD);
    if constexpr (TWO_N) _tile_stored(1, acc[m][1], LD);
  }
  const uint16_t* b1 = b + b_step;
  // Step s: code block s / G, row tile s % G, on C tiles 0, 1 (even s) or 2, 3 (odd);
  // step s - 1's sums are scaled out once step s is on the tiles, the last one after.
  // Two steps an iteration: a loop of one step a turn, choosing the tiles by parity,
  // measured 3-5 % slower on 1,024-row products.
  const int64_t steps = KBC * G;
  for (int64_t s = 0; s < steps; s += 2) {
    coded_step<0, TWO_N>(a + s % G * a_step, b, b1, s / G, s % G == 0);
    if (s % G == 0) convert_pair_block(next, s / G);
    if (s > 0) scaled_out<2, TWO_N>(acc[(s - 1) % G], c, s0, s1, (s - 1) / G);
    if (s + 1 == steps) {
      scaled_out<0, TWO_N>(acc[s % G], c, s0, s1, s / G);
      break;
    }
    coded_step<2, TWO_N>(a + (s + 1) % G * a_step, b, b1, (s + 1) / G, (s + 1) % G == 0);
    if ((s + 1) % G == 0) convert_pair_block(next, (s + 1) / G);
    scaled_out<0, TWO_N>(acc[s % G], c, s0, s1, s / G);
  }
  if (steps > 0 && steps % 2 == 0) scaled_out<2, TWO_N>(acc[(steps - 1) % G], c, s0, s1, (steps - 1) / G);
  copy_tails(next);
  for (int64_t m = 0; m < G; ++m) store_sums<false, TWO_N>(p, acc[m], m0 + m, c0);
}

}  // namespace tandem::coded
#endif  // TANDEM_AMX && __AVX512BF16__
