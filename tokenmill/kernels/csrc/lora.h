// The batched LoRA delta (lora.cpp), declared for the fused decoder stack in cpu_ops.cpp.
#pragma once
#include <ATen/ATen.h>

namespace TM_NAMESPACE {
// out[t, shard j] += (x[t] @ A[j, slot]^T) @ B^T[slot, :, shard j] for every token t of every segment with a
// slot; see lora.cpp and tokenmill/lora/layers.py for the layouts.
void lora_delta(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
                const at::Tensor& segments, const at::Tensor& ranks, at::IntArrayRef shard_out);
}  // namespace TM_NAMESPACE
