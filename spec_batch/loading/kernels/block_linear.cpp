// W4A8 linear layers on the CPU: GGUF-style 4-bit weight blocks times activations quantized to int8 per block of
// 32, with integer dot products.
//
// Weights: per output o and block b of 32 inputs, w = d[o,b] * q + m[o,b] with q in 0..15 (Q4_1 as it ships;
// Q4_0 is m = -8 d). Activations: per row r and block b, dx = max|x| / 127 and qx = round-to-even(x / dx).
// Then  y[r,o] = sum_b ( float(sum_j q qx) * (d * dx) + m * (dx * sum_j qx) ),  the blocks added in order with
// one fused multiply-add each. The block sums are integers (exact in any order), and the float steps are the
// same for a row whatever else the call holds, so a row's outputs are the same bits at every row count: the
// exactness speculation needs. The AMX (tile multiply), AVX-512 VNNI, AVX2 and portable paths compute the same bits.
//
// W8A8 (w8a8_linear): GGUF Q8_0 blocks, w = d[o,b] * q with q in -127..127, against the same int8 activations:
// y[r,o] = sum_b float(sum_j q qx) * (d * dx), one fused multiply-add a block, in order (llama.cpp's q8_0 x q8_0).
//
// Layout: outputs in tiles of 8; per (tile, block) of Q4 128 bytes [4][8 outputs][4 inputs], the low nibble holding
// input group p (inputs 4p..4p+3 of the block) and the high nibble group p + 4; of Q8 256 bytes [8][8 outputs][4
// inputs] holding q + 128 (unsigned, as VNNI multiplies); d and m as [tiles, blocks, 8] in float16, as GGUF ships
// them (a block's 32 weights in 20 bytes for Q4, 34 for Q8, as in the file: the bytes a decode step streams).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "block_linear.h"
#include "spin_pool.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kBlock = 32, kTile = 8;

// The activations block-major: block b's rows side by side, so the rows of a chunk sit at constant offsets from one
// pointer (kBlock bytes apart) and a kernel's row loop needs no register per row. With rows K apart (a stride
// known only at run time) the AVX2 4-row chunk spilled its row pointers and int16 sums to the stack: on an AVX2 Zen
// 3, 3-16 rows of the default model's layers ran 1.07-1.15x slower on one thread and on two.
struct QuantRows {
  int64_t rows;
  std::vector<int8_t> q;       // [blocks, rows, 32]
  std::vector<float> scale;    // [blocks, rows]: dx
  std::vector<float> shift;    // [blocks, rows]: dx * sum(qx)
  std::vector<int32_t> total;  // [blocks, rows]: sum(qx)
  int64_t at(int64_t r, int64_t b) const { return b * rows + r; }
  const int8_t* block(int64_t r, int64_t b) const { return q.data() + at(r, b) * kBlock; }
};

// One block of 32 activations onto int8: dx = max|x| / 127, q = round-to-even(x / dx) clamped to +-127; returns
// sum(q) and sets dx. (A NaN is skipped by the max, and clamps to 127.)
template <typename T>
int32_t quantize_block(const T* src, int8_t* dst, float& dx) {
  float amax = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(static_cast<float>(src[j])));
  dx = amax / 127.f;
  int32_t total = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    const float v = dx > 0.f ? std::nearbyint(static_cast<float>(src[j]) / dx) : 0.f;
    dst[j] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, v)));
    total += dst[j];
  }
  return total;
}

#ifdef __AVX2__
// The same bits, 8 lanes at a time: the max is exact in any order, the division and the rounding are IEEE's (the
// operands ordered so that a NaN is skipped and clamps as above), the packing is llama.cpp's quantize_row_q8_0's.
inline int32_t quantize_block_simd(const float* src, int8_t* dst, float& dx) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int64_t i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(src + 8 * i);
    amax = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), amax);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  dx = _mm_cvtss_f32(m4) / 127.f;
  if (!(dx > 0.f)) {
    std::memset(dst, 0, kBlock);
    return 0;
  }
  const __m256 d = _mm256_set1_ps(dx), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  __m256i q[4], total = _mm256_setzero_si256();
  for (int64_t i = 0; i < 4; ++i) {
    const __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q[i] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(r, hi), lo));
    total = _mm256_add_epi32(total, q[i]);
  }
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), ordered);
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
  return _mm_cvtsi128_si32(t4);
}
#else
inline int32_t quantize_block_simd(const float* src, int8_t* dst, float& dx) { return quantize_block(src, dst, dx); }
#endif
// no SIMD quantization of other dtypes: the scalar one
template <typename T>
int32_t quantize_block_simd(const T* src, int8_t* dst, float& dx) {
  return quantize_block(src, dst, dx);
}

// vector: the SIMD quantization where there is one (float32 rows), else the scalar; both give the same bits.
template <typename T>
QuantRows quantize_rows(const T* x, int64_t rows, int64_t k, bool vector) {
  const int64_t blocks = k / kBlock;
  QuantRows out{rows, std::vector<int8_t>(rows * k), std::vector<float>(rows * blocks),
                std::vector<float>(rows * blocks), std::vector<int32_t>(rows * blocks)};
  spec_batch_kernels::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const T* src = x + r * k + b * kBlock;
        const int64_t at = out.at(r, b);
        int8_t* dst = out.q.data() + at * kBlock;
        float dx;
        const int32_t total = vector ? quantize_block_simd(src, dst, dx) : quantize_block(src, dst, dx);
        out.scale[at] = dx;
        out.shift[at] = dx * static_cast<float>(total);
        out.total[at] = total;
      }
    }
  });
  return out;
}

// The two weight formats: a (tile, block)'s bytes, its portable integer sums, and the float steps that add a block
// to a row's accumulators (the same in every path, so every path gives the same bits).
struct Q4Blocks {  // w = d q + m, q in 0..15
  static constexpr int64_t kBytes = 128;
  static void block_sums(const uint8_t* w, const int8_t* xq, int32_t* sums) {
    for (int64_t o = 0; o < kTile; ++o) sums[o] = 0;
    for (int64_t p = 0; p < 4; ++p) {
      for (int64_t o = 0; o < kTile; ++o) {
        for (int64_t j = 0; j < 4; ++j) {
          const uint8_t byte = w[(p * kTile + o) * 4 + j];
          sums[o] += static_cast<int32_t>(byte & 0x0F) * xq[4 * p + j];
          sums[o] += static_cast<int32_t>(byte >> 4) * xq[4 * (p + 4) + j];
        }
      }
    }
  }
  static float add(float acc, float sum, float d, float m, float dx, float shift) {
    return std::fma(m, shift, std::fma(sum, d * dx, acc));
  }
};

struct Q8Blocks {  // w = d q, q in -127..127 stored as q + 128
  static constexpr int64_t kBytes = 256;
  static void block_sums(const uint8_t* w, const int8_t* xq, int32_t* sums) {
    for (int64_t o = 0; o < kTile; ++o) sums[o] = 0;
    for (int64_t p = 0; p < 8; ++p) {
      for (int64_t o = 0; o < kTile; ++o) {
        for (int64_t j = 0; j < 4; ++j) sums[o] += (static_cast<int32_t>(w[(p * kTile + o) * 4 + j]) - 128) * xq[4 * p + j];
      }
    }
  }
  static float add(float acc, float sum, float d, float, float dx, float) { return std::fma(sum, d * dx, acc); }
};

template <typename Format>
void tile_portable(const uint8_t* w, const at::Half* d, const at::Half* m, const QuantRows& xr, int64_t rows, int64_t k,
                   float* out, int64_t out_stride) {
  const int64_t blocks = k / kBlock;
  int32_t sums[kTile];
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kTile] = {0};
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = xr.at(r, b);
      Format::block_sums(w + b * Format::kBytes, xr.block(r, b), sums);
      const float dx = xr.scale[at], shift = xr.shift[at];
      for (int64_t o = 0; o < kTile; ++o) {
        const float mo = m == nullptr ? 0.f : static_cast<float>(m[b * kTile + o]);
        acc[o] = Format::add(acc[o], static_cast<float>(sums[o]), static_cast<float>(d[b * kTile + o]), mo, dx, shift);
      }
    }
    for (int64_t o = 0; o < kTile; ++o) out[r * out_stride + o] = acc[o];
  }
}

#ifdef __AVX2__
// A block's weights as 8 registers wq[p]: input group p (4 inputs) of the tile's 8 outputs, unsigned bytes.
inline void unpack(Q4Blocks, const uint8_t* w, __m256i* wq) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t p = 0; p < 4; ++p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
    wq[p] = _mm256_and_si256(v, low);
    wq[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  }
}
inline void unpack(Q8Blocks, const uint8_t* w, __m256i* wq) {
  for (int64_t p = 0; p < 8; ++p) wq[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
}

// A row's 4 activations of input group p, as the int32 every lane multiplies with.
inline __m256i group(const int8_t* x, int64_t p) {
  int32_t g;
  std::memcpy(&g, x + 4 * p, sizeof(g));
  return _mm256_set1_epi32(g);
}

// N rows' 8 integer block sums each (one per output of the tile) from the block's weights and the rows' blocks of
// int8 activations (row i at x + i * kBlock: QuantRows' layout). The rows' chains are interleaved, so the products of
// independent rows overlap instead of waiting on one another's latency; the sums are integers, the same in any order.
// Q4 on AVX2: u8 x s8 products paired into int16 (no overflow: 8 * 2 * 15 * 127 < 2^15), then widened. Q8 on AVX2:
// q + 128 would overflow those pairs, so the signs move onto the activations (|q| * sign(q) x, as llama.cpp does:
// 2 * 127 * 127 < 2^15) and each group widens at once.
// The weights are unpacked as they are used (a Q4 load gives groups q and q + 4) and each row's sum is pinned to a
// register after every group: with all 8 groups unpacked first and the sums free to reassociate, GCC built one tree
// of every product, and 4 rows' sums spilled to the stack. One 3072x576 layer, one thread hot, AVX2 Zen 3: 8 rows
// 1.29x, 16-32 rows 1.37-1.39x faster (4 rows a chunk before, 8 now); the W8A8 head's shape 1.1-1.2x from 2 rows.
struct SumsAvx2 {
  static constexpr int kRows = 8;  // rows a chunk: a block's weights serve them all
  template <int N>
  static void rows(Q4Blocks, const uint8_t* w, const int8_t* x, const int32_t*, __m256i* out) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i s16[N];
#pragma GCC unroll 4
    for (int64_t q = 0; q < 4; ++q) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + q * 32));
      const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 8
      for (int i = 0; i < N; ++i) {
        const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, group(x + i * kBlock, q)),
                                              _mm256_maddubs_epi16(hi, group(x + i * kBlock, q + 4)));
        s16[i] = q == 0 ? pair : _mm256_add_epi16(s16[i], pair);
        __asm__("" : "+x"(s16[i]));  // pinned: see above
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) out[i] = _mm256_madd_epi16(s16[i], _mm256_set1_epi16(1));
  }
  // Q8: |q| once a group for every row, q's signs moved onto each row's x
  template <int N>
  static void rows(Q8Blocks, const uint8_t* w, const int8_t* x, const int32_t*, __m256i* out) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
    for (int64_t p = 0; p < 8; ++p) {
      const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32)), flip);
      const __m256i size = _mm256_abs_epi8(q);
#pragma GCC unroll 8
      for (int i = 0; i < N; ++i) {
        const __m256i signed_x = _mm256_sign_epi8(group(x + i * kBlock, p), q);
        const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(size, signed_x), ones);
        out[i] = p == 0 ? sums : _mm256_add_epi32(out[i], sums);
        __asm__("" : "+x"(out[i]));
      }
    }
  }
};

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// The same integers from VNNI's dot products of 4 bytes (u8 x s8 into int32); Q8 takes off the 128 * sum(x) its
// stored offset adds. One row alone runs two chains; with 32 vector registers a chunk takes 8 rows.
struct SumsVnni {
  static constexpr int kRows = 8;
  template <int N>
  static void dots(const __m256i* wq, const int8_t* x, __m256i* out) {
    if constexpr (N <= 4) {  // few rows: two chains a row, so that 2N chains overlap the products' latency
      __m256i part[N][2];
#pragma GCC unroll 8
      for (int i = 0; i < N; ++i) part[i][0] = part[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int64_t p = 0; p < 8; ++p) {
#pragma GCC unroll 8
        for (int i = 0; i < N; ++i) {
          part[i][p & 1] = _mm256_dpbusd_epi32(part[i][p & 1], wq[p], group(x + i * kBlock, p));
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < N; ++i) out[i] = _mm256_add_epi32(part[i][0], part[i][1]);
    } else {
#pragma GCC unroll 8
      for (int i = 0; i < N; ++i) out[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int64_t p = 0; p < 8; ++p) {
#pragma GCC unroll 8
        for (int i = 0; i < N; ++i) out[i] = _mm256_dpbusd_epi32(out[i], wq[p], group(x + i * kBlock, p));
      }
    }
  }
  template <int N>
  static void rows(Q4Blocks, const uint8_t* w, const int8_t* x, const int32_t*, __m256i* out) {
    if constexpr (N <= 4) {  // few rows: the high nibbles multiplied where they sit (see below)
      high_in_place<N>(w, x, out);
    } else {
      __m256i wq[8];
      unpack(Q4Blocks{}, w, wq);
      dots<N>(wq, x, out);
    }
  }
  // A row's two chains are its low groups and its high groups, the high nibbles masked but not shifted down: their
  // products are 16x the true ones, so their sum is too (exact: every term a multiple of 16), and one arithmetic
  // shift a row brings it back, instead of unpack's four shifts a block (u8 x s8 sums: 240 * 127 * 16 inputs < 2^31).
  // Plain decoding at batch 1 on a 2-core Xeon VM, in process against unpack: 1.022x.
  template <int N>
  static void high_in_place(const uint8_t* w, const int8_t* x, __m256i* out) {
    const __m256i low = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(static_cast<char>(0xF0));
    __m256i lo_sum[N], hi_sum[N];
#pragma GCC unroll 4
    for (int i = 0; i < N; ++i) lo_sum[i] = hi_sum[i] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int64_t p = 0; p < 4; ++p) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
      const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(v, high);
#pragma GCC unroll 4
      for (int i = 0; i < N; ++i) {
        lo_sum[i] = _mm256_dpbusd_epi32(lo_sum[i], lo, group(x + i * kBlock, p));
        hi_sum[i] = _mm256_dpbusd_epi32(hi_sum[i], hi, group(x + i * kBlock, p + 4));
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < N; ++i) out[i] = _mm256_add_epi32(lo_sum[i], _mm256_srai_epi32(hi_sum[i], 4));
  }
  template <int N>
  static void rows(Q8Blocks, const uint8_t* w, const int8_t* x, const int32_t* totals, __m256i* out) {
    __m256i wq[8];
    unpack(Q8Blocks{}, w, wq);
    dots<N>(wq, x, out);
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) out[i] = _mm256_sub_epi32(out[i], _mm256_set1_epi32(128 * totals[i]));
  }
};
#endif

// A block's weights are read once a call, from memory: the hardware prefetcher, following several streams at
// once, falls behind a one-row call (a decode step), so each block asks for weights further on (in a tile's blocks
// and on into the next tile's, which follow it). How far, and into which cache, is per CPU, timed as the library
// loads (loading/kernels/tuning.py), per kind (W4A8 [0], W8A8 [1]):
// - near: the block kAhead further on, into L1. 1 row of a 3072x576 layer out of memory on AMD Zen 4: 62 -> 48 us
//   (8 ahead; 4 and 16: 51 and 53).
// - far: kFarBytes further on, into L2. On a 2-core Sapphire Rapids-class VM (weights on huge pages), one-row calls
//   streaming 192 MB of the default model's shapes: W4A8 16.4 -> 18.2 GB/s, W8A8 28.7 -> 31.9; plain decoding at
//   batch 1, in process, 8.20 -> 7.19 ms a token.
constexpr int64_t kAhead = 8, kFarBytes = 4096;
std::atomic<bool> g_prefetch_far[2] = {false, false};
template <typename Format>
inline void fetch_ahead(const uint8_t* block) {
  if (g_prefetch_far[std::is_same_v<Format, Q8Blocks>].load(std::memory_order_relaxed)) {
    for (int64_t line = 0; line < Format::kBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(block + kFarBytes + line), _MM_HINT_T1);
    }
    return;
  }
  for (int64_t line = 0; line < Format::kBytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(block + kAhead * Format::kBytes + line), _MM_HINT_T0);
  }
}

// 8 float16 scales as float32 (exact).
inline __m256 halves(const at::Half* h) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))); }

inline __m256 add(Q4Blocks, __m256 acc, __m256 sums, __m256 dv, __m256 mv, float dx, float shift) {
  acc = _mm256_fmadd_ps(sums, _mm256_mul_ps(dv, _mm256_set1_ps(dx)), acc);
  return _mm256_fmadd_ps(mv, _mm256_set1_ps(shift), acc);
}
inline __m256 add(Q8Blocks, __m256 acc, __m256 sums, __m256 dv, __m256, float dx, float) {
  return _mm256_fmadd_ps(sums, _mm256_mul_ps(dv, _mm256_set1_ps(dx)), acc);
}

// N rows (from r0) of one tile of 8 outputs over every block: the weights unpacked once a block for all N, `Sums`
// giving the integer sums; the float steps are the portable path's, so every Sums and every N give the same bits.
template <typename Format, typename Sums, int N>
void rows_of_tile(const uint8_t* w, const at::Half* d, const at::Half* m, const QuantRows& xr, int64_t r0, int64_t k,
                  float* out, int64_t out_stride) {
  const int64_t blocks = k / kBlock;
  __m256 acc[N];
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) acc[i] = _mm256_setzero_ps();
  int32_t totals[N];
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i sums[N];
    fetch_ahead<Format>(w + b * Format::kBytes);
    const __m256 dv = halves(d + b * kTile), mv = m == nullptr ? _mm256_setzero_ps() : halves(m + b * kTile);
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) totals[i] = xr.total[xr.at(r0 + i, b)];
    Sums::template rows<N>(Format{}, w + b * Format::kBytes, xr.block(r0, b), totals, sums);
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) {
      const int64_t at = xr.at(r0 + i, b);
      acc[i] = add(Format{}, acc[i], _mm256_cvtepi32_ps(sums[i]), dv, mv, xr.scale[at], xr.shift[at]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) _mm256_storeu_ps(out + (r0 + i) * out_stride, acc[i]);
}

// run(std::integral_constant<int, count>{}) for 1 <= count <= Most (nothing for 0): the last rows of a tile (fewer
// than a chunk) run as one chunk of their own count, a compile-time constant. A verify step of a few tokens, a
// batch of a few rows or a chunk's remainder so unpacks the weights once and runs its rows' chains side by side.
template <int Most, typename Run>
void with_row_count(int64_t count, const Run& run) {
  if constexpr (Most >= 1) {
    if (count == Most) return run(std::integral_constant<int, Most>{});
    with_row_count<Most - 1>(count, run);
  }
}

// One tile of 8 outputs for every row: chunks of Sums::kRows rows, then the rest as one chunk.
template <typename Format, typename Sums>
void tile_simd(const uint8_t* w, const at::Half* d, const at::Half* m, const QuantRows& xr, int64_t rows, int64_t k,
               float* out, int64_t out_stride) {
  int64_t r0 = 0;
  for (; r0 + Sums::kRows <= rows; r0 += Sums::kRows) {
    rows_of_tile<Format, Sums, Sums::kRows>(w, d, m, xr, r0, k, out, out_stride);
  }
  with_row_count<Sums::kRows - 1>(rows - r0, [&](auto n) {
    rows_of_tile<Format, Sums, decltype(n)::value>(w, d, m, xr, r0, k, out, out_stride);
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
using FastSums = SumsVnni;
#else
using FastSums = SumsAvx2;
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define SPEC_BATCH_TILE_PAIRS 1
// Two neighbouring tiles (16 outputs) a 512-bit register: tile t's 8 outputs in the low half, t + 1's in the high
// half, so each dot product, conversion and multiply-add serves twice the outputs. Every lane computes what the
// 256-bit path computes for its output (the same integers, the same float steps in the same order): same bits.
inline __m512i pair(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}
inline void unpack_pair(Q4Blocks, const uint8_t* a, const uint8_t* b, __m512i* wq) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t p = 0; p < 4; ++p) {
    const __m512i v = pair(a + p * 32, b + p * 32);
    wq[p] = _mm512_and_si512(v, low);
    wq[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  }
}
inline void unpack_pair(Q8Blocks, const uint8_t* a, const uint8_t* b, __m512i* wq) {
  for (int64_t p = 0; p < 8; ++p) wq[p] = pair(a + p * 32, b + p * 32);
}
inline __m512 halves_pair(const at::Half* a, const at::Half* b) {
  const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  return _mm512_cvtph_ps(h);
}
inline __m512i group_pair(const int8_t* x, int64_t p) {
  int32_t g;
  std::memcpy(&g, x + 4 * p, sizeof(g));
  return _mm512_set1_epi32(g);
}
inline __m512 add_pair(Q4Blocks, __m512 acc, __m512 sums, __m512 dv, __m512 mv, float dx, float shift) {
  acc = _mm512_fmadd_ps(sums, _mm512_mul_ps(dv, _mm512_set1_ps(dx)), acc);
  return _mm512_fmadd_ps(mv, _mm512_set1_ps(shift), acc);
}
inline __m512 add_pair(Q8Blocks, __m512 acc, __m512 sums, __m512 dv, __m512, float dx, float) {
  return _mm512_fmadd_ps(sums, _mm512_mul_ps(dv, _mm512_set1_ps(dx)), acc);
}
// Row r's integer sums of block b (Q8: less the 128 * sum(x) its stored offset adds) added to its accumulators:
// the one float step of the VNNI and the AMX paths for a tile pair.
template <typename Format>
inline __m512 add_block_pair(__m512 acc, __m512i sums, const QuantRows& xr, int64_t r, int64_t b, __m512 dv,
                             __m512 mv) {
  const int64_t at = xr.at(r, b);
  if constexpr (std::is_same_v<Format, Q8Blocks>) sums = _mm512_sub_epi32(sums, _mm512_set1_epi32(128 * xr.total[at]));
  return add_pair(Format{}, acc, _mm512_cvtepi32_ps(sums), dv, mv, xr.scale[at], xr.shift[at]);
}

// rows_of_tile for tiles t (w, d, m) and t + 1 (at `next` bytes, `next_scales` halves further): N rows' chains
// interleaved, two a row where few rows leave the products' latency exposed (as SumsVnni::dots).
template <typename Format, int N>
void rows_of_tile_pair(const uint8_t* w, int64_t next, const at::Half* d, const at::Half* m, int64_t next_scales,
                       const QuantRows& xr, int64_t r0, int64_t k, float* out, int64_t out_stride) {
  constexpr int kChains = N <= 4 ? 2 : 1;
  const int64_t blocks = k / kBlock;
  __m512 acc[N];
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i wq[8], part[N][kChains];
    fetch_ahead<Format>(w + b * Format::kBytes);
    fetch_ahead<Format>(w + next + b * Format::kBytes);
    unpack_pair(Format{}, w + b * Format::kBytes, w + next + b * Format::kBytes, wq);
    const __m512 dv = halves_pair(d + b * kTile, d + next_scales + b * kTile);
    const __m512 mv = m == nullptr ? _mm512_setzero_ps() : halves_pair(m + b * kTile, m + next_scales + b * kTile);
    const int8_t* x = xr.block(r0, b);
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) {
#pragma GCC unroll 2
      for (int c = 0; c < kChains; ++c) part[i][c] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int64_t p = 0; p < 8; ++p) {
#pragma GCC unroll 8
      for (int i = 0; i < N; ++i) {
        __m512i& chain = part[i][p % kChains];
        chain = _mm512_dpbusd_epi32(chain, wq[p], group_pair(x + i * kBlock, p));
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) {
      const __m512i sums = kChains == 2 ? _mm512_add_epi32(part[i][0], part[i][kChains - 1]) : part[i][0];
      acc[i] = add_block_pair<Format>(acc[i], sums, xr, r0 + i, b, dv, mv);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) _mm512_storeu_ps(out + (r0 + i) * out_stride, acc[i]);
}

// Calls of at least this many rows run two tiles a 512-bit register; fewer, one tile a 256-bit one (the same bits),
// for W4A8 [0] and W8A8 [1]. Which is faster depends on the CPU (on AMD Zen 4, streaming weights from memory, the
// pairs lose at a few rows): timed as the library loads (loading/kernels/tuning.py).
std::atomic<int64_t> g_tile_pair_rows[2] = {1, 1};

// Two neighbouring tiles for rows r0 on: chunks of 8 rows, then the rest as one chunk.
template <typename Format>
void tile_pair_simd(const uint8_t* w, int64_t next, const at::Half* d, const at::Half* m, int64_t next_scales,
                    const QuantRows& xr, int64_t r0, int64_t rows, int64_t k, float* out, int64_t out_stride) {
  for (; r0 + 8 <= rows; r0 += 8) rows_of_tile_pair<Format, 8>(w, next, d, m, next_scales, xr, r0, k, out, out_stride);
  with_row_count<7>(rows - r0, [&](auto n) {
    rows_of_tile_pair<Format, decltype(n)::value>(w, next, d, m, next_scales, xr, r0, k, out, out_stride);
  });
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define SPEC_BATCH_AMX 1
// AMX (Intel's tile multiply): a block's integer sums for 16 rows x a tile pair's 16 outputs in one instruction,
// A = the rows' int8 activations (QuantRows keeps a block's rows side by side: 16 rows x 32 bytes), B = the block's
// weights as unpack_pair lays them out (8 groups of 4 inputs x 16 outputs, unsigned), C[row][output] = the same
// integers as rows_of_tile_pair's sums. The float steps after it are add_pair's, in the same order: same bits.
constexpr int64_t kAmxRows = 16, kPanelBytes = 8 * 64;

// Linux hands AMX's tile registers only to a process that asks for them (arch_prctl ARCH_REQ_XCOMP_PERM with
// XFEATURE_XTILEDATA); without them the first tile instruction faults. Asked once; refused, AMX stays off.
bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// Calls of at least this many rows run their tile pairs' chunks of 16 rows by tile multiplies, for W4A8 [0] and
// W8A8 [1] (the rest as before).
std::atomic<int64_t> g_amx_rows[2] = {kAmxRows, kAmxRows};

// The thread's tiles for one task: 0 = C (16 rows x 16 int32), 1 = A (16 rows x 32 bytes), 2 = B (8 x 64 bytes);
// released at the end, so that a thread not using them does not carry their 8 KB of state.
struct TileScope {
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 32, 64};
    uint8_t rows[16] = {16, 16, 8};
  };
  TileScope() {
    static const Config config;
    _tile_loadconfig(&config);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// Tiles t and t + 1's weights for every block, unpacked once a call into B's layout (then shared by every chunk
// of 16 rows).
template <typename Format>
void unpack_panels(const uint8_t* w, int64_t next, int64_t blocks, uint8_t* panels) {
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i wq[8];
    unpack_pair(Format{}, w + b * Format::kBytes, w + next + b * Format::kBytes, wq);
    for (int64_t p = 0; p < 8; ++p) _mm512_store_si512(panels + b * kPanelBytes + p * 64, wq[p]);
  }
}

// One block's float steps for 16 rows (add_block_pair's, in order) from its integer sums [row][16 outputs].
template <typename Format>
inline void add_block_amx(const int32_t* sums, const at::Half* d, const at::Half* m, int64_t next_scales,
                          const QuantRows& xr, int64_t r0, int64_t b, __m512* acc) {
  const __m512 dv = halves_pair(d + b * kTile, d + next_scales + b * kTile);
  const __m512 mv = m == nullptr ? _mm512_setzero_ps() : halves_pair(m + b * kTile, m + next_scales + b * kTile);
#pragma GCC unroll 16
  for (int i = 0; i < kAmxRows; ++i) {
    acc[i] = add_block_pair<Format>(acc[i], _mm512_load_si512(sums + i * 16), xr, r0 + i, b, dv, mv);
  }
}

// rows_of_tile_pair for 16 rows from r0, the integer sums from tile multiplies. (Issuing the next blocks'
// multiplies before this block's float steps, or two blocks at a time, measured no faster on a Sapphire Rapids VM:
// a block's tile store and its float steps take about as long as each other, one after the other.)
template <typename Format>
void rows_of_tile_pair_amx(const uint8_t* panels, const at::Half* d, const at::Half* m, int64_t next_scales,
                           const QuantRows& xr, int64_t r0, int64_t k, float* out, int64_t out_stride) {
  const int64_t blocks = k / kBlock;
  alignas(64) int32_t sums[kAmxRows * 16];
  __m512 acc[kAmxRows];
#pragma GCC unroll 16
  for (int i = 0; i < kAmxRows; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    _tile_zero(0);
    _tile_loadd(1, xr.block(r0, b), kBlock);
    _tile_loadd(2, panels + b * kPanelBytes, 64);
    _tile_dpbsud(0, 1, 2);  // signed activations x unsigned weights, as VNNI's dpbusd with the operands swapped
    _tile_stored(0, sums, 64);
    add_block_amx<Format>(sums, d, m, next_scales, xr, r0, b, acc);
  }
#pragma GCC unroll 16
  for (int i = 0; i < kAmxRows; ++i) _mm512_storeu_ps(out + (r0 + i) * out_stride, acc[i]);
}

// Two neighbouring tiles for every row: chunks of 16 rows by tile multiplies, then the rest as tile_pair_simd's.
template <typename Format>
void tile_pair_amx(const uint8_t* w, int64_t next, const at::Half* d, const at::Half* m, int64_t next_scales,
                   const QuantRows& xr, int64_t rows, int64_t k, float* out, int64_t out_stride) {
  const int64_t blocks = k / kBlock;
  thread_local std::vector<__m512i> panels;  // 64-byte aligned (C++17's aligned new)
  panels.resize(blocks * kPanelBytes / sizeof(__m512i));
  uint8_t* panel_bytes = reinterpret_cast<uint8_t*>(panels.data());
  unpack_panels<Format>(w, next, blocks, panel_bytes);
  int64_t r0 = 0;
  for (; r0 + kAmxRows <= rows; r0 += kAmxRows) {
    rows_of_tile_pair_amx<Format>(panel_bytes, d, m, next_scales, xr, r0, k, out, out_stride);
  }
  tile_pair_simd<Format>(w, next, d, m, next_scales, xr, r0, rows, k, out, out_stride);
}
#endif
#endif
#endif

// x [rows, K] float32 or bfloat16; weight uint8 [tiles, blocks, Format::kBytes]; d (and m for Q4) float16 [tiles,
// blocks, 8]. portable: use the portable path (tests compare the two). Returns float32 [rows, tiles * 8].
template <typename Format>
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& d,
                        const c10::optional<at::Tensor>& m, bool portable, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, name, ": x must be [rows, K] with K a multiple of 32");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.numel() == weight.size(0) * weight.size(1) * Format::kBytes, name, ": bad weight");
  TORCH_CHECK(weight.size(1) * kBlock == x.size(1), name, ": weight blocks do not match x's K");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous(), name, ": d must be contiguous float16");
  TORCH_CHECK(!m || (m->scalar_type() == at::kHalf && m->is_contiguous()), name, ": m must be contiguous float16");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), k = xc.size(1), tiles = weight.size(0), blocks = weight.size(1);
  QuantRows xr = xc.scalar_type() == at::kBFloat16
                     ? quantize_rows(xc.data_ptr<c10::BFloat16>(), rows, k, !portable)
                     : quantize_rows(xc.to(at::kFloat).data_ptr<float>(), rows, k, !portable);
  auto out = at::empty({rows, tiles * kTile}, xc.options().dtype(at::kFloat));
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const at::Half *dp = d.data_ptr<at::Half>(), *mp = m ? m->data_ptr<at::Half>() : nullptr;
  float* op = out.data_ptr<float>();
  constexpr int kind = std::is_same_v<Format, Q8Blocks>;
#ifdef SPEC_BATCH_AMX
  const bool amx = !portable && rows >= std::max(kAmxRows, g_amx_rows[kind].load(std::memory_order_relaxed)) &&
                   amx_granted();  // (below 16 rows there is no chunk to multiply)
#endif
  spec_batch_kernels::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
#ifdef SPEC_BATCH_AMX
    std::optional<TileScope> tile_scope;
    if (amx) tile_scope.emplace();
#endif
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* wt = w + t * blocks * Format::kBytes;
      const at::Half *dt = dp + t * blocks * kTile, *mt = mp == nullptr ? nullptr : mp + t * blocks * kTile;
#ifdef SPEC_BATCH_AMX
      if (amx && t + 1 < end) {
        tile_pair_amx<Format>(wt, blocks * Format::kBytes, dt, mt, blocks * kTile, xr, rows, k, op + t * kTile,
                              tiles * kTile);
        ++t;
        continue;
      }
#endif
#ifdef SPEC_BATCH_TILE_PAIRS
      if (!portable && t + 1 < end && rows >= g_tile_pair_rows[kind].load(std::memory_order_relaxed)) {
        tile_pair_simd<Format>(wt, blocks * Format::kBytes, dt, mt, blocks * kTile, xr, 0, rows, k, op + t * kTile,
                               tiles * kTile);
        ++t;
        continue;
      }
#endif
#ifdef __AVX2__
      if (!portable) {
        tile_simd<Format, FastSums>(wt, dt, mt, xr, rows, k, op + t * kTile, tiles * kTile);
        continue;
      }
#endif
      tile_portable<Format>(wt, dt, mt, xr, rows, k, op + t * kTile, tiles * kTile);
    }
  });
  return out;
}


at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& d, bool portable) {
  TORCH_CHECK(weight.dim() == 5, "w8a8_linear: weight must be [tiles, blocks, 8, 8, 4]");
  return block_linear<Q8Blocks>(x, weight, d, c10::nullopt, portable, "w8a8_linear");
}

// A kind's place in the paths' tables: "w4a8" 0, "w8a8" 1.
int kind_index(c10::string_view kind) {
  TORCH_CHECK(kind == "w4a8" || kind == "w8a8", "kind must be w4a8 or w8a8, got ", kind);
  return kind == "w8a8";
}

// A kind's row threshold stored in `table` (nullptr where this build lacks the path: the arguments are checked).
void store_rows(std::atomic<int64_t>* table, c10::string_view kind, int64_t rows, const char* name) {
  const int index = kind_index(kind);
  TORCH_CHECK(rows >= 1, name, ": rows must be >= 1, got ", rows);
  if (table != nullptr) table[index].store(rows);
}

// Each path's thresholds, nullptr where this build lacks the path.
#ifdef SPEC_BATCH_TILE_PAIRS
std::atomic<int64_t>* const kTilePairRows = g_tile_pair_rows;
#else
std::atomic<int64_t>* const kTilePairRows = nullptr;
#endif
#ifdef SPEC_BATCH_AMX
std::atomic<int64_t>* const kAmxRowsTable = g_amx_rows;
#else
std::atomic<int64_t>* const kAmxRowsTable = nullptr;
#endif

// The row count from which a kind's calls run tile pairs; -1 where this build has none.
int64_t tile_pair_rows(c10::string_view kind) {
  const int index = kind_index(kind);
  return kTilePairRows == nullptr ? -1 : kTilePairRows[index].load();
}

void set_tile_pair_rows(c10::string_view kind, int64_t rows) {
  store_rows(kTilePairRows, kind, rows, "set_tile_pair_rows");
}

// How far ahead a kind's calls ask for their weights: "near" or "far" (fetch_ahead); on builds without AVX2 a no-op
// that reads "near".
std::string prefetch(c10::string_view kind) {
  const int index = kind_index(kind);
#ifdef __AVX2__
  if (g_prefetch_far[index].load()) return "far";
#endif
  (void)index;
  return "near";
}

void set_prefetch(c10::string_view kind, c10::string_view distance) {
  const int index = kind_index(kind);
  TORCH_CHECK(distance == "near" || distance == "far", "set_prefetch: distance must be near or far, got ", distance);
#ifdef __AVX2__
  g_prefetch_far[index].store(distance == "far");
#else
  (void)index;
#endif
}

// The row count from which a kind's calls run tile multiplies (AMX); -1 where this build or this process has none.
int64_t amx_rows(c10::string_view kind) {
  const int index = kind_index(kind);
#ifdef SPEC_BATCH_AMX
  if (amx_granted()) return g_amx_rows[index].load();
#endif
  (void)index;
  return -1;
}

void set_amx_rows(c10::string_view kind, int64_t rows) { store_rows(kAmxRowsTable, kind, rows, "set_amx_rows"); }

// Rows `ids` of a W8A8 weight [tiles, blocks, 8, 8, 4] (q + 128) with d [tiles, blocks, 8], dequantized to
// float32 [..., K]: a tied input embedding's lookup. Each element is (q - 128) * d, one product rounded once (the
// bits of the same indexing and arithmetic in torch), in one call instead of a dozen small operators a step.
at::Tensor q8_embedding(const at::Tensor& ids_in, const at::Tensor& weight, const at::Tensor& d) {
  TORCH_CHECK(weight.dim() == 5 && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.size(2) == 8 && weight.size(3) == kTile && weight.size(4) == 4,
              "q8_embedding: weight must be contiguous uint8 [tiles, blocks, 8, 8, 4]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous(), "q8_embedding: d must be contiguous float16");
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t tiles = weight.size(0), blocks = weight.size(1), k = blocks * kBlock, n = ids.numel();
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, weight.options().dtype(at::kFloat));
  const int64_t* ip = ids.data_ptr<int64_t>();
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    const int64_t id = ip[r], t = id / kTile, o = id % kTile;
    TORCH_CHECK(id >= 0 && t < tiles, "q8_embedding: id ", id, " is out of range");
    for (int64_t b = 0; b < blocks; ++b) {
      const float scale = static_cast<float>(dp[(t * blocks + b) * kTile + o]);
      const uint8_t* block = w + (t * blocks + b) * 8 * kTile * 4;
      float* dst = op + r * k + b * kBlock;
      for (int64_t p = 0; p < 8; ++p) {
        for (int64_t j = 0; j < 4; ++j) {
          dst[p * 4 + j] = static_cast<float>(static_cast<int32_t>(block[(p * kTile + o) * 4 + j]) - 128) * scale;
        }
      }
    }
  }
  return out;
}

}  // namespace

namespace spec_batch_kernels {
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& d, const at::Tensor& m,
                       bool portable) {
  TORCH_CHECK(weight.dim() == 5, "w4a8_linear: weight must be [tiles, blocks, 4, 8, 4]");
  return block_linear<Q4Blocks>(x, weight, d, m, portable, "w4a8_linear");
}
}  // namespace spec_batch_kernels

TORCH_LIBRARY_FRAGMENT(spec_batch, m) {
  m.def("w4a8_linear(Tensor x, Tensor weight, Tensor d, Tensor m, bool portable=False) -> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor weight, Tensor d, bool portable=False) -> Tensor");
  m.def("q8_embedding(Tensor ids, Tensor weight, Tensor d) -> Tensor");
  m.def("tile_pair_rows(str kind) -> int", tile_pair_rows);  // no tensors: catch-all kernels
  m.def("set_tile_pair_rows(str kind, int rows) -> ()", set_tile_pair_rows);
  m.def("amx_rows(str kind) -> int", amx_rows);
  m.def("set_amx_rows(str kind, int rows) -> ()", set_amx_rows);
  m.def("prefetch(str kind) -> str", prefetch);
  m.def("set_prefetch(str kind, str distance) -> ()", set_prefetch);
}

TORCH_LIBRARY_IMPL(spec_batch, CPU, m) {
  m.impl("w4a8_linear", spec_batch_kernels::w4a8_linear);
  m.impl("w8a8_linear", w8a8_linear);
  m.impl("q8_embedding", q8_embedding);
}
