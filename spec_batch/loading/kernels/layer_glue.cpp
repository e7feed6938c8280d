// The small operators between a Llama layer's matmuls, one call each instead of a Python sequence of 5-8 operators.
//
// Each computes the same bits as the Hugging Face code it replaces (loading/llama_forward.py names it):
// - reductions stay torch's own kernels (the mean of squares in RMSNorm): a hand-written sum would change them;
// - elementwise steps are a single IEEE operation each (add, multiply, 1/sqrt), rounded to the tensor's dtype
//   where torch rounds (bf16 after every operator, fp32 opmath), with contraction into fused multiply-adds off
//   (build.py's -ffp-contract=off). Such steps give the same bits in any order of elements and any vector width.
// Anything else (other dtypes, a weight of another dtype) runs the same sequence through ATen from here.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "block_linear.h"
#include "cpu_attention.h"

namespace {

using at::Tensor;
using c10::BFloat16;

constexpr int64_t kGrainElements = 1 << 15;  // below this a parallel region costs more than its work

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, width)); }

// Hugging Face's LlamaRMSNorm: weight * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(x.dtype), rows along the last dim.
// torch's mean on the CPU is its sum kernel followed by a division by the count; the sum stays torch's (`sums`).
template <typename T, typename W, typename O>
void scale_rows(const Tensor& x, const Tensor& sums, const Tensor& weight, double eps, Tensor& out) {
  const int64_t width = x.size(-1), rows = x.numel() / width;
  const T* xp = x.data_ptr<T>();
  const float* sp = sums.data_ptr<float>();
  const W* wp = weight.data_ptr<W>();
  O* op = out.data_ptr<O>();
  const float count = static_cast<float>(width), feps = static_cast<float>(eps);  // both as torch casts them
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float variance = sp[r] / count;
      const float inv = 1.0f / std::sqrt(variance + feps);  // torch.rsqrt on the CPU: 1 / sqrt, both correctly rounded
      const T* xr = xp + r * width;
      O* orow = op + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const T normed = static_cast<T>(static_cast<float>(xr[i]) * inv);  // .to(input_dtype)
        orow[i] = static_cast<O>(static_cast<float>(wp[i]) * static_cast<float>(normed));
      }
    }
  });
}

// The row sums of x_f32^2 [..., 1]: the squares by hand (pow(2) is one correctly rounded product), the sum torch's.
template <typename T>
Tensor sums_of_squares(const Tensor& x) {
  Tensor squares = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const T* xp = x.data_ptr<T>();
  float* sq = squares.data_ptr<float>();
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(xp[i]);
    sq[i] = v * v;
  }
  return at::sum(squares, {-1}, /*keepdim=*/true);
}

Tensor rms_norm_composite(const Tensor& x, const Tensor& weight, double eps) {
  const Tensor xf = x.to(at::kFloat);
  const Tensor normed = xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps);
  return weight * normed.to(x.scalar_type());
}

Tensor rms_norm(const Tensor& x_in, const Tensor& weight, double eps) {
  const Tensor x = x_in.contiguous();
  const auto xt = x.scalar_type(), wt = weight.scalar_type();
  const bool handled = weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1) &&
                       ((xt == at::kFloat && wt == at::kFloat) || (xt == at::kBFloat16 && wt == at::kBFloat16) ||
                        (xt == at::kBFloat16 && wt == at::kFloat));
  if (!handled) return rms_norm_composite(x, weight, eps);
  Tensor out = at::empty(x.sizes(), x.options().dtype(at::promote_types(xt, wt)));
  if (xt == at::kFloat) {
    scale_rows<float, float, float>(x, sums_of_squares<float>(x).contiguous(), weight, eps, out);
  } else {
    const Tensor sums = sums_of_squares<BFloat16>(x).contiguous();
    if (wt == at::kBFloat16) {
      scale_rows<BFloat16, BFloat16, BFloat16>(x, sums, weight, eps, out);
    } else {
      scale_rows<BFloat16, float, float>(x, sums, weight, eps, out);
    }
  }
  return out;
}

template <typename T>
Tensor add_same(const Tensor& x, const Tensor& delta) {
  const Tensor a = x.contiguous(), b = delta.contiguous();
  Tensor sum = at::empty(a.sizes(), a.options());
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  T* sp = sum.data_ptr<T>();
  const int64_t n = a.numel();
  for (int64_t i = 0; i < n; ++i) sp[i] = static_cast<T>(static_cast<float>(ap[i]) + static_cast<float>(bp[i]));
  return sum;
}

// x + delta (the residual), then RMSNorm of the sum: (sum, normed). The sum rounds once per element, as torch's.
std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps) {
  const bool same = x.sizes() == delta.sizes() && x.scalar_type() == delta.scalar_type();
  const Tensor sum = !same                            ? x + delta
                     : x.scalar_type() == at::kFloat    ? add_same<float>(x, delta)
                     : x.scalar_type() == at::kBFloat16 ? add_same<BFloat16>(x, delta)
                                                        : x + delta;
  return {sum, rms_norm(sum, weight, eps)};
}

// Hugging Face's apply_rotary_pos_emb on the query and key heads of a fused q/k/v output: out = h * cos +
// rotate_half(h) * sin, with rotate_half(h) = cat(-h[D/2:], h[:D/2]); each product and the sum rounded to T.
template <typename T>
void rotate(const Tensor& heads, const Tensor& cos, const Tensor& sin, int64_t rotated, Tensor& out) {
  const int64_t positions = heads.size(0) * heads.size(1), dim = heads.size(3), half = dim / 2;
  const int64_t group = heads.size(2);
  const T* hp = heads.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, positions, grain_rows(rotated * dim), [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const T* c = cp + p * dim;
      const T* s = sp + p * dim;
      for (int64_t h = 0; h < rotated; ++h) {
        const T* x = hp + (p * group + h) * dim;
        T* o = op + (p * rotated + h) * dim;
        for (int64_t d = 0; d < dim; ++d) {
          const float turned = d < half ? -static_cast<float>(x[d + half]) : static_cast<float>(x[d - half]);
          const T a = static_cast<T>(static_cast<float>(x[d]) * static_cast<float>(c[d]));
          const T b = static_cast<T>(turned * static_cast<float>(s[d]));
          o[d] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
        }
      }
    }
  });
}

// heads [B, n, Hq + 2 Hkv, D] (the fused q/k/v output), cos and sin [B, n, D]: q [B, Hq, n, D] and k [B, Hkv, n, D]
// rotated, v [B, Hkv, n, D] as given (views with the layout Hugging Face's transposes give).
std::tuple<Tensor, Tensor, Tensor> rotary_heads(const Tensor& heads_in, const Tensor& cos_in, const Tensor& sin_in,
                                                int64_t query_heads, int64_t key_heads) {
  const Tensor heads = heads_in.contiguous();
  const int64_t rotated = query_heads + key_heads, dim = heads.size(3);
  const auto dtype = heads.scalar_type();
  Tensor qk;
  if ((dtype == at::kFloat || dtype == at::kBFloat16) && cos_in.scalar_type() == dtype &&
      sin_in.scalar_type() == dtype && dim % 2 == 0) {
    const Tensor cos = cos_in.expand({heads.size(0), heads.size(1), dim}).contiguous();
    const Tensor sin = sin_in.expand({heads.size(0), heads.size(1), dim}).contiguous();
    qk = at::empty({heads.size(0), heads.size(1), rotated, dim}, heads.options());
    if (dtype == at::kFloat) {
      rotate<float>(heads, cos, sin, rotated, qk);
    } else {
      rotate<BFloat16>(heads, cos, sin, rotated, qk);
    }
  } else {
    const Tensor x = heads.narrow(2, 0, rotated);
    const Tensor turned = at::cat({-x.narrow(-1, dim / 2, dim - dim / 2), x.narrow(-1, 0, dim / 2)}, -1);
    qk = x * cos_in.unsqueeze(2) + turned * sin_in.unsqueeze(2);
  }
  return {qk.narrow(2, 0, query_heads).transpose(1, 2), qk.narrow(2, query_heads, key_heads).transpose(1, 2),
          heads.narrow(2, rotated, key_heads).transpose(1, 2)};
}

// out [rows, size] *= the up half of gate_up [rows, 2 size], each product rounded once to T (torch's mul), the rows
// split over the threads as torch's mul splits a prefill's
template <typename T>
void multiply_rows(Tensor& out, const Tensor& gate_up, int64_t size) {
  const int64_t rows = out.numel() / size, stride = gate_up.size(-1);
  T* op = out.data_ptr<T>();
  const T* up = gate_up.const_data_ptr<T>() + size;
  at::parallel_for(0, rows, grain_rows(size), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* o = op + r * size;
      const T* u = up + r * stride;
      for (int64_t i = 0; i < size; ++i) o[i] = static_cast<T>(static_cast<float>(o[i]) * static_cast<float>(u[i]));
    }
  });
}

// Hugging Face's LlamaMLP between its projections, on a fused gate/up output [..., 2 I]: silu(gate) * up. silu is
// torch's kernel (its exp is torch's vectorized one); the product one IEEE multiply an element, by hand for float32
// and bfloat16 (ATen's set-up costs more than the product at a decode step's few rows), else torch's.
Tensor silu_mul(const Tensor& gate_up_in, int64_t size) {
  const Tensor gate_up = gate_up_in.contiguous();
  Tensor out = at::silu(gate_up.narrow(-1, 0, size));
  const auto dtype = gate_up.scalar_type();
  const bool by_hand = out.is_contiguous() && out.scalar_type() == dtype;
  if (by_hand && dtype == at::kFloat) {
    multiply_rows<float>(out, gate_up, size);
  } else if (by_hand && dtype == at::kBFloat16) {
    multiply_rows<BFloat16>(out, gate_up, size);
  } else {
    out.mul_(gate_up.narrow(-1, size, size));
  }
  return out;
}

// A layer's steps around its attention, for the common case (float32 activations, fused q/k/v and gate/up groups,
// every projection a whole-tile W4A8 layer): the same calls, in the same order, as llama_forward.py's Python path
// makes one by one, so the same bits, without a Python round trip between them (a decode step's largest fixed
// cost on a small model). A projection is (packed, scales, minimums). The per-call inputs come first, the layer's
// own after them (llama_forward.py binds those once).
using spec_batch_kernels::w4a8_linear;

Tensor project(const Tensor& x, const Tensor& packed, const Tensor& scales, const Tensor& minimums) {
  const Tensor flat = w4a8_linear(x.reshape({-1, x.size(-1)}), packed, scales, minimums, false);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(flat.size(1));
  return flat.view(shape);
}

// (x + delta, or x where there is no delta yet; q, k, v) of the layer's input norm, q/k/v projection and rotary
// embedding. x [B, n, H]; cos, sin [B, n, D]. real: a padded step's real positions (flat indices into [B, n], as
// core/kv/padding.py's RealPositions holds them): x holds only those, packed as [1, N, H], and q, k and v come back
// in the step's [B, n] layout with zeros at the padded positions (RealPositions.scatter).
std::tuple<Tensor, Tensor, Tensor, Tensor> layer_before_attention(
    const Tensor& x, const c10::optional<Tensor>& delta, const Tensor& cos, const Tensor& sin,
    const c10::optional<Tensor>& real, const Tensor& norm_weight, double eps, const Tensor& packed,
    const Tensor& scales, const Tensor& minimums, int64_t query_heads, int64_t key_heads, int64_t head_dim) {
  Tensor sum = x, normed;
  if (delta) {
    std::tie(sum, normed) = add_rms_norm(x, *delta, norm_weight, eps);
  } else {
    normed = rms_norm(x, norm_weight, eps);
  }
  Tensor projected = project(normed, packed, scales, minimums);
  if (real) {
    const Tensor flat = projected.reshape({-1, projected.size(-1)});
    projected = at::zeros({cos.size(0) * cos.size(1), flat.size(1)}, flat.options()).index_copy_(0, *real, flat);
  }
  const Tensor heads = projected.view({cos.size(0), cos.size(1), -1, head_dim});
  auto [q, k, v] = rotary_heads(heads, cos, sin, query_heads, key_heads);
  return {sum, q, k, v};
}

// (x + the attention's term, the MLP's term) of the output projection, the post-attention norm and the MLP.
// attended [B, n, heads, D], the attention's output; real: as above (x packed, attended's real positions taken).
std::tuple<Tensor, Tensor> layer_after_attention(
    const Tensor& x, const Tensor& attended, const c10::optional<Tensor>& real, const Tensor& norm_weight, double eps,
    const Tensor& o_packed, const Tensor& o_scales, const Tensor& o_minimums, const Tensor& gu_packed,
    const Tensor& gu_scales, const Tensor& gu_minimums, int64_t gate_size, const Tensor& down_packed,
    const Tensor& down_scales, const Tensor& down_minimums) {
  Tensor out = attended.reshape({attended.size(0), attended.size(1), -1});
  if (real) out = out.reshape({-1, out.size(-1)}).index_select(0, *real).unsqueeze(0);  // RealPositions.gather
  auto [sum, normed] = add_rms_norm(x, project(out, o_packed, o_scales, o_minimums), norm_weight, eps);
  const Tensor gated = silu_mul(project(normed, gu_packed, gu_scales, gu_minimums), gate_size);
  return {sum, project(gated, down_packed, down_scales, down_minimums)};
}

// The whole decoder stack of a decode step: per layer `layer_before_attention`, the cache write and attention
// (`attend_appended`) and `layer_after_attention`, the same calls in the same order as llama_forward.py makes them
// a layer at a time (so the same bits), without returning to Python between layers: a step of a 135M model makes
// ~90 such calls, and each call's fixed cost (argument parsing, dispatch, the Python around it) adds up to a tenth
// of the step. Per layer i: weights[kWeights * i + ...] are (input norm, q/k/v packed, scales, minimums, post norm,
// o's three, gate/up's three, down's three), eps[2 i], eps[2 i + 1] the two norms' epsilons; key_slabs[i],
// value_slabs[i] hold room for the step's columns after lengths[i] (SlabLayer.room). Returns (x, the last
// layer's MLP term), as the per-layer loop leaves them.
constexpr int64_t kWeights = 14;

std::tuple<Tensor, Tensor> decoder_layers(const Tensor& x, const Tensor& cos, const Tensor& sin,
                                          const c10::optional<Tensor>& real, const Tensor& visible, double scale,
                                          at::TensorList key_slabs, at::TensorList value_slabs,
                                          at::IntArrayRef lengths, at::TensorList weights, at::ArrayRef<double> eps,
                                          int64_t query_heads, int64_t key_heads, int64_t head_dim,
                                          int64_t gate_size) {
  const int64_t layers = static_cast<int64_t>(key_slabs.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(value_slabs.size()) == layers &&
                  static_cast<int64_t>(lengths.size()) == layers &&
                  static_cast<int64_t>(weights.size()) == kWeights * layers &&
                  static_cast<int64_t>(eps.size()) == 2 * layers,
              "decoder_layers: per layer one key slab, value slab and length, ", kWeights, " weights, 2 epsilons");
  const Tensor no_bias = at::empty({0}, x.options());
  Tensor sum = x;
  c10::optional<Tensor> delta;
  for (int64_t i = 0; i < layers; ++i) {
    const Tensor* w = weights.data() + kWeights * i;
    auto [residual, q, k, v] = layer_before_attention(sum, delta, cos, sin, real, w[0], eps[2 * i], w[1], w[2], w[3],
                                                      query_heads, key_heads, head_dim);
    const Tensor attended = spec_batch_kernels::attend_appended(q, k, v, key_slabs[i], value_slabs[i], lengths[i],
                                                                visible, no_bias, scale);
    auto [next, term] = layer_after_attention(residual, attended, real, w[4], eps[2 * i + 1], w[5], w[6], w[7], w[8],
                                              w[9], w[10], gate_size, w[11], w[12], w[13]);
    sum = next;
    delta = term;
  }
  return {sum, *delta};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spec_batch, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_heads(Tensor heads, Tensor cos, Tensor sin, int query_heads, int key_heads) -> (Tensor, Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up, int size) -> Tensor");
  m.def(
      "layer_before_attention(Tensor x, Tensor? delta, Tensor cos, Tensor sin, Tensor? real, Tensor norm_weight, "
      "float eps, Tensor packed, Tensor scales, Tensor minimums, int query_heads, int key_heads, int head_dim) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "layer_after_attention(Tensor x, Tensor attended, Tensor? real, Tensor norm_weight, float eps, "
      "Tensor o_packed, Tensor o_scales, Tensor o_minimums, Tensor gu_packed, Tensor gu_scales, Tensor gu_minimums, "
      "int gate_size, Tensor down_packed, Tensor down_scales, Tensor down_minimums) -> (Tensor, Tensor)");
  m.def(
      "decoder_layers(Tensor x, Tensor cos, Tensor sin, Tensor? real, Tensor visible, float scale, "
      "Tensor(a!)[] key_slabs, Tensor(b!)[] value_slabs, int[] lengths, Tensor[] weights, float[] eps, "
      "int query_heads, int key_heads, int head_dim, int gate_size) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(spec_batch, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rotary_heads", rotary_heads);
  m.impl("silu_mul", silu_mul);
  m.impl("layer_before_attention", layer_before_attention);
  m.impl("layer_after_attention", layer_after_attention);
  m.impl("decoder_layers", decoder_layers);
}
