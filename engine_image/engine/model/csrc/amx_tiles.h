// Intel AMX's tile registers, for the kernels that multiply bfloat16 on them (greedy_head.cpp, split_*.cpp).
//
// A tile is up to 16 rows of 64 bytes. tdpbf16ps C, A, B adds to C [16 x 16 float32] the
// products of A [16 rows x 32 bfloat16] and B [16 rows of 16 column pairs]: B's row q holds
// W[k = 2q, 2q+1] for 16 columns side by side, the pair layout vdpbf16ps reads too. Each
// tdpbf16ps is 8,192 multiply-adds; a core does one about every 16 cycles (measured: 6.1
// ns at 2.6 GHz), 16x its AVX-512 FMA units' float32 rate in theory; oneDNN's bfloat16
// GEMM measured ~7x its float32 one (2.4 against 0.35 TFLOP/s, a Xeon, 2 threads).
//
// Linux hands the tile state to a process only when asked (arch_prctl), and a thread must
// load a tile configuration before it uses the tiles and release them after.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TANDEM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <vector>

namespace tandem::amx {

constexpr int ROWS = 16;        // a tile's rows
constexpr int ROW_BYTES = 64;   // and the bytes of each
constexpr int PAIRS = 16;       // bfloat16 pairs in a row of A: the k a tdpbf16ps covers
constexpr int COLUMNS = 16;     // float32 columns of C, column pairs of B

// Whether this process may use the tiles: asks Linux once (the answer holds for the
// process's life, every thread included).
inline bool permitted() {
  static const bool granted = [] {
    constexpr long REQ_XCOMP_PERM = 0x1023;  // arch_prctl's ARCH_REQ_XCOMP_PERM
    constexpr long XTILEDATA = 18;           // the tile data state's feature number
    return syscall(SYS_arch_prctl, REQ_XCOMP_PERM, XTILEDATA) == 0;
  }();
  return granted;
}

// Palette 1 with its first `tiles` tiles at full size: 16 rows of 64 bytes.
struct alignas(64) Config {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  explicit Config(int tiles) {
    for (int t = 0; t < tiles; ++t) colsb[t] = ROW_BYTES, rows[t] = ROWS;
  }
};
static_assert(sizeof(Config) == 64);

// The calling thread's tiles, configured for its scope and released after.
class Tiles {
 public:
  explicit Tiles(int tiles) {
    const Config config(tiles);
    _tile_loadconfig(&config);
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// A buffer per thread (Tag tells the uses apart): allocated once, not per call, and on a
// cache line, as tile rows must be (a row across two lines is two loads).
template <typename Tag>
uint16_t* thread_buffer(int64_t elems) {
  struct Line {
    alignas(64) uint16_t elems[32];
  };
  thread_local std::vector<Line> buffer;
  const int64_t lines = (elems + 31) / 32;
  if (static_cast<int64_t>(buffer.size()) < lines) buffer.resize(lines);
  return buffer.front().elems;
}

#if defined(__AVX512BF16__)
constexpr int PARTS = 3;                              // a float32's bfloat16 parts
constexpr int64_t TILE_K = PAIRS * 2;                 // k a tdpbf16ps covers (32)
constexpr int64_t TILE_ELEMS = ROWS * TILE_K;         // bfloat16 in a tile (512)

// How split_parts lays two vectors' parts into a row of 32 bfloat16 (each part's bits in
// the high half of its lanes, the low half zero):
struct InOrder {  // a's 16, then b's: an A tile's row of k in order
  __m512i operator()(__m512i ha, __m512i hb) const {
    // Both are bfloat16 values: the conversion's rounding leaves them as they are.
    const __m512bh part = _mm512_cvtne2ps_pbh(_mm512_castsi512_ps(hb), _mm512_castsi512_ps(ha));
    return reinterpret_cast<const __m512i&>(part);
  }
};
struct LaneInterleaved {  // vpackusdw's order: per 128-bit lane, a's 4, then b's 4
  __m512i operator()(__m512i ha, __m512i hb) const {
    return _mm512_packus_epi32(_mm512_srli_epi32(ha, 16), _mm512_srli_epi32(hb, 16));
  }
};
struct Pairs {  // (a_i, b_i) pairs: a B tile's row, a and b two consecutive k
  __m512i operator()(__m512i ha, __m512i hb) const { return _mm512_or_si512(hb, _mm512_srli_epi32(ha, 16)); }
};

// The three bfloat16 parts of 32 floats (a: the first 16, b: the next 16), each stored as
// a row of 32 bfloat16 (laid out by Pack) at t, t + stride, t + 2 * stride. x = x0 + x1 +
// x2 exactly: x0 is x truncated to 8 significant bits, x1 the next 8 of what is left, x2
// the rest (float32's 24 bits). Every product of two parts is exact in float32, so the
// tiles multiply float32 values through their parts' products (split_linear.cpp,
// split_attention.cpp).
template <typename Pack = InOrder>
inline void split_parts(__m512 a, __m512 b, uint16_t* t, int64_t stride, Pack pack = {}) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int p = 0; p < PARTS; ++p, t += stride) {
    const __m512i ha = _mm512_and_si512(_mm512_castps_si512(a), high);
    const __m512i hb = _mm512_and_si512(_mm512_castps_si512(b), high);
    _mm512_storeu_si512(t, pack(ha, hb));
    a = _mm512_sub_ps(a, _mm512_castsi512_ps(ha));  // exact: the bits below
    b = _mm512_sub_ps(b, _mm512_castsi512_ps(hb));
  }
}
#endif  // __AVX512BF16__

}  // namespace tandem::amx

#endif  // __AMX_TILE__ && __AMX_BF16__
