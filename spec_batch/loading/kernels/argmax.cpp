// The last dimension's argmax of a float32 tensor, as torch.argmax gives it: the index of the first maximum, where
// a NaN counts as larger than any number (the first NaN's index wins). Greedy decoding takes one a row a step over
// the whole vocabulary; torch's CPU argmax reads a row one element at a time (~27 us for the default model's 49,152
// logits, ~210 us for 16 rows at 2 threads). Here a row is one AVX-512 pass (core/argmax.py calls it), the rows
// split over the threads; without AVX-512 it is torch's own.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "spin_pool.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// torch's rule one element at a time: the first NaN, else the first index of the largest value
int64_t argmax_scalar(const float* x, int64_t n) {
  int64_t best = 0;
  float top = x[0];
  if (std::isnan(top)) return 0;
  for (int64_t i = 1; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > top) top = x[i], best = i;
  }
  return best;
}

#if defined(__AVX512F__)
// Each lane keeps the first index of its largest value (a strict comparison), so among the lanes that hold the
// row's maximum the smallest index is the row's first; a row holding a NaN is read again by the scalar rule.
int64_t argmax_avx512(const float* x, int64_t n) {
  if (n < 16) return argmax_scalar(x, n);
  __m512 top = _mm512_loadu_ps(x);
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
  __m512i index = at;
  const __m512i step = _mm512_set1_epi32(16);
  int64_t i = 16;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    index = _mm512_add_epi32(index, step);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 larger = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
    top = _mm512_mask_mov_ps(top, larger, v);
    at = _mm512_mask_mov_epi32(at, larger, index);
  }
  if (nan) return argmax_scalar(x, n);
  const float largest = _mm512_reduce_max_ps(top);
  const __mmask16 holders = _mm512_cmp_ps_mask(top, _mm512_set1_ps(largest), _CMP_EQ_OQ);
  const int64_t first = _mm512_mask_reduce_min_epi32(holders, at);
  float best_value = largest;
  int64_t best = first;
  for (; i < n; ++i) {  // the tail: later indices win only when strictly larger
    if (std::isnan(x[i])) return i;
    if (x[i] > best_value) best_value = x[i], best = i;
  }
  return best;
}
#endif

at::Tensor argmax_last(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) > 0, "argmax_last: a tensor with a non-empty last dimension expected");
#if defined(__AVX512F__)
  if (x_in.scalar_type() != at::kFloat || x_in.size(-1) >= (int64_t{1} << 31)) return x_in.argmax(-1);
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  at::Tensor out = at::empty(shape, x.options().dtype(at::kLong));
  const float* xp = x.const_data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / n);  // rows a piece: below ~16K logits, one thread
  spec_batch_kernels::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_avx512(xp + r * n, n);
  });
  return out;
#else
  return x_in.argmax(-1);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spec_batch, m) { m.def("argmax_last(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(spec_batch, CPU, m) { m.impl("argmax_last", argmax_last); }
