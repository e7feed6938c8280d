// W4A8 linear layers on the CPU: GGUF-style 4-bit weight blocks times activations quantized to int8 per block of
// 32, with integer dot products.
//
// Weights: per output o and block b of 32 inputs, w = d[o,b] * q + m[o,b] with q in 0..15 (Q4_1 as it ships;
// Q4_0 is m = -8 d). Activations: per row r and block b, dx = max|x| / 127 and qx = round-to-even(x / dx).
// Then  y[r,o] = sum_b ( float(sum_j q qx) * (d * dx) + m * (dx * sum_j qx) ),  the blocks added in order with
// one fused multiply-add each. The block sums are integers (exact in any order), and the float steps are the
// same for a row whatever else the call holds, so a row's outputs are the same bits at every row count: the
// exactness speculation needs. The AVX-512 VNNI, AVX2 and portable paths compute the same bits.
//
// W8A8 (w8a8_linear): GGUF Q8_0 blocks, w = d[o,b] * q with q in -127..127, against the same int8 activations:
// y[r,o] = sum_b float(sum_j q qx) * (d * dx), one fused multiply-add a block, in order (llama.cpp's q8_0 x q8_0).
//
// Layout: outputs in tiles of 8; per (tile, block) of Q4 128 bytes [4][8 outputs][4 inputs], the low nibble holding
// input group p (inputs 4p..4p+3 of the block) and the high nibble group p + 4; of Q8 256 bytes [8][8 outputs][4
// inputs] holding q + 128 (unsigned, as VNNI multiplies); d and m as [tiles, blocks, 8].
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32, kTile = 8;

struct QuantRows {
  std::vector<int8_t> q;     // [rows, K]
  std::vector<float> scale;  // [rows, blocks]: dx
  std::vector<float> shift;  // [rows, blocks]: dx * sum(qx)
  std::vector<int32_t> total;  // [rows, blocks]: sum(qx)
};

template <typename T>
QuantRows quantize_rows(const T* x, int64_t rows, int64_t k) {
  const int64_t blocks = k / kBlock;
  QuantRows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * blocks), std::vector<float>(rows * blocks),
                std::vector<int32_t>(rows * blocks)};
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const T* src = x + r * k + b * kBlock;
        float amax = 0.f;
        for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(static_cast<float>(src[j])));
        const float dx = amax / 127.f;
        int32_t total = 0;
        int8_t* dst = out.q.data() + r * k + b * kBlock;
        for (int64_t j = 0; j < kBlock; ++j) {
          const float v = dx > 0.f ? std::nearbyint(static_cast<float>(src[j]) / dx) : 0.f;
          dst[j] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, v)));
          total += dst[j];
        }
        out.scale[r * blocks + b] = dx;
        out.shift[r * blocks + b] = dx * static_cast<float>(total);
        out.total[r * blocks + b] = total;
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
void tile_portable(const uint8_t* w, const float* d, const float* m, const QuantRows& xr, int64_t rows, int64_t k,
                   float* out, int64_t out_stride) {
  const int64_t blocks = k / kBlock;
  int32_t sums[kTile];
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kTile] = {0};
    for (int64_t b = 0; b < blocks; ++b) {
      Format::block_sums(w + b * Format::kBytes, xr.q.data() + r * k + b * kBlock, sums);
      const float dx = xr.scale[r * blocks + b], shift = xr.shift[r * blocks + b];
      for (int64_t o = 0; o < kTile; ++o) {
        const float mo = m == nullptr ? 0.f : m[b * kTile + o];
        acc[o] = Format::add(acc[o], static_cast<float>(sums[o]), d[b * kTile + o], mo, dx, shift);
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

// One row's 8 integer block sums (one per output of the tile) from the unpacked weights and the row's 8 groups of 4
// int8 activations. Q4: AVX2 pairs u8 x s8 products into int16 (no overflow: 8 * 2 * 15 * 127 < 2^15), then widens
// them. Q8: q + 128 would overflow those pairs, so the signs move onto the weights (|x| * sign(x) q, as llama.cpp
// does: 2 * 127 * 127 < 2^15) and each group widens at once.
struct SumsAvx2 {
  static constexpr int64_t kRows = 4;  // rows a chunk: a block's unpacked weights serve them all
  static __m256i of(Q4Blocks, const __m256i* wq, const int32_t* groups, int32_t) {
    __m256i s16 = _mm256_maddubs_epi16(wq[0], _mm256_set1_epi32(groups[0]));
    for (int64_t p = 1; p < 8; ++p) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wq[p], _mm256_set1_epi32(groups[p])));
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
  }
  static __m256i of(Q8Blocks, const __m256i* wq, const int32_t* groups, int32_t) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
    __m256i s32 = _mm256_setzero_si256();
    for (int64_t p = 0; p < 8; ++p) {
      const __m256i x = _mm256_set1_epi32(groups[p]), q = _mm256_xor_si256(wq[p], flip);
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(q, x));
      s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(pairs, ones));
    }
    return s32;
  }
};

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// The same integers (exact in any order) from VNNI's dot products of 4 bytes (u8 x s8 into int32), in two chains;
// Q8 takes off the 128 * sum(x) its stored offset adds. With 32 vector registers a chunk takes 8 rows.
struct SumsVnni {
  static constexpr int64_t kRows = 8;
  static __m256i dots(const __m256i* wq, const int32_t* groups) {
    __m256i part[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int64_t p = 0; p < 8; ++p) part[p & 1] = _mm256_dpbusd_epi32(part[p & 1], wq[p], _mm256_set1_epi32(groups[p]));
    return _mm256_add_epi32(part[0], part[1]);
  }
  static __m256i of(Q4Blocks, const __m256i* wq, const int32_t* groups, int32_t) { return dots(wq, groups); }
  static __m256i of(Q8Blocks, const __m256i* wq, const int32_t* groups, int32_t total) {
    return _mm256_sub_epi32(dots(wq, groups), _mm256_set1_epi32(128 * total));
  }
};
#endif

inline __m256 add(Q4Blocks, __m256 acc, __m256 sums, __m256 dv, __m256 mv, float dx, float shift) {
  acc = _mm256_fmadd_ps(sums, _mm256_mul_ps(dv, _mm256_set1_ps(dx)), acc);
  return _mm256_fmadd_ps(mv, _mm256_set1_ps(shift), acc);
}
inline __m256 add(Q8Blocks, __m256 acc, __m256 sums, __m256 dv, __m256, float dx, float) {
  return _mm256_fmadd_ps(sums, _mm256_mul_ps(dv, _mm256_set1_ps(dx)), acc);
}

// One tile of 8 outputs for every row, `Sums` giving each block's integer sums; the float steps are the portable
// path's, so every Sums gives the same bits.
template <typename Format, typename Sums>
void tile_simd(const uint8_t* w, const float* d, const float* m, const QuantRows& xr, int64_t rows, int64_t k,
               float* out, int64_t out_stride) {
  const int64_t blocks = k / kBlock;
  for (int64_t r0 = 0; r0 < rows; r0 += Sums::kRows) {
    const int64_t n = std::min(Sums::kRows, rows - r0);
    __m256 acc[Sums::kRows];
    for (int64_t i = 0; i < Sums::kRows; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m256i wq[8];
      unpack(Format{}, w + b * Format::kBytes, wq);
      const __m256 dv = _mm256_loadu_ps(d + b * kTile);
      const __m256 mv = m == nullptr ? _mm256_setzero_ps() : _mm256_loadu_ps(m + b * kTile);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t at = (r0 + i) * blocks + b;
        int32_t groups[8];
        std::memcpy(groups, xr.q.data() + (r0 + i) * k + b * kBlock, sizeof(groups));
        const __m256 sums = _mm256_cvtepi32_ps(Sums::of(Format{}, wq, groups, xr.total[at]));
        acc[i] = add(Format{}, acc[i], sums, dv, mv, xr.scale[at], xr.shift[at]);
      }
    }
    for (int64_t i = 0; i < n; ++i) _mm256_storeu_ps(out + (r0 + i) * out_stride, acc[i]);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
using FastSums = SumsVnni;
#else
using FastSums = SumsAvx2;
#endif
#endif

// x [rows, K] float32 or bfloat16; weight uint8 [tiles, blocks, Format::kBytes]; d (and m for Q4) float32 [tiles,
// blocks, 8]. portable: use the portable path (tests compare the two). Returns float32 [rows, tiles * 8].
template <typename Format>
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& d,
                        const c10::optional<at::Tensor>& m, bool portable, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, name, ": x must be [rows, K] with K a multiple of 32");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.numel() == weight.size(0) * weight.size(1) * Format::kBytes, name, ": bad weight");
  TORCH_CHECK(weight.size(1) * kBlock == x.size(1), name, ": weight blocks do not match x's K");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous(), name, ": d must be contiguous float32");
  TORCH_CHECK(!m || (m->scalar_type() == at::kFloat && m->is_contiguous()), name, ": m must be contiguous float32");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), k = xc.size(1), tiles = weight.size(0), blocks = weight.size(1);
  QuantRows xr = xc.scalar_type() == at::kBFloat16
                     ? quantize_rows(xc.data_ptr<c10::BFloat16>(), rows, k)
                     : quantize_rows(xc.to(at::kFloat).data_ptr<float>(), rows, k);
  auto out = at::empty({rows, tiles * kTile}, xc.options().dtype(at::kFloat));
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m ? m->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* wt = w + t * blocks * Format::kBytes;
      const float *dt = dp + t * blocks * kTile, *mt = mp == nullptr ? nullptr : mp + t * blocks * kTile;
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

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& d, const at::Tensor& m,
                       bool portable) {
  TORCH_CHECK(weight.dim() == 5, "w4a8_linear: weight must be [tiles, blocks, 4, 8, 4]");
  return block_linear<Q4Blocks>(x, weight, d, m, portable, "w4a8_linear");
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& d, bool portable) {
  TORCH_CHECK(weight.dim() == 5, "w8a8_linear: weight must be [tiles, blocks, 8, 8, 4]");
  return block_linear<Q8Blocks>(x, weight, d, c10::nullopt, portable, "w8a8_linear");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spec_batch, m) {
  m.def("w4a8_linear(Tensor x, Tensor weight, Tensor d, Tensor m, bool portable=False) -> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor weight, Tensor d, bool portable=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(spec_batch, CPU, m) {
  m.impl("w4a8_linear", w4a8_linear);
  m.impl("w8a8_linear", w8a8_linear);
}
