// Attention on the CPU whose result for a query does not depend on the step that computes it.
//
// For each (row, head, query) the kernel reads the visible key columns in column order and nothing else: the
// score of a column is a dot product summed in 16 fixed lanes, the softmax's maximum is exact, and the weighted
// sum of values and the normalizer are accumulated column by column. Masked columns are skipped, not added as
// zeros, so a query's numbers are the same bits whatever the step's width (other queries), its key length
// (masked columns after a rollback or beside longer rows) or its batch. That is the guarantee speculative
// decoding needs for greedy output to equal plain decoding; it holds in the compute dtype (fp32 or bf16 inputs,
// fp32 accumulation), so the KV cache stays in the model's dtype.
//
// Where the CPU has AVX-512, or AVX2 and FMA, the same arithmetic runs in vectors: a score's 16 lanes are one
// register (two with AVX2), exp is the C library's expf computed 8 at a time (checked against it), and a query's
// weighted sum of values stays in registers across the columns. `portable` selects the plain C++ path (tests
// compare the two). A query that sees no column (a padded position of a verify step) costs nothing and gets zeros,
// and the threads split the queries by the columns they see, since a verify step's real queries crowd into the
// rows that drafted most.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_attention.h"
#include "spin_pool.h"
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__AVX512BW__)
#define SPEC_BATCH_ATTENTION_AVX512 1
#define SPEC_BATCH_ATTENTION_VECTOR 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define SPEC_BATCH_ATTENTION_AVX2 1  // the same arithmetic in 256-bit registers (Zen 2/3, Intel before AVX-512)
#define SPEC_BATCH_ATTENTION_VECTOR 1
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kLanes = 16;

template <typename T>
inline float dot(const float* q, const T* k, int64_t dim) {
  float part[kLanes] = {0};
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) part[l] += q[d + l] * static_cast<float>(k[d + l]);
  }
  for (int64_t l = 0; d < dim; ++d, ++l) part[l] += q[d] * static_cast<float>(k[d]);
  // a fixed pairwise tree over the lanes
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t l = 0; l < width; ++l) part[l] += part[l + width];
  }
  return part[0];
}

// acc[d] += p * v[d], each a product rounded and then a sum rounded (no contraction: -ffp-contract=off)
template <typename T>
inline void axpy(float p, const T* v, float* acc, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += p * static_cast<float>(v[d]);
}

#ifdef SPEC_BATCH_ATTENTION_VECTOR
// exp of 8 floats in [-87.5, 0], the C library's expf bit for bit: glibc's (since 2.28) table-driven method in
// double precision, N = 32: 2^(k/N) from a table of 2^(i/N), a cubic in the remainder, one rounding to float at
// the end. The table holds the doubles nearest 2^(i/32) less i << 47 (so that adding k << 47 scales by 2^(k/32)).
// Checked against the system's expf on every float in [-87.5, 0] (docs/benchmarks.md); `exp_matches_libm` checks
// a sample on every machine, and where the C library computes otherwise the kernel calls it instead.
constexpr uint64_t kExpTable[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b,
    0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb,
    0x3feedea64c123422, 0x3feece086061892d, 0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429,
    0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d, 0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540};
constexpr double kExpSteps = 32.0;
constexpr float kExpLowest = -87.5f;  // below it (and for NaN) the C library's own special cases apply
#endif

#ifdef SPEC_BATCH_ATTENTION_AVX512
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {  // bf16 -> fp32 is exact: the 16 bits moved up
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const float* x, __mmask16 m) { return _mm512_maskz_loadu_ps(m, x); }
inline __m512 load16(const c10::BFloat16* x, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// `dot`'s bits: lane l sums q[d] * k[d] over d = l mod 16 in order (a masked add for a ragged tail leaves the
// other lanes as they were), then the same pairwise tree (8, 4, 2, 1)
template <typename T>
inline float dot_vector(const float* q, const T* k, int64_t dim) {
  __m512 part = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) part = _mm512_add_ps(part, _mm512_mul_ps(_mm512_loadu_ps(q + d), load16(k + d)));
  if (d < dim) {
    const __mmask16 m = static_cast<__mmask16>((1u << (dim - d)) - 1);
    part = _mm512_mask_add_ps(part, m, part, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, q + d), load16(k + d, m)));
  }
  const __m256 w8 = _mm256_add_ps(_mm512_castps512_ps256(part), _mm512_extractf32x8_ps(part, 1));
  const __m128 w4 = _mm_add_ps(_mm256_castps256_ps128(w8), _mm256_extractf128_ps(w8, 1));
  const __m128 w2 = _mm_add_ps(w4, _mm_movehl_ps(w4, w4));
  return _mm_cvtss_f32(_mm_add_ss(w2, _mm_shuffle_ps(w2, w2, 1)));
}

// where dots16's transposing tree leaves column c: lane kDots16Order[c]
alignas(64) constexpr int32_t kDots16Order[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

// 16 columns' scores at once, each `dot_vector`'s bits: column c's lanes are summed over d in the same order, and
// the 16 lane trees run side by side (a transpose as they go: each level adds the same pairs of lanes, the halves
// of two registers packed into one), so a column costs a quarter of the shuffles. dim: a multiple of 16.
template <typename T>
inline __m512 dots16(const float* q, const T* const* k, int64_t dim) {
  __m512 part[16];
  for (int c = 0; c < 16; ++c) part[c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += kLanes) {
    const __m512 qv = _mm512_loadu_ps(q + d);
    for (int c = 0; c < 16; ++c) part[c] = _mm512_add_ps(part[c], _mm512_mul_ps(qv, load16(k[c] + d)));
  }
  // width 8: [a0..7 | b0..7] + [a8..15 | b8..15]
  __m512 w8[8];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = part[2 * i], b = part[2 * i + 1];
    w8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // width 4: blocks of 4 lanes; [a0..3 b0..3 | c0..3 d0..3] + [a4..7 b4..7 | c4..7 d4..7]
  __m512 w4[4];
  for (int i = 0; i < 4; ++i) {
    const __m512 ab = w8[2 * i], cd = w8[2 * i + 1];
    w4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  // width 2 and 1, within each 128-bit block
  __m512 w2[2];
  for (int i = 0; i < 2; ++i) {
    const __m512 x = w4[2 * i], y = w4[2 * i + 1];
    w2[i] = _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_ps(w2[0], w2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_ps(w2[0], w2[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_loadu_si512(kDots16Order), w1);  // lanes back in column order
}

template <typename T>
inline void axpy_vector(float p, const T* v, float* acc, int64_t dim) {
  const __m512 pv = _mm512_set1_ps(p);
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    _mm512_storeu_ps(acc + d, _mm512_add_ps(_mm512_loadu_ps(acc + d), _mm512_mul_ps(pv, load16(v + d))));
  }
  for (; d < dim; ++d) acc[d] += p * static_cast<float>(v[d]);
}

// acc[d] += p[c] * v[c][d] over the columns c in order, `axpy`'s arithmetic, with acc held in registers across the
// columns (Chunks * 16 = dim) instead of stored and reloaded for each, and the columns' weights summed in order into
// total (a chain of its own, overlapping the sums'); for G heads that read the same value rows (grouped-query
// attention), each column's row loaded once for all G, each head's sums in its own registers (its bits as alone).
// p: head g's weights at p + g * p_stride; acc, total: head g's at acc + g * Chunks * 16, total + g.
template <int Chunks, int G, typename T>
inline void weighted_sum_heads(const float* p, int64_t p_stride, const int64_t* cols, int64_t count, const T* v,
                               int64_t stride, float* acc, float* total) {
  __m512 sum[G][Chunks];
  float weights[G];
  for (int g = 0; g < G; ++g) {
    weights[g] = total[g];
    for (int i = 0; i < Chunks; ++i) sum[g][i] = _mm512_loadu_ps(acc + (g * Chunks + i) * 16);
  }
  for (int64_t c = 0; c < count; ++c) {
    const T* row = v + cols[c] * stride;
    __m512 values[Chunks];
    for (int i = 0; i < Chunks; ++i) values[i] = load16(row + 16 * i);
    for (int g = 0; g < G; ++g) {
      const float w = p[g * p_stride + c];
      weights[g] += w;
      const __m512 pv = _mm512_set1_ps(w);
      for (int i = 0; i < Chunks; ++i) sum[g][i] = _mm512_add_ps(sum[g][i], _mm512_mul_ps(pv, values[i]));
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int i = 0; i < Chunks; ++i) _mm512_storeu_ps(acc + (g * Chunks + i) * 16, sum[g][i]);
    total[g] = weights[g];
  }
}

// the largest of count floats: exact whatever the order (ties between -0 and +0 give the same exp(x - top))
inline float largest(const float* x, int64_t count) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t c = 0;
  for (; c + 16 <= count; c += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(x + c));
  float out = _mm512_reduce_max_ps(top);
  for (; c < count; ++c) out = x[c] > out ? x[c] : out;
  return out;
}
#elif defined(SPEC_BATCH_ATTENTION_AVX2)
// The AVX-512 path's arithmetic in 256-bit registers: a score's 16 lanes are two registers (lanes 0-7, 8-15), the
// same products and sums in each lane, the same pairwise tree; values' weighted sums in registers, 8 lanes each.
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::BFloat16* x) {  // bf16 -> fp32 is exact: the 16 bits moved up
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// `dot`'s bits: lane l sums q[d] * k[d] over d = l mod 16 in order, then the pairwise tree (8, 4, 2, 1)
template <typename T>
inline float dot_vector(const float* q, const T* k, int64_t dim) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(q + d), load8(k + d)));
    hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(q + d + 8), load8(k + d + 8)));
  }
  if (d < dim) {  // a ragged tail: the lanes it reaches, one at a time, then `dot`'s tree
    alignas(32) float part[kLanes];
    _mm256_store_ps(part, lo);
    _mm256_store_ps(part + 8, hi);
    for (int64_t l = 0; d < dim; ++d, ++l) part[l] += q[d] * static_cast<float>(k[d]);
    for (int64_t width = kLanes / 2; width > 0; width /= 2) {
      for (int64_t l = 0; l < width; ++l) part[l] += part[l + width];
    }
    return part[0];
  }
  const __m256 w8 = _mm256_add_ps(lo, hi);
  const __m128 w4 = _mm_add_ps(_mm256_castps256_ps128(w8), _mm256_extractf128_ps(w8, 1));
  const __m128 w2 = _mm_add_ps(w4, _mm_movehl_ps(w4, w4));
  return _mm_cvtss_f32(_mm_add_ss(w2, _mm_shuffle_ps(w2, w2, 1)));
}

template <typename T>
inline void axpy_vector(float p, const T* v, float* acc, int64_t dim) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    _mm256_storeu_ps(acc + d, _mm256_add_ps(_mm256_loadu_ps(acc + d), _mm256_mul_ps(pv, load8(v + d))));
  }
  for (; d < dim; ++d) acc[d] += p * static_cast<float>(v[d]);
}

// acc[d] += p[c] * v[c][d] for Regs * 8 lanes of d from `offset`, over the columns in order, in registers
template <int Regs, typename T>
inline void weighted_lanes(const float* p, const int64_t* cols, int64_t count, const T* v, int64_t stride, float* acc) {
  __m256 sum[Regs];
  for (int i = 0; i < Regs; ++i) sum[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int64_t c = 0; c < count; ++c) {
    const __m256 pv = _mm256_set1_ps(p[c]);
    const T* row = v + cols[c] * stride;
    for (int i = 0; i < Regs; ++i) sum[i] = _mm256_add_ps(sum[i], _mm256_mul_ps(pv, load8(row + 8 * i)));
  }
  for (int i = 0; i < Regs; ++i) _mm256_storeu_ps(acc + 8 * i, sum[i]);
}

// the AVX-512 path's weighted sum of one head (Chunks * 16 = dim): 8 registers of lanes at a time (AVX2 has 16)
template <int Chunks, typename T>
inline void weighted_sum(const float* p, const int64_t* cols, int64_t count, const T* v, int64_t stride, float* acc,
                         float* total) {
  constexpr int kRegs = 2 * Chunks < 8 ? 2 * Chunks : 8;
  for (int d = 0; d < 16 * Chunks; d += 8 * kRegs) weighted_lanes<kRegs>(p, cols, count, v + d, stride, acc + d);
  float weights = *total;
  for (int64_t c = 0; c < count; ++c) weights += p[c];
  *total = weights;
}

// the largest of count floats: exact whatever the order (ties between -0 and +0 give the same exp(x - top))
inline float largest(const float* x, int64_t count) {
  __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t c = 0;
  for (; c + 8 <= count; c += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(x + c));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float out = lanes[0];
  for (int l = 1; l < 8; ++l) out = lanes[l] > out ? lanes[l] : out;
  for (; c < count; ++c) out = x[c] > out ? x[c] : out;
  return out;
}
#endif

#ifdef SPEC_BATCH_ATTENTION_VECTOR
// The method above on 4 doubles, in AVX2 + FMA (which AVX-512 CPUs have too: one exp for both paths)
inline __m256d exp4(__m256d xd) {
  const __m256d scaled = _mm256_set1_pd(0x1.71547652b82fep+0 * kExpSteps);
  const __m256d shift = _mm256_set1_pd(0x1.8p+52);  // rounds x * N / ln2 to an integer k in the low bits
  const __m256d shifted = _mm256_fmadd_pd(scaled, xd, shift);
  const __m256d k = _mm256_sub_pd(shifted, shift);
  const __m256d r = _mm256_fmsub_pd(scaled, xd, k);  // x * N / ln2 - k, in [-1/2, 1/2]
  const __m256i bits = _mm256_castpd_si256(shifted);
  const __m256i entry = _mm256_i64gather_epi64(reinterpret_cast<const long long*>(kExpTable),
                                               _mm256_and_si256(bits, _mm256_set1_epi64x(31)), 8);
  const __m256d scale = _mm256_castsi256_pd(_mm256_add_epi64(entry, _mm256_slli_epi64(bits, 47)));
  const __m256d c0 = _mm256_set1_pd(0x1.c6af84b912394p-5 / (kExpSteps * kExpSteps * kExpSteps));
  const __m256d c1 = _mm256_set1_pd(0x1.ebfce50fac4f3p-3 / (kExpSteps * kExpSteps));
  const __m256d c2 = _mm256_set1_pd(0x1.62e42ff0c52d6p-1 / kExpSteps);
  const __m256d upper = _mm256_fmadd_pd(c0, r, c1);
  const __m256d lower = _mm256_fmadd_pd(c2, r, _mm256_set1_pd(1.0));
  const __m256d poly = _mm256_fmadd_pd(upper, _mm256_mul_pd(r, r), lower);
  return _mm256_mul_pd(poly, scale);
}

// exp of 8 floats: two halves of 4, each rounded to float once
inline __m256 exp8(__m256 x) {
  const __m128 lo = _mm256_cvtpd_ps(exp4(_mm256_cvtps_pd(_mm256_castps256_ps128(x))));
  const __m128 hi = _mm256_cvtpd_ps(exp4(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1))));
  return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}

// whether exp8 gives this machine's expf bits: every 4099th float of [-87.5, 0] and the edges, once a process
bool exp_matches_libm() {
  static const bool matches = [] {
    alignas(32) float in[8], out[8];
    auto same = [&](int lanes) {
      _mm256_store_ps(out, exp8(_mm256_load_ps(in)));
      for (int l = 0; l < lanes; ++l) {
        const float want = std::exp(in[l]);
        if (std::memcmp(&want, &out[l], sizeof(float)) != 0) return false;
      }
      return true;
    };
    const float edges[8] = {0.f, -0.f, kExpLowest, -0x1.f8cbb2p+5f, -1e-30f, -0.5f, -1.f, -87.49f};
    std::memcpy(in, edges, sizeof(in));
    if (!same(8)) return false;
    uint32_t lowest;
    std::memcpy(&lowest, &kExpLowest, sizeof(lowest));
    int lane = 0;
    for (uint64_t u = 0x80000000u; u <= lowest; u += 4099) {
      const uint32_t v = static_cast<uint32_t>(u);
      std::memcpy(&in[lane++], &v, sizeof(float));
      if (lane == 8) {
        if (!same(8)) return false;
        lane = 0;
      }
    }
    return true;
  }();
  return matches;
}

// scores[c] = exp(scores[c] - top) for c < count, eight at a time where all eight lie in exp8's range
inline void exp_shifted(float* scores, int64_t count, float top) {
  const __m256 topv = _mm256_set1_ps(top), lowest = _mm256_set1_ps(kExpLowest), zero = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= count; c += 8) {
    const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(scores + c), topv);
    const __m256 in_range = _mm256_and_ps(_mm256_cmp_ps(x, lowest, _CMP_GE_OQ), _mm256_cmp_ps(x, zero, _CMP_LE_OQ));
    if (_mm256_movemask_ps(in_range) == 0xFF) {
      _mm256_storeu_ps(scores + c, exp8(x));
    } else {
      for (int64_t j = c; j < c + 8; ++j) scores[j] = std::exp(scores[j] - top);
    }
  }
  for (; c < count; ++c) scores[c] = std::exp(scores[c] - top);
}
#endif

// The visible columns of a mask row (`stride` apart): counted, and listed in order. Contiguous rows go 16 or 64
// (AVX-512), 32 (AVX2) at a time: a verify step scans every query's row twice, and scalar scans cost as much as
// the short rows' dot products.
inline int64_t count_visible(const bool* vis, int64_t stride, int64_t length) {
  int64_t count = 0, j = 0;
#ifdef SPEC_BATCH_ATTENTION_AVX512
  for (; stride == 1 && j + 64 <= length; j += 64) {
    const __m512i bytes = _mm512_loadu_si512(vis + j);
    count += __builtin_popcountll(_mm512_test_epi8_mask(bytes, bytes));
  }
#elif defined(SPEC_BATCH_ATTENTION_AVX2)
  for (; stride == 1 && j + 32 <= length; j += 32) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vis + j));
    count += 32 - __builtin_popcount(_mm256_movemask_epi8(_mm256_cmpeq_epi8(bytes, _mm256_setzero_si256())));
  }
#endif
  for (; j < length; ++j) count += vis[j * stride];
  return count;
}

inline int64_t list_visible(const bool* vis, int64_t stride, int64_t length, int64_t* cols) {
  int64_t count = 0, j = 0;
#ifdef SPEC_BATCH_ATTENTION_AVX512
  const __m512i lanes = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0), eight = _mm512_set1_epi64(8);
  for (; stride == 1 && j + 16 <= length; j += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(vis + j));
    const __mmask16 seen = _mm_test_epi8_mask(bytes, bytes);
    const __m512i low = _mm512_add_epi64(_mm512_set1_epi64(j), lanes);
    // compressed in a register, then stored whole: a compressing store to memory is microcoded on Zen 4 (a fifth
    // of the kernel's time at 200 columns). Each store writes 8 lanes from `count` <= j (+ 8): within [0, length).
    _mm512_storeu_si512(cols + count, _mm512_maskz_compress_epi64(static_cast<__mmask8>(seen), low));
    count += __builtin_popcount(seen & 0xFFu);
    _mm512_storeu_si512(cols + count, _mm512_maskz_compress_epi64(static_cast<__mmask8>(seen >> 8),
                                                                  _mm512_add_epi64(low, eight)));
    count += __builtin_popcount(seen >> 8);
  }
#elif defined(SPEC_BATCH_ATTENTION_AVX2)
  for (; stride == 1 && j + 32 <= length; j += 32) {  // the set bits of 32 columns, lowest first
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vis + j));
    uint32_t seen = ~static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(bytes, _mm256_setzero_si256())));
    for (; seen != 0; seen &= seen - 1) cols[count++] = j + __builtin_ctz(seen);
  }
#endif
  for (; j < length; ++j) {
    if (vis[j * stride]) cols[count++] = j;
  }
  return count;
}

// below this much work (visible columns times the head size) a step runs on the calling thread
constexpr int64_t kParallelWork = int64_t{1} << 18;

// The (row, set of heads, query) tasks split into contiguous runs of about equal work, a few a thread (visible columns,
// plus one for the scan), not of equal count: in a verify step the real queries crowd into the rows that
// drafted most (a padded query sees nothing), and an even split by count would leave one thread all the work.
template <typename F>
void parallel_by_work(const std::vector<int64_t>& work_before, int64_t dim, const F& run) {
  const int64_t tasks = static_cast<int64_t>(work_before.size()) - 1, total = work_before.back();
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, tasks));
  // a small step (one row of one token) runs on the calling thread: a parallel region costs more than its work,
  // and far more on a busy machine, where it waits for a descheduled thread
  if (threads == 1 || total * dim < kParallelWork) {
    run(0, tasks);
    return;
  }
  const int64_t parts = std::min<int64_t>(spec_batch_kernels::kPiecesPerThread * threads, tasks);
  spec_batch_kernels::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      auto cut = [&](int64_t i) {
        return i == parts ? tasks
                          : std::lower_bound(work_before.begin(), work_before.end(), total * i / parts) -
                                work_before.begin();
      };
      const int64_t lo = std::min(cut(t), tasks), hi = std::min(cut(t + 1), tasks);
      if (lo < hi) run(lo, hi);
    }
  });
}

// The weighted sums of `heads` heads over the same columns: with AVX-512 up to 4 heads at a time (2 at dim 128:
// the registers), with AVX2 one at a time; false where this build or the head size has no vector path
template <typename T>
bool weighted_sums(const float* p, int64_t p_stride, const int64_t* cols, int64_t count, const T* v, int64_t stride,
                   int64_t dim, int64_t heads, float* acc, float* total) {
#ifdef SPEC_BATCH_ATTENTION_AVX512
  if (dim != 64 && dim != 128) return false;
  for (int64_t g = 0; g < heads;) {
    const int64_t take = std::min<int64_t>(heads - g, dim == 64 ? 4 : 2);
    const float* pg = p + g * p_stride;
    float* ag = acc + g * dim;
    if (dim == 64) {
      if (take == 4) weighted_sum_heads<4, 4>(pg, p_stride, cols, count, v, stride, ag, total + g);
      if (take == 3) weighted_sum_heads<4, 3>(pg, p_stride, cols, count, v, stride, ag, total + g);
      if (take == 2) weighted_sum_heads<4, 2>(pg, p_stride, cols, count, v, stride, ag, total + g);
      if (take == 1) weighted_sum_heads<4, 1>(pg, p_stride, cols, count, v, stride, ag, total + g);
    } else {
      if (take == 2) weighted_sum_heads<8, 2>(pg, p_stride, cols, count, v, stride, ag, total + g);
      if (take == 1) weighted_sum_heads<8, 1>(pg, p_stride, cols, count, v, stride, ag, total + g);
    }
    g += take;
  }
  return true;
#elif defined(SPEC_BATCH_ATTENTION_AVX2)
  if (dim != 64 && dim != 128) return false;
  for (int64_t g = 0; g < heads; ++g) {
    if (dim == 64) {
      weighted_sum<4>(p + g * p_stride, cols, count, v, stride, acc + g * dim, total + g);
    } else {
      weighted_sum<8>(p + g * p_stride, cols, count, v, stride, acc + g * dim, total + g);
    }
  }
  return true;
#else
  (void)p, (void)p_stride, (void)cols, (void)count, (void)v, (void)stride, (void)dim, (void)heads, (void)acc,
      (void)total;
  return false;
#endif
}

// A task is one query of one row for a set of heads that see the same columns: the query heads that share a
// key/value head where the mask is broadcast over heads (grouped-query attention: each key and value row is read
// once for the set, from L1, instead of once a head), else a single head. Each head's arithmetic is the same as
// alone, so its bits do not depend on the set.
template <typename T>
void attend_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const at::Tensor& visible, const at::Tensor& bias, bool has_bias, double scale, bool portable,
                   at::Tensor& out) {
  const int64_t rows = query.size(0), heads = query.size(1), n = query.size(2), dim = query.size(3);
  const int64_t kv_heads = key.size(1), length = key.size(2), group = heads / kv_heads;
  const T* q_ptr = query.data_ptr<T>();
  const T* k_ptr = key.data_ptr<T>();
  const T* v_ptr = value.data_ptr<T>();
  const bool* vis_ptr = visible.data_ptr<bool>();
  const float* bias_ptr = has_bias ? bias.data_ptr<float>() : nullptr;
  T* o_ptr = out.data_ptr<T>();
  const auto qs = query.strides(), ks = key.strides(), vs = value.strides(), ms = visible.strides();
  const auto os = out.strides();
  const float fscale = static_cast<float>(scale);
  auto visible_row = [&](int64_t b, int64_t h, int64_t i) {
    return vis_ptr + (visible.size(0) == 1 ? 0 : b * ms[0]) + (visible.size(1) == 1 ? 0 : h * ms[1]) + i * ms[2];
  };
  const bool per_head = visible.size(1) != 1;
  // heads a task computes: a set shares its columns (a bias is laid out per head). Even a batch-1 decode step's
  // three sets (2:1 between two threads) beat nine single heads split 5:4 (1000 columns: 42 against 55 us)
  const int64_t set = per_head || has_bias ? 1 : group, sets = heads / set, tasks = rows * sets * n;
  // each task's work: its heads' visible columns, counted once per mask row, plus one for the scan
  std::vector<int64_t> work_before(tasks + 1, 0);
  {
    std::vector<int64_t> seen(per_head ? 0 : n);
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / (sets * n), h = (task / n) % sets * set, i = task % n;
      int64_t count = 0;
      if (!per_head && h > 0) {
        count = seen[i];
      } else {
        count = count_visible(visible_row(b, h, i), ms[3], length);
        if (!per_head) seen[i] = count;
      }
      work_before[task + 1] = work_before[task] + set * count + 1;
    }
  }
  bool vector_path = false, vector_exp = false;
#ifdef SPEC_BATCH_ATTENTION_VECTOR
  vector_path = !portable;
  vector_exp = vector_path && exp_matches_libm();
#endif
  parallel_by_work(work_before, dim, [&](int64_t begin, int64_t end) {
    std::vector<float> q(set * dim), acc(set * dim), scores(set * length), total(set);
    std::vector<int64_t> cols(length);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (sets * n), h0 = (task / n) % sets * set, i = task % n, kvh = h0 / group;
      if (work_before[task + 1] - work_before[task] == 1) {  // sees nothing (a padded query): zeros
        for (int64_t g = 0; g < set; ++g) {
          T* orow = o_ptr + b * os[0] + i * os[1] + (h0 + g) * os[2];
          for (int64_t d = 0; d < dim; ++d) orow[d] = static_cast<T>(0.f);
        }
        continue;
      }
      for (int64_t g = 0; g < set; ++g) {
        const T* qrow = q_ptr + b * qs[0] + (h0 + g) * qs[1] + i * qs[2];
        for (int64_t d = 0; d < dim; ++d) q[g * dim + d] = static_cast<float>(qrow[d]);
      }
      const bool* vis = visible_row(b, h0, i);
      const float* brow = has_bias ? bias_ptr + (vis - vis_ptr) : nullptr;  // same layout as visible
      const int64_t count = list_visible(vis, ms[3], length, cols.data());
      const T* kbase = k_ptr + b * ks[0] + kvh * ks[1];
      int64_t c = 0;
#ifdef SPEC_BATCH_ATTENTION_VECTOR
      // 16 (AVX-512) or four columns' dot products at a time: independent, so they overlap (each is `dot`'s bits);
      // a block's key rows serve every head of the set while they are in L1
      if (vector_path) {
#ifdef SPEC_BATCH_ATTENTION_AVX512
        if (dim % kLanes == 0) {
          const T* rows16[16];
          for (; c + 16 <= count; c += 16) {
            for (int j = 0; j < 16; ++j) rows16[j] = kbase + cols[c + j] * ks[2];
            for (int64_t g = 0; g < set; ++g) {
              const __m512 dots = dots16(q.data() + g * dim, rows16, dim);
              _mm512_storeu_ps(scores.data() + g * length + c, _mm512_mul_ps(dots, _mm512_set1_ps(fscale)));
            }
          }
        }
#endif
        for (; c + 4 <= count; c += 4) {
          for (int64_t g = 0; g < set; ++g) {
            const float* qg = q.data() + g * dim;
            float* sg = scores.data() + g * length;
            const float s0 = dot_vector(qg, kbase + cols[c] * ks[2], dim);
            const float s1 = dot_vector(qg, kbase + cols[c + 1] * ks[2], dim);
            const float s2 = dot_vector(qg, kbase + cols[c + 2] * ks[2], dim);
            const float s3 = dot_vector(qg, kbase + cols[c + 3] * ks[2], dim);
            sg[c] = s0 * fscale, sg[c + 1] = s1 * fscale, sg[c + 2] = s2 * fscale, sg[c + 3] = s3 * fscale;
          }
        }
        for (; c < count; ++c) {
          for (int64_t g = 0; g < set; ++g) {
            scores[g * length + c] = dot_vector(q.data() + g * dim, kbase + cols[c] * ks[2], dim) * fscale;
          }
        }
      }
#endif
      for (; c < count; ++c) {
        for (int64_t g = 0; g < set; ++g) {
          scores[g * length + c] = dot(q.data() + g * dim, kbase + cols[c] * ks[2], dim) * fscale;
        }
      }
      if (brow) {  // set == 1
        for (c = 0; c < count; ++c) scores[c] += brow[cols[c] * ms[3]];
      }
      for (int64_t g = 0; g < set; ++g) {
        float* sg = scores.data() + g * length;
        float top = -std::numeric_limits<float>::infinity();
#ifdef SPEC_BATCH_ATTENTION_VECTOR
        if (vector_path) top = largest(sg, count);
#endif
        for (c = 0; !vector_path && c < count; ++c) top = sg[c] > top ? sg[c] : top;
#ifdef SPEC_BATCH_ATTENTION_VECTOR
        if (vector_exp) {
          exp_shifted(sg, count, top);
        } else {
          for (int64_t c = 0; c < count; ++c) sg[c] = std::exp(sg[c] - top);
        }
#else
        for (int64_t c = 0; c < count; ++c) sg[c] = std::exp(sg[c] - top);
#endif
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(total.begin(), total.end(), 0.f);
      const T* vbase = v_ptr + b * vs[0] + kvh * vs[1];
      const bool summed = vector_path && weighted_sums(scores.data(), length, cols.data(), count, vbase, vs[2], dim,
                                                       set, acc.data(), total.data());
      for (int64_t g = 0; g < set && !summed; ++g) {
        const float* sg = scores.data() + g * length;
        float* ag = acc.data() + g * dim;
        for (int64_t c = 0; c < count; ++c) {
          const float p = sg[c];
          total[g] += p;
          const T* vrow = vbase + cols[c] * vs[2];
#ifdef SPEC_BATCH_ATTENTION_VECTOR
          if (vector_path) {
            axpy_vector(p, vrow, ag, dim);
            continue;
          }
#endif
          axpy(p, vrow, ag, dim);
        }
      }
      for (int64_t g = 0; g < set; ++g) {
        T* orow = o_ptr + b * os[0] + i * os[1] + (h0 + g) * os[2];
        const float inv = count > 0 ? 1.f / total[g] : 0.f;
        for (int64_t d = 0; d < dim; ++d) orow[d] = static_cast<T>(acc[g * dim + d] * inv);
      }
    }
  });
}

// query [B, H, n, D]; key, value [B, Hkv, L, D] (last dim contiguous); visible: bool, broadcastable to
// [B, H, n, L]; bias: float32 of visible's shape added to visible scores, or empty. Returns [B, n, H, D].
at::Tensor attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& visible,
                  const at::Tensor& bias, double scale, bool portable) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && visible.dim() == 4, "4-d inputs expected");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "query, key and value must share a dtype");
  TORCH_CHECK(query.size(1) % key.size(1) == 0, "query heads must be a multiple of key/value heads");
  TORCH_CHECK(visible.scalar_type() == at::kBool && visible.size(2) == query.size(2) &&
                  visible.size(3) == key.size(2), "visible must be bool [B|1, H|1, n, L]");
  const bool has_bias = bias.numel() > 0;
  at::Tensor b = has_bias ? bias.to(at::kFloat).expand(visible.sizes()).contiguous() : bias;
  at::Tensor vis = has_bias ? visible.expand(visible.sizes()).contiguous() : visible;
  at::Tensor q = query.stride(3) == 1 ? query : query.contiguous();
  at::Tensor k = key.stride(3) == 1 ? key : key.contiguous();
  at::Tensor v = value.stride(3) == 1 ? value : value.contiguous();
  auto out = at::empty({query.size(0), query.size(2), query.size(1), query.size(3)}, query.options());
  if (q.scalar_type() == at::kFloat) {
    attend_kernel<float>(q, k, v, vis, b, has_bias, scale, portable, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    attend_kernel<c10::BFloat16>(q, k, v, vis, b, has_bias, scale, portable, out);
  } else {
    TORCH_CHECK(false, "attend: float32 or bfloat16 expected, got ", q.scalar_type());
  }
  return out;
}

// slab[:, :, at : at + n] = x [B, H, n, D]: row by row where both hold D contiguous elements of one dtype (a copy
// is exact in any order), else through ATen's copy (a dtype conversion, an odd layout). From the stack's loop this
// runs twice a layer, and ATen's copy costs a few microseconds of set-up each time for a few hundred bytes.
void write_columns(const at::Tensor& slab, const at::Tensor& x, int64_t at) {
  const int64_t rows = x.size(0), heads = x.size(1), n = x.size(2), dim = x.size(3);
  if (slab.scalar_type() != x.scalar_type() || slab.stride(3) != 1 || x.stride(3) != 1 || slab.size(0) != rows ||
      slab.size(1) != heads || slab.size(3) != dim) {
    slab.narrow(2, at, n).copy_(x);
    return;
  }
  const int64_t size = x.element_size(), bytes = dim * size;
  const auto ss = slab.strides(), xs = x.strides();
  char* out = static_cast<char*>(slab.data_ptr());
  const char* in = static_cast<const char*>(x.const_data_ptr());
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < n; ++i) {
        std::memcpy(out + (b * ss[0] + h * ss[1] + (at + i) * ss[2]) * size,
                    in + (b * xs[0] + h * xs[1] + i * xs[2]) * size, bytes);
      }
    }
  }
}

}  // namespace

namespace spec_batch_kernels {

// A decode step's cache write and attention in one call: key, value [B, Hkv, n, D] written into the cache's
// slabs [B, Hkv, capacity, D] at columns [length, length + n), then `attend` over the first length + n columns
// (the same bits as a cache update followed by `attend`; from Python those were four indexing calls a layer).
at::Tensor attend_appended(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const at::Tensor& key_slab, const at::Tensor& value_slab, int64_t length,
                           const at::Tensor& visible, const at::Tensor& bias, double scale) {
  const int64_t n = key.size(2);
  TORCH_CHECK(key_slab.dim() == 4 && value_slab.dim() == 4 && key_slab.size(2) >= length + n &&
                  value_slab.size(2) >= length + n, "attend_appended: the slabs hold no room for ", n, " columns");
  write_columns(key_slab, key, length);
  write_columns(value_slab, value, length);
  return attend(query, key_slab.narrow(2, 0, length + n), value_slab.narrow(2, 0, length + n), visible, bias, scale,
                false);
}

}  // namespace spec_batch_kernels

TORCH_LIBRARY_FRAGMENT(spec_batch, m) {
  m.def("attend(Tensor query, Tensor key, Tensor value, Tensor visible, Tensor bias, float scale, bool portable=False) -> Tensor");
  m.def(
      "attend_appended(Tensor query, Tensor key, Tensor value, Tensor(a!) key_slab, Tensor(b!) value_slab, "
      "int length, Tensor visible, Tensor bias, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(spec_batch, CPU, m) {
  m.impl("attend", attend);
  m.impl("attend_appended", spec_batch_kernels::attend_appended);
}
