// Every op the library registers (torch_bindings.cpp, the one place they are declared to torch), by kernel family:
// one source each. The fused decoder stack (llama_forward.cpp) calls the others through these declarations.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

#include "kv_quant.h"

namespace TM_NAMESPACE {

// attention.cpp: paged attention over decode rows and prefill chunks in one call.
void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, int64_t window = 0,
                     const std::optional<at::Tensor>& kv_scales = std::nullopt,
                     const std::optional<at::Tensor>& key = std::nullopt,
                     const std::optional<at::Tensor>& value = std::nullopt);
// The caches' element format and its scales (attention.cpp), shared by the kernels that read or write the cache.
tm_kv::KVFormat kv_format(const at::Tensor& cache, at::ScalarType model_dtype);
const float* kv_scales_ptr(const std::optional<at::Tensor>& kv_scales, tm_kv::KVFormat fmt, int64_t kv_heads,
                           int64_t head_dim);

// rope_cache.cpp: RoPE fused with the KV-cache write.
void rope_and_cache(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping, at::Tensor q_out,
                    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double eps,
                    const std::optional<at::Tensor>& kv_scales = std::nullopt,
                    const std::optional<at::Tensor>& k_out = std::nullopt);

// rowwise.cpp: RMSNorm, SiLU-and-mul, greedy argmax.
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
void silu_and_mul(at::Tensor out, const at::Tensor& x);
at::Tensor argmax(const at::Tensor& logits);

// gemm_small_m.cpp: linear layers for a few rows, on weights packed for it (and for prefill chunks from the same
// packed weight where the CPU has AMX-BF16); which path serves more rows than a decode batch, and its override.
bool small_m_supported(at::ScalarType dtype);
at::Tensor pack_small_m(const at::Tensor& weight);
std::string small_m_large_path(at::ScalarType dtype);
std::string small_m_select_path(const std::string& path);
// paged_attention's path for prefill tiles of a bf16 model: amx_bf16 where the CPU runs it, else vector
std::string attention_prefill_path();
std::string attention_select_path(const std::string& path);
at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                          int64_t out_features);

// quant_linear.cpp: y = x W^T (+ bias) with W in the packed 4-bit or 8-bit layout of
// tokenmill/models/quantization.py; the dense weight it stands for; which instructions serve it.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& meta,
                        const std::optional<at::Tensor>& bias, int64_t out_features);
at::Tensor quant_dequantize(const at::Tensor& qweight, const at::Tensor& meta, int64_t out_features,
                            at::ScalarType dtype);
std::string quant_linear_path();
std::string quant_linear_select_path(const std::string& path);

// w8a8.cpp: y = x W^T (+ bias) with int8 weights per output channel and int8 activations per row and 64 K
// quantized here (tokenmill/models/quantization.py's W8A8Weight packs qweight and meta); the activations'
// quantization and the exact int32 sums per 64-K block, for the tests; which instructions serve it.
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& meta,
                       const std::optional<at::Tensor>& bias, int64_t out_features);
std::tuple<at::Tensor, at::Tensor> w8a8_quantize(const at::Tensor& x);
at::Tensor w8a8_int_gemm(const at::Tensor& xq, const at::Tensor& qweight, const at::Tensor& meta);
std::string w8a8_linear_path();
std::string w8a8_select_path(const std::string& path);  // a path this CPU runs, or auto; returns the previous

// lora.cpp: out[t, shard j] += (x[t] @ A[j, slot]^T) @ B^T[slot, :, shard j] for every token t of every segment
// with a slot; see lora.cpp and tokenmill/lora/layers.py for the layouts.
void lora_delta(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
                const at::Tensor& segments, const at::Tensor& ranks, at::IntArrayRef shard_out);

// llama_forward.cpp: the Llama-family decoder stack in one call.
at::Tensor llama_forward(const at::Tensor& embeddings, at::TensorList layer_weights, const at::Tensor& final_norm,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& positions,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, int64_t num_heads, int64_t head_dim,
                         int64_t intermediate, double eps, double scale, int64_t small_m_max_rows,
                         at::TensorList kv_scales, at::TensorList lora_weights, at::TensorList lora_ranks,
                         const std::optional<at::Tensor>& lora_segments);

}  // namespace TM_NAMESPACE
