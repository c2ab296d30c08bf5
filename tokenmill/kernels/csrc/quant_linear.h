// The quantized linear layer (quant_linear.cpp), declared for the fused decoder stack in cpu_ops.cpp.
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace TM_NAMESPACE {
// y = x W^T (+ bias) with W in the packed 4-bit or 8-bit layout of tokenmill/models/quantization.py.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& meta,
                        const std::optional<at::Tensor>& bias, int64_t out_features);
}  // namespace TM_NAMESPACE
