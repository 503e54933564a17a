// paged_decode_attention: decode attention straight from the paged KV cache,
// built with cpu_kernels.cpp (which declares the op).
//
// One work item per (sequence, KV head), or, where the CPU reads them faster
// (group_heads: groups_heads_here), per (sequence, group of KV heads), spread over
// OpenMP threads. The item walks the sequence's context through its block table, CHUNK
// tokens at a time: the chunk's scores (for each KV head, its G query heads times 1 +
// drafts rows against each K row, read once for all of them: GQA sharing), one
// online-softmax update per row (running max, running sum, float32 accumulator;
// kernel_common.h), then the chunk's V rows into the accumulators (the register
// tiles of both products: decode_tiles.h). Row i of a sequence with n rows and
// context length c sits at position c - n + i and attends to positions 0..c - n + i
// (causal over the drafts). The step's new K/V rows are written to their cache slots
// first (in the same call, before any read), which replaces two index_copy_ per
// layer.
//
// Inner loops are plain C++ for gcc's auto-vectoriser (-O3, omp simd, contiguous
// head_dim), plus GCC vector extensions where it cannot keep a register tile. The
// -mavx2 -mfma -mf16c flags (cpu_kernels.py) measured 4x against the x86-64
// baseline here. The tiles take AVX-512's 16 lanes and up to 4 query rows at once
// where the CPU has it (2 rows of 8 lanes before): the same speed where the context
// streams from memory (plain decode at batch 64), 1.1-1.5x with drafts (more rows
// per KV head) or a context the caches hold (docs/benchmarks.md).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "decode_tiles.h"
#include "kernel_common.h"
#include "row_prefetch.h"

namespace {

using namespace tandem;

// Context tokens per online-softmax update: the scores of a chunk are kept (a CHUNK-float
// row for each of an item's query rows), so the running max and sum are rescaled once a
// chunk, not every few keys.
constexpr int64_t CHUNK = 128;
constexpr int64_t KEYS = 16;  // keys per step of the QK and PV loops (and prefetch)
// Most query rows an item of several KV heads takes: their scores, accumulators and
// queries (~1 KiB a row at head dim 64) stay in L1. (Llama-3.2-1B's shapes with 4
// drafts, every head in one item: 7 % slower.)
constexpr int64_t ROW_BUDGET = 32;
// Bytes of rows (K or V, in read order) asked for ahead of the one being read
// (RowPrefetch), as whole rows, at least 4. (32 rows of an item's heads, 24 KiB for
// SmolLM2's three in float32, measured 8 % slower at batch 64 on a Xeon, whose
// prefetches wait for a free miss buffer.)
constexpr int64_t PREFETCH_BYTES = 8192;

// Element offsets of tokens t0..t0+n of one KV head in the cache.
inline void tile_offsets(int64_t* out, const int32_t* table, int64_t t0, int64_t n, int64_t block_size,
                         int64_t row_stride, int64_t head_offset) {
  for (int64_t j = 0, b = t0 / block_size, off = t0 % block_size; j < n; ++j) {
    out[j] = (static_cast<int64_t>(table[b]) * block_size + off) * row_stride + head_offset;
    if (++off == block_size) {
      off = 0;
      ++b;
    }
  }
}

// rows[j] = the chunk's row j of one KV head's cache half (cache: that head's first
// element) as float32, for j in [j0, j0 + n), a group of keys at a time as the loops
// reach them (so that the reads follow the prefetches): in place for float32; for the
// 16-bit types widened into buf, which holds one group (KEYS rows, in L1), so rows[j]
// lasts until the next group.
template <typename T>
inline void chunk_rows(const float** rows, const T* cache, const int64_t* offsets, int64_t j0, int64_t n, int64_t D,
                       std::vector<float>& buf) {
  for (int64_t j = j0; j < j0 + n; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      rows[j] = cache + offsets[j];
    } else {
      float* row = buf.data() + (j - j0) * D;
      load_row(row, cache + offsets[j], D);
      rows[j] = row;
    }
  }
}

struct Scratch {
  std::vector<float> q, acc, scores, m, l, kbuf, vbuf;
  std::vector<int64_t> limit;
  std::vector<int64_t> offsets;
  std::vector<const float*> krows, vrows;
};

// One work item: KV heads h0..h0+NH of one sequence, all their query rows. A token's K
// (and V) rows of all KV heads lie side by side in the cache, and an item of several
// heads reads theirs together, front to back (items of one KV head, each reading a third
// of each of SmolLM2's tokens, measured 1.15x slower at batch 64 on a Xeon); items of one
// head share a few sequences out over the threads.
template <typename T>
void decode_item(
    const T* q,  // [T_rows, H, D], rows q_stride apart
    int64_t q_stride,
    const T* kcache,  // [slots, KVH, D]
    const T* vcache,
    T* out,  // [T_rows, H, D] contiguous
    const int32_t* table,  // this sequence's block table
    int64_t ctx,  // context length after this step
    int64_t row0,  // first q row of the sequence
    int64_t nq,  // rows (1 + drafts)
    int64_t h0,  // the item's first KV head
    int64_t NH,  // and its number of KV heads
    int64_t H,
    int64_t KVH,
    int64_t D,
    int64_t block_size,
    float scale,
    Scratch& s) {
  const int64_t G = H / KVH;
  const int64_t R = G * nq;  // query rows sharing a KV head, row r = qi * G + g
  const int64_t RT = NH * R;  // all the rows: KV head h0 + h's from h * R on
  const bool wide = D % DL == 0, vec = D % VL == 0;  // the tiles' vectors fit D
  s.q.resize(RT * D);
  s.acc.assign(RT * D, 0.0f);
  s.scores.resize(RT * CHUNK);
  s.m.assign(RT, -std::numeric_limits<float>::infinity());
  s.l.assign(RT, 0.0f);
  s.limit.resize(R);
  s.offsets.resize(ctx);
  s.krows.resize(CHUNK);
  s.vrows.resize(CHUNK);
  if constexpr (!std::is_same_v<T, float>) {  // rows widened by chunk_rows
    s.kbuf.resize(KEYS * D);
    s.vbuf.resize(KEYS * D);
  }
  const int64_t row_stride = KVH * D;  // a token's rows, between consecutive cache slots
  tile_offsets(s.offsets.data(), table, 0, ctx, block_size, row_stride, h0 * D);
  RowPrefetch<T, CHUNK> pf{kcache, vcache, s.offsets.data(), ctx, NH * D * static_cast<int64_t>(sizeof(T))};
  const int64_t ahead = std::max<int64_t>(4, PREFETCH_BYTES / pf.row_bytes);  // rows
  pf.ahead(ahead);
  for (int64_t h = 0; h < NH; ++h) {
    for (int64_t r = 0; r < R; ++r) {
      const int64_t qi = r / G, g = r % G;
      load_scaled_row(s.q.data() + (h * R + r) * D, q + (row0 + qi) * q_stride + ((h0 + h) * G + g) * D, scale, D);
    }
  }
  const int64_t first_pos = ctx - nq;  // position of row 0
  for (int64_t t0 = 0; t0 < ctx; t0 += CHUNK) {
    const int64_t n = std::min(CHUNK, ctx - t0);
    const int64_t* offsets = s.offsets.data() + t0;
    const int64_t read0 = 2 * t0;  // read-order index of the chunk's first K row
    // Tokens of the chunk each row sees (the drafts' causal mask), alike for every KV head.
    for (int64_t r = 0; r < R; ++r) {
      const int64_t visible = first_pos + r / G + 1 - t0;
      s.limit[r] = std::min(n, std::max<int64_t>(visible, 0));
    }
    // Scores: every query row against the chunk's K rows, a group of keys at a time, each
    // K row read once for the rows of its KV head (rows see no fewer keys than the rows
    // before them: r = qi * G + g).
    for (int64_t j0 = 0; j0 < n; j0 += KEYS) {
      const int64_t kn = std::min(KEYS, n - j0);
      pf.ahead(read0 + j0 + kn + ahead);
      for (int64_t h = 0; h < NH; ++h) {
        chunk_rows(s.krows.data(), kcache + h * D, offsets, j0, kn, D, s.kbuf);
        const float* qh = s.q.data() + h * R * D;
        const float* const* krows = s.krows.data();
        float* scores = s.scores.data() + h * R * CHUNK;
        if (wide) {
          score_rows<dvec>(qh, krows, scores, CHUNK, s.limit.data(), j0, kn, R, D);
        } else if (vec) {
          score_rows<vfloat>(qh, krows, scores, CHUNK, s.limit.data(), j0, kn, R, D);
        } else {
          for (int64_t r = 0; r < R; ++r) {
            for (int64_t j = j0; j < j0 + kn && j < s.limit[r]; ++j)
              scores[r * CHUNK + j] = dot(qh + r * D, krows[j], D);
          }
        }
      }
    }
    // Over n rounded up to whole vectors (the scores' rows have room; lanes past a
    // row's limit are masked), so that a short last chunk takes the vector path too.
    const int64_t width = (n + VL - 1) / VL * VL;
    for (int64_t r = 0; r < RT; ++r) {
      softmax_tile_row(s.scores.data() + r * CHUNK, s.limit[r % R], width, s.m[r], s.l[r], s.acc.data() + r * D, D);
    }
    for (int64_t j0 = 0; j0 < n; j0 += KEYS) {
      const int64_t kn = std::min(KEYS, n - j0);
      pf.ahead(read0 + n + j0 + kn + ahead);
      for (int64_t h = 0; h < NH; ++h) {
        chunk_rows(s.vrows.data(), vcache + h * D, offsets, j0, kn, D, s.vbuf);
        float* acc = s.acc.data() + h * R * D;
        const float* p = s.scores.data() + h * R * CHUNK + j0;
        const float* const* v = s.vrows.data() + j0;
        if (wide) {
          add_values<dvec>(acc, p, CHUNK, s.limit.data(), j0, v, kn, R, D);
        } else if (vec) {
          add_values<vfloat>(acc, p, CHUNK, s.limit.data(), j0, v, kn, R, D);
        } else {
          for (int64_t j = 0; j < kn; ++j) {
            for (int64_t r = 0; r < R; ++r) {
              if (j0 + j < s.limit[r]) axpy(acc + r * D, p[r * CHUNK + j], v[j], D);
            }
          }
        }
      }
    }
  }
  for (int64_t h = 0; h < NH; ++h) {
    for (int64_t r = 0; r < R; ++r) {
      const int64_t qi = r / G, g = r % G, row = h * R + r;
      store_row(out + ((row0 + qi) * H + (h0 + h) * G + g) * D, s.acc.data() + row * D, 1.0f / s.l[row], D);
    }
  }
}

template <typename T>
void decode_impl(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    at::Tensor& kv_cache,
    const at::Tensor& slot_mapping,
    const at::Tensor& block_tables,
    const at::Tensor& context_lens,
    const at::Tensor& query_start,
    double scale,
    bool group_heads,
    at::Tensor& out) {
  const int64_t rows = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t KVH = kv_cache.size(3);
  const int64_t S = context_lens.size(0);
  const int64_t width = block_tables.size(1);
  const int64_t plane = num_blocks * block_size * KVH * D;  // elements of the K half
  T* kc = kv_cache.data_ptr<T>();
  T* vc = kc + plane;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t q_stride = q.stride(0), k_stride = k.stride(0), v_stride = v.stride(0);
  T* op = out.data_ptr<T>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int32_t* qstart = query_start.data_ptr<int32_t>();
  // Work items: (sequence, group of KV heads). With group_heads, where there are enough
  // sequences to share out, a group is every KV head or as many as keep the item's rows
  // within ROW_BUDGET; else one head.
  const int64_t max_threads = at::get_num_threads();
  int64_t most_rows = 1;  // query rows of the longest sequence (1 + drafts)
  for (int64_t i = 0; i < S; ++i) most_rows = std::max<int64_t>(most_rows, qstart[i + 1] - qstart[i]);
  const int64_t rows_per_head = H / KVH * most_rows;
  const int64_t NH =
      group_heads && S >= 4 * max_threads ? std::clamp<int64_t>(ROW_BUDGET / rows_per_head, 1, KVH) : 1;
  const int64_t groups = (KVH + NH - 1) / NH, items = S * groups;
  // A step with little context (batch 1, short prompts) runs on the calling thread:
  // its few microseconds of work would not pay for waking the others.
  int64_t token_heads = 0;
  for (int64_t i = 0; i < S; ++i) token_heads += static_cast<int64_t>(ctx[i]) * KVH;
  const int64_t want = token_heads < 2048 ? 1 : max_threads;
  const int threads = static_cast<int>(std::min<int64_t>(want, items));
  const float fscale = static_cast<float>(scale);
#pragma omp parallel num_threads(threads)
  {
    const FlushDenormals flush;
    // The step's K/V into the cache, all of it before any item reads.
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * KVH; ++i) {
      const int64_t row = i / KVH, h = i % KVH;
      const int64_t dst = (slots[row] * KVH + h) * D;
      std::memcpy(kc + dst, kp + row * k_stride + h * D, D * sizeof(T));
      std::memcpy(vc + dst, vp + row * v_stride + h * D, D * sizeof(T));
    }
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t seq = item / groups, h0 = item % groups * NH;
      decode_item<T>(qp, q_stride, kc, vc, op, tables + seq * width, ctx[seq], qstart[seq],
                     qstart[seq + 1] - qstart[seq], h0, std::min(NH, KVH - h0), H, KVH, D, block_size, fscale,
                     scratch);
    }
  }
}

// Whether work items take several KV heads of a sequence by default on this CPU. On an
// Intel Xeon (AMX generation) they read faster: batch-64 decode of SmolLM2 12.4-12.8 ms
// against 15.6 for items of one head, float32 decode 3-16 % faster across Llama shapes.
// On AMD Zen 4 the same reads measured slower (16.4-16.9 against 13.4 ms in the step,
// docs/benchmarks.md): other CPUs keep items of one head.
bool groups_heads_here() {
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
}

// Every index the kernel follows, checked before it writes or reads the cache (a few
// hundred integers a step): the slots in the cache, each sequence's rows (query_start
// from 0 to every row, in order, no more rows than its context), and the blocks its
// context reads, within its table and the cache.
void check_indices(const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& context_lens,
                   const at::Tensor& query_start, int64_t rows, int64_t num_blocks, int64_t block_size) {
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_blocks * block_size, "slot_mapping: slot ", slots[i],
                " is outside the cache's ", num_blocks * block_size, " slots");
  }
  const int64_t S = context_lens.numel(), width = block_tables.size(1);
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int32_t* qstart = query_start.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(qstart[0] == 0 && qstart[S] == rows, "query_start must run from 0 to the rows (", rows, ")");
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = qstart[s + 1] - qstart[s], blocks = (static_cast<int64_t>(ctx[s]) + block_size - 1) / block_size;
    TORCH_CHECK(n >= 0 && ctx[s] >= n, "sequence ", s, ": ", n, " rows for a context of ", ctx[s]);
    TORCH_CHECK(blocks <= width, "sequence ", s, ": a context of ", ctx[s], " needs ", blocks, " blocks, its table has ",
                width);
    for (int64_t b = 0; b < blocks; ++b) {
      const int32_t block = tables[s * width + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "sequence ", s, ": block ", block, " is outside the cache's ",
                  num_blocks, " blocks");
    }
  }
}

at::Tensor paged_decode_attention(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    at::Tensor kv_cache,
    const at::Tensor& slot_mapping,
    const at::Tensor& block_tables,
    const at::Tensor& context_lens,
    const at::Tensor& query_start,
    double scale,
    c10::optional<bool> group_heads) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [rows, heads, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache must be [2, blocks, bs, KVH, D]");
  // Rows may be strided (views of a fused QKV projection); heads and head_dim not.
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "q, k, v: [rows, heads, D] with dense heads");
  }
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && k.scalar_type() == kv_cache.scalar_type() &&
                  v.scalar_type() == kv_cache.scalar_type(),
              "q, k, v and kv_cache must share a dtype");
  const int64_t KVH = kv_cache.size(3), D = kv_cache.size(4);
  TORCH_CHECK(q.size(2) == D && k.size(1) == KVH && k.size(2) == D && v.sizes() == k.sizes(),
              "q, k, v head shapes do not match the cache");
  TORCH_CHECK(q.size(1) % KVH == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k.size(0) == q.size(0) && slot_mapping.numel() == q.size(0), "one slot per row");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping: int64");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables: contiguous int32 [seqs, width]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(), "context_lens: int32");
  TORCH_CHECK(query_start.scalar_type() == at::kInt && query_start.numel() == context_lens.numel() + 1,
              "query_start: int32 [seqs + 1]");
  TORCH_CHECK(block_tables.size(0) == context_lens.numel(), "one block table per sequence");
  check_indices(slot_mapping, block_tables, context_lens, query_start, q.size(0), kv_cache.size(1), kv_cache.size(2));
  at::Tensor out = q.new_empty(q.sizes());
  dispatch_float_types(q.scalar_type(), "paged_decode_attention", [&](auto tag) {
    decode_impl<decltype(tag)>(q, k, v, kv_cache, slot_mapping, block_tables, context_lens, query_start, scale,
                               group_heads.value_or(groups_heads_here()), out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
