// Attention on the CPU whose result for a query does not depend on the step that computes it.
//
// For each (row, head, query) the kernel reads the visible key columns in column order and nothing else: the
// score of a column is a dot product summed in 16 fixed lanes, the softmax's maximum is exact, and the weighted
// sum of values and the normalizer are accumulated column by column. Masked columns are skipped, not added as
// zeros, so a query's numbers are the same bits whatever the step's width (other queries), its key length
// (masked columns after a rollback or beside longer rows) or its batch. That is the guarantee speculative
// decoding needs for greedy output to equal plain decoding; it holds in the compute dtype (fp32 or bf16 inputs,
// fp32 accumulation), so the KV cache stays in the model's dtype.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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

template <typename T>
void attend_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const at::Tensor& visible, const at::Tensor& bias, bool has_bias, double scale,
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
  // a small step (one row of one token) runs on the calling thread: a parallel region costs more than its work,
  // and far more on a busy machine, where it waits for a descheduled thread
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, length * dim));
  at::parallel_for(0, rows * heads * n, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> q(dim), acc(dim), scores(length);
    std::vector<int64_t> cols(length);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (heads * n), h = (task / n) % heads, i = task % n, kvh = h / group;
      const T* qrow = q_ptr + b * qs[0] + h * qs[1] + i * qs[2];
      for (int64_t d = 0; d < dim; ++d) q[d] = static_cast<float>(qrow[d]);
      const bool* vis = vis_ptr + (visible.size(0) == 1 ? 0 : b * ms[0]) + (visible.size(1) == 1 ? 0 : h * ms[1]) +
                        i * ms[2];
      const float* brow = has_bias ? bias_ptr + (vis - vis_ptr) : nullptr;  // same layout as visible
      int64_t count = 0;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < length; ++j) {
        if (!vis[j * ms[3]]) continue;
        const T* krow = k_ptr + b * ks[0] + kvh * ks[1] + j * ks[2];
        float s = dot(q.data(), krow, dim) * fscale;
        if (brow) s += brow[j * ms[3]];
        scores[count] = s;
        cols[count++] = j;
        top = s > top ? s : top;
      }
      for (int64_t d = 0; d < dim; ++d) acc[d] = 0.f;
      float total = 0.f;
      for (int64_t c = 0; c < count; ++c) {
        const float p = std::exp(scores[c] - top);
        total += p;
        const T* vrow = v_ptr + b * vs[0] + kvh * vs[1] + cols[c] * vs[2];
        for (int64_t d = 0; d < dim; ++d) acc[d] += p * static_cast<float>(vrow[d]);
      }
      T* orow = o_ptr + b * os[0] + i * os[1] + h * os[2];
      const float inv = count > 0 ? 1.f / total : 0.f;
      for (int64_t d = 0; d < dim; ++d) orow[d] = static_cast<T>(acc[d] * inv);
    }
  });
}

// query [B, H, n, D]; key, value [B, Hkv, L, D] (last dim contiguous); visible: bool, broadcastable to
// [B, H, n, L]; bias: float32 of visible's shape added to visible scores, or empty. Returns [B, n, H, D].
at::Tensor attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& visible,
                  const at::Tensor& bias, double scale) {
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
    attend_kernel<float>(q, k, v, vis, b, has_bias, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    attend_kernel<c10::BFloat16>(q, k, v, vis, b, has_bias, scale, out);
  } else {
    TORCH_CHECK(false, "attend: float32 or bfloat16 expected, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spec_batch, m) {
  m.def("attend(Tensor query, Tensor key, Tensor value, Tensor visible, Tensor bias, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(spec_batch, CPU, m) { m.impl("attend", attend); }
