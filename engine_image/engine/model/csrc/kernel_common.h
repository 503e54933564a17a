// Helpers shared by Tandem's CPU kernels (cpu_kernels.cpp, the attention kernels, panel_linear.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>  // round_nearest, times_pow2
#endif
#if defined(__SSE__)
#include <xmmintrin.h>  // FlushDenormals
#endif
#include <unistd.h>  // sysconf: l2_bytes

namespace tandem {

// Denormals flushed to zero, as results (FTZ) and as inputs (DAZ), on the calling thread
// while in scope; the thread's mode is restored after. For the attention kernels, whose
// online softmax makes them where scores lie ~87 or more apart: its exponentials stop at
// 2^-126 (the exp functions below clamp), but their products do not, a probability
// times a value row, an output row times its rescale factor. Each operation that made or
// met one took a microcode assist: with scores hundreds apart a SmolLM2 prefill layer took
// 50 ms against 5.1, a batch-64 decode 2.9-6.4x its time (a Xeon, docs/benchmarks.md).
// Flushed, what such a value would add to a sum lies below float32's resolution of the
// sum anyway. Per thread (the x86 MXCSR): each OpenMP thread takes its own.
class FlushDenormals {
 public:
#if defined(__SSE__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | FTZ | DAZ); }
  ~FlushDenormals() { _mm_setcsr(saved_); }
#else
  FlushDenormals() {}  // elsewhere the kernels keep the thread's mode
#endif
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
#if defined(__SSE__)
  static constexpr unsigned FTZ = 0x8000, DAZ = 0x0040;
  unsigned saved_;
#endif
};

// This core's L2 in bytes, asked once (1 MiB where the C library cannot say): what the
// kernels size their per-thread working sets by.
inline int64_t l2_bytes() {
  static const int64_t bytes = [] {
#if defined(_SC_LEVEL2_CACHE_SIZE)  // glibc's; other C libraries may lack it
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);  // bytes, per core; 0 or -1 unknown
#else
    const long l2 = 0;
#endif
    return l2 > 0 ? static_cast<int64_t>(l2) : int64_t{1} << 20;
  }();
  return bytes;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// float's value in T, as torch's cast rounds it: float, identity; c10 types, to nearest even.
template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

// dst[0..n) = float(src[0..n)).
inline void load_row(float* dst, const float* src, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline void load_row(float* dst, const c10::BFloat16* src, int64_t n) {
  // bfloat16 is the top half of a float32: widen the bits, no rounding involved.
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = static_cast<uint32_t>(bits[i]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    dst[i] = f;
  }
}
inline void load_row(float* dst, const c10::Half* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// dst[0..n) = float(src[0..n)) * scale: a query row, pre-scaled, into the kernels' scratch.
template <typename T>
inline void load_scaled_row(float* dst, const T* src, float scale, int64_t n) {
  load_row(dst, src, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] *= scale;
}

// dst[0..n) = T(src[0..n) * mul): an output row, normalised, rounded once.
template <typename T>
inline void store_row(T* dst, const float* src, float mul, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * mul);
}
inline void store_row(float* dst, const float* src, float mul, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * mul;
}

// What exp_approx and vexp share, for x (a float or a vfloat) in [-87, 88]: exp(x) is
// the result times 2^n. A Cody-Waite reduction, then Cephes' polynomial.
template <typename V>
inline V exp_reduced(V x, V& n) {
  // Round to nearest without a rounding instruction (1.5 * 2^23 trick).
  const float shifter = 12582912.0f;
  n = (x * 1.44269504088896341f + shifter) - shifter;
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) for x <= ~88, branch-free so that loops over it vectorise. Cephes' expf
// polynomial after a Cody-Waite reduction: within 2 ulp of expf on [-87, 88];
// below -87 it returns ~1e-38 instead of 0 (callers never add such a term to a
// sum that is not already >= 1).
inline float exp_approx(float x) {
  // Clamp to [-87, 88] with bit masks: written as selects, gcc splits the loop per
  // case and folds exp of the bounds, then divides by exp(88) speculatively in every
  // lane, whose denormal quotients cost ~100x (measured in silu_mul).
  const int32_t below = -static_cast<int32_t>(x < -87.0f), above = -static_cast<int32_t>(x > 88.0f);
  x = std::bit_cast<float>((std::bit_cast<int32_t>(x) & ~(below | above)) |
                           (std::bit_cast<int32_t>(-87.0f) & below) | (std::bit_cast<int32_t>(88.0f) & above));
  float n;
  const float p = exp_reduced(x, n);
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

// SiLU, x * sigmoid(x), as both SwiGLU paths compute it (silu_mul, panel_linear).
inline float silu(float x) { return x / (1.0f + exp_approx(-x)); }

// GCC vector extensions: portable SIMD the compiler lowers to whatever the ISA
// flags allow (two SSE registers without AVX). Used where the auto-vectoriser
// cannot keep a register tile: QK dot products (8 independent accumulators, then
// one transposing reduction) and the P.V update (accumulator rows held in
// registers across a tile). Head dims that are not a multiple of VL take the
// plain loops.
constexpr int64_t VL = 8;
typedef float vfloat __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(VL * sizeof(int32_t))));

// The widest vector the ISA flags give, for register tiles that fill the register
// file (panel_linear, prefill attention): 32 registers of 16 floats with AVX-512, 16
// of 8 with AVX, 16 of 4 with SSE.
#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif
typedef float wvec __attribute__((vector_size(W * sizeof(float))));
typedef int32_t wint __attribute__((vector_size(W * sizeof(int32_t))));

// The float and int32 vectors of a size in bytes (a vector type's size is a template
// argument only through a class).
template <std::size_t Bytes>
struct Vectors {
  typedef float floats __attribute__((vector_size(Bytes)));
  typedef int32_t ints __attribute__((vector_size(Bytes)));
};
template <typename V>
using int_vector = typename Vectors<sizeof(V)>::ints;  // as wide as V

// Unaligned load and store of a vector (vfloat, or another vector_size type V).
template <typename V = vfloat>
inline V vload(const float* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
template <typename V>
inline void vstore(float* p, V v) {
  __builtin_memcpy(p, &v, sizeof(v));
}

// x in every lane: one vbroadcastss from memory. (vfloat{} + x, the obvious idiom,
// costs a real scalar add of 0.0f first, since -0.0f + 0.0f is +0.0f, then a register
// broadcast: measured ~20 % of the prefill kernel's time, in its innermost loop.)
template <typename V, std::size_t... I>
inline V broadcast_lanes(float x, std::index_sequence<I...>) {
  return V{((void)I, x)...};
}
template <typename V>
inline V broadcast(float x) {
  return broadcast_lanes<V>(x, std::make_index_sequence<sizeof(V) / sizeof(float)>{});
}
inline vfloat splat(float x) { return broadcast<vfloat>(x); }

// The lane numbers 0, 1, ... of an int vector V.
template <typename V, std::size_t... I>
inline V lane_numbers(std::index_sequence<I...>) {
  return V{static_cast<int32_t>(I)...};
}
template <typename V>
inline V lanes() {
  return lane_numbers<V>(std::make_index_sequence<sizeof(V) / sizeof(int32_t)>{});
}

// x rounded to the nearest integer (ties to even) in every lane, |x| < 2^22: one
// vrndscaleps for an AVX-512 vector, else the shifter trick exp_reduced uses.
template <typename V>
inline V round_nearest(V x) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) {
    return (V)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
#endif
  const float shifter = 12582912.0f;
  return (x + shifter) - shifter;
}

// p * 2^n in every lane, n integral in [-126, 127]: one vscalefps for an AVX-512
// vector, else n added to the float exponent (the same result).
template <typename V>
inline V times_pow2(V p, V n) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) return (V)_mm512_scalef_ps((__m512)p, (__m512)n);
#endif
  const int_vector<V> scale = (__builtin_convertvector(n, int_vector<V>) + 127) << 23;
  return p * reinterpret_cast<const V&>(scale);
}

// exp_approx in every lane (the same steps, so the same results up to FMA contraction).
template <typename V>
inline V vexp(V x) {
  x = x < -87.0f ? broadcast<V>(-87.0f) : x;
  x = x > 88.0f ? broadcast<V>(88.0f) : x;
  V n;
  const V p = exp_reduced(x, n);
  return times_pow2(p, n);
}

// 2^x in every lane, for x <= 0 (prefill attention's scores, kept in log2 units, less
// their max): Cephes' exp2f polynomial after rounding x to an integer, within 2 ulp of
// exp2f; below -126 it returns 2^-126 (callers mask such lanes or scale zeros by them).
// Six fewer vector operations than vexp: no upper clamp, no two-part reduction. With
// AVX-512, one instruction rounds and one scales by 2^n, four fewer again for the same
// result: 3 % of prefill attention's time.
template <typename V>
inline V vexp2_nonpositive(V x) {
  x = x < -126.0f ? broadcast<V>(-126.0f) : x;
  const V n = round_nearest(x);
  const V r = x - n;  // in [-0.5, 0.5]
  V p = r * 1.535336188319500e-4f + 1.339887440266574e-3f;
  p = p * r + 9.618437357674640e-3f;
  p = p * r + 5.550332471162809e-2f;
  p = p * r + 2.402264791363012e-1f;
  p = p * r + 6.931472028550421e-1f;
  p = p * r + 1.0f;
  return times_pow2(p, n);
}

// Lanes Offset, Offset + 1, ... of v, as a vector half as wide (in registers: a
// memcpy of each half went through the stack).
template <std::size_t Offset, typename V, std::size_t... I>
inline typename Vectors<sizeof(V) / 2>::floats half_lanes(V v, std::index_sequence<I...>) {
  return __builtin_shufflevector(v, v, (Offset + I)...);
}
template <typename V>
inline void halves(V v, typename Vectors<sizeof(V) / 2>::floats& lo, typename Vectors<sizeof(V) / 2>::floats& hi) {
  constexpr std::size_t H = sizeof(V) / sizeof(float) / 2;
  lo = half_lanes<0>(v, std::make_index_sequence<H>{});
  hi = half_lanes<H>(v, std::make_index_sequence<H>{});
}

// Horizontal max and sum, by halves (one shuffle a step for the compiler).
template <typename V>
inline float hmax(V v) {
  if constexpr (sizeof(V) == 2 * sizeof(float)) {
    return v[0] > v[1] ? v[0] : v[1];
  } else {
    typename Vectors<sizeof(V) / 2>::floats lo, hi;
    halves(v, lo, hi);
    return hmax(lo > hi ? lo : hi);
  }
}
template <typename V>
inline float hsum(V v) {
  if constexpr (sizeof(V) == 2 * sizeof(float)) {
    return v[0] + v[1];
  } else {
    typename Vectors<sizeof(V) / 2>::floats lo, hi;
    halves(v, lo, hi);
    return hsum(lo + hi);
  }
}

// One row of an online softmax over a tile of scores: sc[0..lim) are the visible
// scores (sc[lim..n) masked). Turns them into probabilities against the new running
// max m (sc[lim..n) become 0), rescales what came before (acc[0..D) and the running
// sum l) to that max, and adds the tile's sum to l. Tiles whose width is a multiple
// of VL run in vectors throughout: the scalar loops' reductions took ~180 cycles a
// 64-wide row, a quarter of the prefill kernel's time.
inline void softmax_tile_row(float* sc, int64_t lim, int64_t n, float& m, float& l, float* acc, int64_t D) {
  if (lim == 0) {
    for (int64_t j = 0; j < n; ++j) sc[j] = 0.0f;
    return;
  }
  float mx = m, sum = 0.0f;
  if (n % VL == 0) {
    const vint lane = lanes<vint>();
    const vfloat masked = splat(-std::numeric_limits<float>::infinity());
    const int32_t limit = static_cast<int32_t>(lim);  // a tile's width: small
    vfloat vmx = splat(m);
    for (int32_t j = 0; j < n; j += VL) {
      const vfloat x = lane + j < limit ? vload(sc + j) : masked;
      vmx = x > vmx ? x : vmx;
    }
    mx = hmax(vmx);
    const vfloat vm = splat(mx);
    vfloat vsum = {};
    for (int32_t j = 0; j < n; j += VL) {
      const vfloat p = lane + j < limit ? vexp(vload(sc + j) - vm) : vfloat{};
      vstore(sc + j, p);
      vsum += p;
    }
    sum = hsum(vsum);
  } else {
    for (int64_t j = lim; j < n; ++j) sc[j] = 0.0f;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < lim; ++j) mx = sc[j] > mx ? sc[j] : mx;  // std::max blocks simd
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < lim; ++j) {
      const float p = exp_approx(sc[j] - mx);
      sc[j] = p;
      sum += p;
    }
  }
  if (m != mx) {
    const float corr = std::isinf(m) ? 0.0f : exp_approx(m - mx);
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) acc[i] *= corr;
    l *= corr;
    m = mx;
  }
  l += sum;
}

// f(tag) with a value of the C++ type of t (float, c10::BFloat16, c10::Half): one
// kernel template instantiated per dtype the kernels take.
template <typename F>
void dispatch_float_types(at::ScalarType t, const char* name, F&& f) {
  switch (t) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    default:
      TORCH_CHECK(false, name, ": unsupported dtype ", t);
  }
}

// The checks the causal attention kernels share (prefill_attention.cpp's contract): q
// [T, H, D], k and v [L, KVH, D] with L >= T and H a multiple of KVH, each row's heads
// dense, all on the CPU in one dtype.
inline void check_causal_inputs(const char* name, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, name, ": q, k, v must be [rows, heads, D]");
  for (const at::Tensor* x : {&q, &k, &v}) {
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == x->size(2), name, ": each row's heads must be dense");
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == q.scalar_type(), name,
                ": q, k, v must be CPU tensors of one dtype");
  }
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), L = k.size(0), KVH = k.size(1);
  TORCH_CHECK(v.sizes() == k.sizes() && k.size(2) == D, name, ": k and v must be [L, KVH, D] as q's D");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, name, ": query heads must be a multiple of KV heads");
  TORCH_CHECK(L >= T, name, ": the context (", L, ") is shorter than the queries (", T, ")");
}

}  // namespace tandem
