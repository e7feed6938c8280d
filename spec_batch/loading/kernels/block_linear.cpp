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
// Layout: outputs in tiles of 8; per (tile, block) 128 bytes [4][8 outputs][4 inputs], the low nibble holding
// input group p (inputs 4p..4p+3 of the block) and the high nibble group p + 4; d and m as [tiles, blocks, 8].
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
};

template <typename T>
QuantRows quantize_rows(const T* x, int64_t rows, int64_t k) {
  const int64_t blocks = k / kBlock;
  QuantRows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * blocks), std::vector<float>(rows * blocks)};
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
      }
    }
  });
  return out;
}

// the 8 block sums of one (tile, block) against one row's block, portable
inline void block_sums(const uint8_t* w, const int8_t* xq, int32_t* sums) {
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

void tile_portable(const uint8_t* w, const float* d, const float* m, const QuantRows& xr, int64_t rows, int64_t k,
                   float* out, int64_t out_stride) {
  const int64_t blocks = k / kBlock;
  int32_t sums[kTile];
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kTile] = {0};
    for (int64_t b = 0; b < blocks; ++b) {
      block_sums(w + b * 128, xr.q.data() + r * k + b * kBlock, sums);
      const float dx = xr.scale[r * blocks + b], shift = xr.shift[r * blocks + b];
      for (int64_t o = 0; o < kTile; ++o) {
        acc[o] = std::fma(static_cast<float>(sums[o]), d[b * kTile + o] * dx, acc[o]);
        acc[o] = std::fma(m[b * kTile + o], shift, acc[o]);
      }
    }
    for (int64_t o = 0; o < kTile; ++o) out[r * out_stride + o] = acc[o];
  }
}

#ifdef __AVX2__
// One row's 8 integer block sums (one per output of the tile) from the block's unpacked weights wq[p] (input group
// p of the 8 outputs) and the row's 8 groups of 4 int8 activations: AVX2 pairs u8 x s8 products into int16
// (no overflow: 8 * 2 * 15 * 127 < 2^15), then widens them.
struct SumsAvx2 {
  static constexpr int64_t kRows = 4;  // rows a chunk: a block's unpacked weights serve them all
  static __m256i of(const __m256i* wq, const int32_t* groups) {
    __m256i s16 = _mm256_maddubs_epi16(wq[0], _mm256_set1_epi32(groups[0]));
    for (int64_t p = 1; p < 8; ++p) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wq[p], _mm256_set1_epi32(groups[p])));
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
  }
};

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// The same integers (exact in any order) from VNNI's dot products of 4 bytes (u8 x s8 into int32), in two chains;
// with 32 vector registers a chunk takes 8 rows.
struct SumsVnni {
  static constexpr int64_t kRows = 8;
  static __m256i of(const __m256i* wq, const int32_t* groups) {
    __m256i part[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int64_t p = 0; p < 8; ++p) part[p & 1] = _mm256_dpbusd_epi32(part[p & 1], wq[p], _mm256_set1_epi32(groups[p]));
    return _mm256_add_epi32(part[0], part[1]);
  }
};
#endif

// One tile of 8 outputs for every row, `Sums` giving each block's integer sums; the float steps are the portable
// path's, so every Sums gives the same bits.
template <typename Sums>
void tile_simd(const uint8_t* w, const float* d, const float* m, const QuantRows& xr, int64_t rows, int64_t k,
               float* out, int64_t out_stride) {
  const int64_t blocks = k / kBlock;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t r0 = 0; r0 < rows; r0 += Sums::kRows) {
    const int64_t n = std::min(Sums::kRows, rows - r0);
    __m256 acc[Sums::kRows];
    for (int64_t i = 0; i < Sums::kRows; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m256i wq[8];
      for (int64_t p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 128 + p * 32));
        wq[p] = _mm256_and_si256(v, low);
        wq[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      const __m256 dv = _mm256_loadu_ps(d + b * kTile), mv = _mm256_loadu_ps(m + b * kTile);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = r0 + i;
        int32_t groups[8];
        std::memcpy(groups, xr.q.data() + r * k + b * kBlock, sizeof(groups));
        const __m256 sums = _mm256_cvtepi32_ps(Sums::of(wq, groups));
        const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(xr.scale[r * blocks + b]));
        acc[i] = _mm256_fmadd_ps(sums, scale, acc[i]);
        acc[i] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xr.shift[r * blocks + b]), acc[i]);
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

// x [rows, K] float32 or bfloat16; weight uint8 [tiles, blocks, 4, 8, 4]; d, m float32 [tiles, blocks, 8].
// portable: use the portable path (tests compare the two). Returns float32 [rows, tiles * 8].
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& d, const at::Tensor& m,
                       bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, "w4a8_linear: x must be [rows, K] with K a multiple of 32");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.dim() == 5, "bad weight");
  TORCH_CHECK(weight.size(1) * kBlock == x.size(1), "w4a8_linear: weight blocks do not match x's K");
  TORCH_CHECK(d.scalar_type() == at::kFloat && m.scalar_type() == at::kFloat && d.is_contiguous() &&
                  m.is_contiguous(), "d and m must be contiguous float32");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), k = xc.size(1), tiles = weight.size(0), blocks = weight.size(1);
  QuantRows xr = xc.scalar_type() == at::kBFloat16
                     ? quantize_rows(xc.data_ptr<c10::BFloat16>(), rows, k)
                     : quantize_rows(xc.to(at::kFloat).data_ptr<float>(), rows, k);
  auto out = at::empty({rows, tiles * kTile}, xc.options().dtype(at::kFloat));
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* wt = w + t * blocks * 128;
      const float *dt = dp + t * blocks * kTile, *mt = mp + t * blocks * kTile;
#ifdef __AVX2__
      if (!portable) {
        tile_simd<FastSums>(wt, dt, mt, xr, rows, k, op + t * kTile, tiles * kTile);
        continue;
      }
#endif
      tile_portable(wt, dt, mt, xr, rows, k, op + t * kTile, tiles * kTile);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spec_batch, m) {
  m.def("w4a8_linear(Tensor x, Tensor weight, Tensor d, Tensor m, bool portable=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(spec_batch, CPU, m) { m.impl("w4a8_linear", w4a8_linear); }
