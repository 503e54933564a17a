// CPU kernels for Tandem's model runtime, built just in time by cpu_kernels.py into
// one library with the files cpu_kernels.py's SOURCES names. This file
// declares every op of the library (TORCH_LIBRARY below) and holds the small ones:
//
// rms_norm, add_rms_norm_, rope_, silu_mul: the elementwise chains of a Llama
//   layer, one pass each (see below).
// argmax_rows: greedy sampling's argmax over the vocabulary, vectorised (torch's
//   CPU argmax is a scalar loop: 3 ms for 64 rows of 49k logits, against 0.6).
//
// The attention kernels: paged_decode_attention (decode_attention.cpp),
// causal_attention (prefill_attention.cpp) and, in float32 on AMX tiles,
// split_causal_attention (split_attention.cpp); what they share is in kernel_common.h.
// The float32 projections: pack_panels and panel_linear (panel_linear.cpp), and on AMX
// tiles split_linear (split_linear.cpp).
// Greedy rows' LM head: pack_bf16_panels, greedy_head and amx_ready (greedy_head.cpp).
// cpu_kernels.py compiles with -mavx2 -mfma -mf16c where the CPU has them,
// -mavx512f -mavx512vl where present (32 vector registers for the prefill
// kernel's tiles), then -mavx512bf16 and -mamx-tile -mamx-bf16 (greedy_head's screens,
// the split_* kernels).

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

#include "kernel_common.h"
#include "rotary.h"

namespace {

using namespace tandem;

// ---------------------------------------------------------------------------
// Elementwise kernels: one pass over the rows instead of a chain of torch ops.
// Rounding follows HF transformers' Llama modules: float32 math, and a cast
// to the model dtype wherever torch would round an intermediate tensor (a no-op
// for float32). Results differ from the torch ops only by float rounding order
// (the RMSNorm sum, FMA contraction, exp_approx in SiLU).

// Rows per parallel chunk so that a chunk holds >= ~32k elements (small steps run inline).
inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": expected [rows, n] with a dense last dim");
}

template <typename T>
void rms_norm_impl(at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  const T* dp = delta ? delta->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), ds = delta ? delta->stride(0) : 0, os = out.stride(0);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<float> row(n);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * xs;
      if (dp) {
        const T* dr = dp + r * ds;
        for (int64_t i = 0; i < n; ++i) {
          xr[i] = round_to<T>(to_float(xr[i]) + to_float(dr[i]));
        }
      }
      load_row(row.data(), xr, n);
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += row[i] * row[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + feps);
      T* orow = op + r * os;
      for (int64_t i = 0; i < n; ++i) {
        orow[i] = round_to<T>(to_float(wp[i]) * to_float(round_to<T>(row[i] * inv)));
      }
    }
  });
}

// weight * (x / sqrt(mean(x^2) + eps)), as HF's LlamaRMSNorm.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a contiguous [n] of x's dtype");
  at::Tensor out = x.new_empty(x.sizes());
  at::Tensor xm = x;  // not written without a delta
  dispatch_float_types(x.scalar_type(), "rms_norm", [&](auto tag) {
    rms_norm_impl<decltype(tag)>(xm, nullptr, weight, eps, out);
  });
  return out;
}

// x += delta (the residual stream, in place), then rms_norm(x).
at::Tensor add_rms_norm_(at::Tensor x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm_ x");
  check_rows(delta, "add_rms_norm_ delta");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(), "add_rms_norm_: delta must match x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm_: weight must be a contiguous [n] of x's dtype");
  at::Tensor out = x.new_empty(x.sizes());
  dispatch_float_types(x.scalar_type(), "add_rms_norm_", [&](auto tag) {
    rms_norm_impl<decltype(tag)>(x, &delta, weight, eps, out);
  });
  return out;
}

template <typename T>
void rope_rows(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rows = x.size(0), heads = x.size(1), D = x.size(2);
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t xs = x.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, rows, grain_rows(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rope_row<T>(xp + r * xs, cp + r * cs, sp + r * ss, heads, D);
  });
}

// Rotary embedding of q [rows, H, D] and k [rows, KVH, D] in place; cos/sin [rows, ..., D].
void rope_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  for (const at::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2) && t->size(2) % 2 == 0,
                "rope_: q, k must be [rows, heads, D] with dense heads and an even D");
    TORCH_CHECK(t->size(0) == cos.size(0) && t->scalar_type() == cos.scalar_type(), "rope_: q, k must match cos");
  }
  const int64_t D = q.size(2);
  TORCH_CHECK(k.size(2) == D && cos.size(-1) == D && sin.sizes() == cos.sizes() &&
                  sin.scalar_type() == cos.scalar_type() && cos.stride(-1) == 1 && sin.stride(-1) == 1 &&
                  cos.numel() == cos.size(0) * D && sin.numel() == sin.size(0) * D,
              "rope_: cos/sin must be [rows, (1,) D] with a dense last dim");
  dispatch_float_types(q.scalar_type(), "rope_", [&](auto tag) {
    using T = decltype(tag);
    rope_rows<T>(q, cos, sin);
    rope_rows<T>(k, cos, sin);
  });
}

template <typename T>
void silu_mul_impl(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  const int64_t rows = gate.size(0), n = gate.size(1);
  const T* gp = gate.data_ptr<T>();
  const T* up_p = up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t gs = gate.stride(0), us = up.stride(0);
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * gs;
      const T* u = up_p + r * us;
      T* o = op + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float gf = to_float(g[i]);
        const float act = to_float(round_to<T>(silu(gf)));
        o[i] = round_to<T>(act * to_float(u[i]));
      }
    }
  });
}

// silu(gate) * up, as HF's LlamaMLP (gate, up: [rows, n], e.g. halves of a fused projection).
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_rows(gate, "silu_mul gate");
  check_rows(up, "silu_mul up");
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(), "silu_mul: gate and up must match");
  at::Tensor out = gate.new_empty(gate.sizes());
  dispatch_float_types(gate.scalar_type(), "silu_mul", [&](auto tag) { silu_mul_impl<decltype(tag)>(gate, up, out); });
  return out;
}

// ---------------------------------------------------------------------------
// Argmax per row, as torch.argmax: the first index of the maximum, and a NaN
// counts as the maximum (the first NaN wins).

int64_t argmax_row(const float* x, int64_t n) {
  // One vectorised pass for the max; x - x is 0 unless x is NaN or infinite, so a
  // finite `special` proves the row has neither, and equality finds the index.
  float mx = -std::numeric_limits<float>::infinity(), special = 0.0f;
#pragma omp simd reduction(max : mx) reduction(+ : special)
  for (int64_t i = 0; i < n; ++i) {
    mx = x[i] > mx ? x[i] : mx;
    special += x[i] - x[i];
  }
  if (special == 0.0f) {
    // Chunks of 64 tested with a vectorised count, the hit searched inside its chunk.
    for (int64_t c = 0; c < n; c += 64) {
      const int64_t e = std::min(n, c + 64);
      int hits = 0;
#pragma omp simd reduction(+ : hits)
      for (int64_t i = c; i < e; ++i) hits += x[i] == mx;
      if (hits == 0) continue;
      for (int64_t i = c; i < e; ++i)
        if (x[i] == mx) return i;
    }
  }
  // Rows with NaN or infinities: torch's rule, a scalar loop.
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] != x[i]) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "argmax_rows: logits must be float32 [rows, vocab] with vocab > 0");
  const at::Tensor x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = x.new_empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * stride, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tandem_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor context_lens, Tensor query_start, float scale, bool? group_heads=None) -> "
      "Tensor");
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("split_causal_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("pack_gated_panels(Tensor gate, Tensor up) -> Tensor");
  m.def(
      "panel_linear(Tensor x, Tensor panels, int out_features, Tensor? bias, bool silu_mul=False, "
      "Tensor? codes=None, Tensor? scales=None, Tensor? offsets=None, int? code_low=None) -> Tensor");
  m.def("pack_bf16_panels(Tensor weight) -> Tensor");
  m.def(
      "greedy_head(Tensor x, Tensor panels, Tensor float_panels, Tensor norms, int out_features, "
      "bool tiles=False) -> Tensor");
  m.def("amx_ready() -> bool");
  m.def(
      "split_linear(Tensor x, Tensor planes, int out_features, int sums_block, Tensor? bias, "
      "bool silu_mul=False, Tensor? codes=None, Tensor? scales=None, int? code_low=None, Tensor? cos=None, "
      "Tensor? sin=None, int rope_columns=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
}
