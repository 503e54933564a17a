// The rotary embedding of one row's heads, shared by rope_ (cpu_kernels.cpp) and the
// QKV product that rotates its own output (split_linear.cpp): one definition, so both
// give the same bits.
#pragma once

#include <cstdint>

#include "kernel_common.h"

namespace tandem {

// x * cos + rotate_half(x) * sin for `heads` heads of D values at x, rotate_half(x) =
// (-x2, x1) (HF's convention), c and s the row's D angles' cosines and sines. No FMA
// contraction: bit-equal to torch's mul, mul, add.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rope_row(T* x, const T* c, const T* s, int64_t heads,
                                                            int64_t D) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* v = x + h * D;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_float(v[i]), x2 = to_float(v[i + half]);
      const float lo = to_float(round_to<T>(x1 * to_float(c[i]))) + to_float(round_to<T>(-x2 * to_float(s[i])));
      const float hi =
          to_float(round_to<T>(x2 * to_float(c[i + half]))) + to_float(round_to<T>(x1 * to_float(s[i + half])));
      v[i] = round_to<T>(lo);
      v[i + half] = round_to<T>(hi);
    }
  }
}

}  // namespace tandem
