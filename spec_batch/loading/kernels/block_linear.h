// The W4A8 linear layer (block_linear.cpp), for the fused layer steps (layer_glue.cpp) to call without the
// dispatcher.
#pragma once
#include <ATen/ATen.h>

namespace spec_batch_kernels {
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& d, const at::Tensor& m,
                       bool portable);
}  // namespace spec_batch_kernels
