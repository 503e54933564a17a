// RowPrefetch: the paced software prefetch of decode attention's K and V rows
// (decode_attention.cpp), which come from scattered cache blocks.
#pragma once

#include <algorithm>
#include <cstdint>

namespace tandem {

// The rows an item reads, in the order it reads them (each chunk's K rows, then its V
// rows), asked for a set distance before they are needed (prefetcht2): a decode
// step reads every sequence's context once, from scattered blocks that the hardware
// prefetcher does not follow. The QK and PV loops call ahead() every few rows, which
// paces the requests with the arithmetic; requests issued in bursts (a tile's worth at
// once) overflow the miss buffers and are dropped, and measured 1.5x slower.
template <typename T, int64_t Chunk>
struct RowPrefetch {
  const T* kcache;
  const T* vcache;
  const int64_t* offsets;  // the item's token offsets, [0, ctx)
  int64_t ctx, row_bytes;
  int64_t next = 0;  // read-order index of the next row to ask for
  // Where `next` is: its token, whether it is a V row, its chunk.
  int64_t token = 0, chunk_start = 0, chunk_end = 0;
  bool is_v = false;

  // Ask for every row up to read-order index `until` (exclusive): runs of one half's
  // rows, the cursor moved once a run.
  void ahead(int64_t until) {
    until = std::min(until, 2 * ctx);
    if (chunk_end == 0) chunk_end = std::min(Chunk, ctx);
    while (next < until) {
      const int64_t run = std::min(until - next, chunk_end - token);
      const char* base = reinterpret_cast<const char*>(is_v ? vcache : kcache);
      for (int64_t t = token; t < token + run; ++t) {
        const char* row = base + offsets[t] * static_cast<int64_t>(sizeof(T));
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 1);
      }
      next += run;
      token += run;
      if (token == chunk_end) {  // the chunk's V rows follow its K rows, then the next chunk
        if (!is_v) {
          token = chunk_start;
        } else {
          chunk_start = chunk_end;
          chunk_end = std::min(chunk_end + Chunk, ctx);
        }
        is_v = !is_v;
      }
    }
  }
};

}  // namespace tandem
