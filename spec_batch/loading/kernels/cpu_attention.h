// The decode step's cache write and attention (cpu_attention.cpp), for the fused decoder stack (layer_glue.cpp) to
// call without the dispatcher.
#pragma once
#include <ATen/ATen.h>

namespace spec_batch_kernels {
at::Tensor attend_appended(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const at::Tensor& key_slab, const at::Tensor& value_slab, int64_t length,
                           const at::Tensor& visible, const at::Tensor& bias, double scale);
}  // namespace spec_batch_kernels
