// The Llama-family decoder stack in one call: on a 135M model a decode step is ~300 small ops, and calling
// them one by one from Python cost 15% of the step. Same kernels, same order as LlamaForCausalLM.forward (the
// Python loop stays the reference); the linear layers are oneDNN's, on the prepacked weights. Each kernel call
// is a profiler range under its op's name, so `tokenmill bench step` still sees where the time goes.
// layer_weights: per layer [input_norm, qkv_w, qkv_b, q_norm, k_norm, o_w, o_b, post_norm, gate_up_w, down_w,
// then the small-M layouts of qkv_w, o_w, gate_up_w, down_w]; an empty tensor stands for a bias or norm the
// model does not have, or a small-M layout this CPU has no kernel for. Batches of up to small_m_max_rows tokens
// use the small-M kernel. A linear kept quantized passes (qweight uint8, meta) in its two slots instead and
// always runs quant_linear (quant_linear.cpp); a W8A8 one (int8 qweight, float32 meta) runs w8a8_linear
// (w8a8.cpp). kv_scales: per layer, the KV cache's float32
// [2, kv_heads, head_dim] scales (read only when the cache is one-byte: --kv-cache-dtype; then the attention
// also reads this step's own K and V as computed).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/record_function.h>

#include <optional>
#include <string_view>
#include <vector>

#include "kv_quant.h"
#include "ops.h"

namespace TM_NAMESPACE {

namespace {

constexpr int kWeightsPerLayer = 14;

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         std::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<std::string_view>)>();
  std::optional<at::Tensor> b;
  if (bias.numel() > 0) b = bias;
  return op.call(x, packed, b, "none", c10::List<std::optional<at::Scalar>>(), std::string_view(""));
}

std::optional<at::Tensor> present(const at::Tensor& t) {
  return t.numel() > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
}

at::Tensor layer_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& small_m,
                        const at::Tensor& bias, int64_t out_features, int64_t small_m_max_rows) {
  if (packed.scalar_type() == at::kByte) {  // kept quantized: (qweight, meta) in place of the two layouts
    RECORD_FUNCTION("tokenmill::quant_linear", std::vector<c10::IValue>());
    return TM_NAMESPACE::quant_linear(x, packed, small_m, present(bias), out_features);
  }
  if (packed.scalar_type() == at::kChar) {  // W8A8: (qweight int8, meta) in place of the two layouts
    RECORD_FUNCTION("tokenmill::w8a8_linear", std::vector<c10::IValue>());
    return TM_NAMESPACE::w8a8_linear(x, packed, small_m, present(bias), out_features);
  }
  // no oneDNN layout: the small-M layout is the only copy and serves every row count (gemm_small_m.cpp, AMX-BF16)
  if (small_m.numel() > 0 && (x.size(0) <= small_m_max_rows || packed.numel() == 0)) {
    RECORD_FUNCTION("tokenmill::small_m_linear", std::vector<c10::IValue>());
    return small_m_linear(x, small_m, present(bias), out_features);
  }
  return onednn_linear(x, packed, bias);
}

}  // namespace

at::Tensor llama_forward(const at::Tensor& embeddings, at::TensorList layer_weights, const at::Tensor& final_norm,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& positions,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, int64_t num_heads, int64_t head_dim,
                         int64_t intermediate, double eps, double scale, int64_t small_m_max_rows,
                         at::TensorList kv_scales, at::TensorList lora_weights, at::TensorList lora_ranks,
                         const std::optional<at::Tensor>& lora_segments) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(layer_weights.size()) == layers * kWeightsPerLayer &&
                  static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(kv_scales.size()) == layers, "llama_forward: weights, caches or scales missing");
  const int64_t tokens = embeddings.size(0);
  at::Tensor residual = embeddings;  // the embedding lookup's fresh output: updated in place
  at::Tensor h = at::empty_like(embeddings);
  at::Tensor q = at::empty({tokens, num_heads, head_dim}, embeddings.options());
  at::Tensor attn = at::empty_like(q);
  at::Tensor act = at::empty({tokens, intermediate}, embeddings.options());
  // a one-byte cache: the attention reads this step's own keys from here, not quantized (paged_attention)
  const bool one_byte = kv_format(k_caches[0], embeddings.scalar_type()) != tm_kv::KVFormat::kNative;
  std::optional<at::Tensor> new_k, new_v;
  if (one_byte) new_k = at::empty({tokens, k_caches[0].size(1), head_dim}, embeddings.options());
  // With LoRA tokens in the step (tokenmill/lora/): per layer A^T and B^T of qkv, o, gate_up and down, the slots'
  // ranks of each of the four (empty: no adapter of the step targets it), and each request's rows and slot.
  TORCH_CHECK(lora_weights.empty() || (static_cast<int64_t>(lora_weights.size()) == layers * 8 &&
                                       lora_ranks.size() == 4 && lora_segments.has_value()),
              "llama_forward: LoRA weights, ranks or segments missing");
  auto lora = [&](at::Tensor& out, const at::Tensor& x, int64_t l, int kind, at::IntArrayRef shard_out) {
    if (lora_weights.empty() || lora_ranks[kind].numel() == 0) return;
    RECORD_FUNCTION("tokenmill::lora_delta", std::vector<c10::IValue>());
    TM_NAMESPACE::lora_delta(out, x, lora_weights[l * 8 + 2 * kind], lora_weights[l * 8 + 2 * kind + 1],
                             *lora_segments, lora_ranks[kind], shard_out);
  };
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = layer_weights.data() + l * kWeightsPerLayer;
    {
      RECORD_FUNCTION("tokenmill::fused_add_rms_norm", std::vector<c10::IValue>());
      if (l == 0)
        rms_norm(h, residual, w[0], eps);
      else
        fused_add_rms_norm(h, residual, w[0], eps);
    }
    const int64_t kv_heads = k_caches[l].size(1), hidden = embeddings.size(1);
    at::Tensor qkv = layer_linear(h, w[1], w[10], w[2], (num_heads + 2 * kv_heads) * head_dim, small_m_max_rows);
    lora(qkv, h, l, 0, {num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim});
    {
      RECORD_FUNCTION("tokenmill::rope_and_cache", std::vector<c10::IValue>());
      rope_and_cache(qkv, positions, cos, sin, k_caches[l], v_caches[l], slot_mapping, q, present(w[3]),
                     present(w[4]), eps, kv_scales[l], new_k);
    }
    if (one_byte)
      new_v = qkv.narrow(1, (num_heads + kv_heads) * head_dim, kv_heads * head_dim).view({tokens, kv_heads, head_dim});
    {
      RECORD_FUNCTION("tokenmill::paged_attention", std::vector<c10::IValue>());
      paged_attention(attn, q, k_caches[l], v_caches[l], block_tables, seq_lens, query_start_loc, scale, 0,
                      kv_scales[l], new_k, new_v);
    }
    at::Tensor o = layer_linear(attn.view({tokens, num_heads * head_dim}), w[5], w[11], w[6], hidden, small_m_max_rows);
    lora(o, attn.view({tokens, num_heads * head_dim}), l, 1, {hidden});
    {
      RECORD_FUNCTION("tokenmill::fused_add_rms_norm", std::vector<c10::IValue>());
      fused_add_rms_norm(o, residual, w[7], eps);
    }
    at::Tensor gate_up = layer_linear(o, w[8], w[12], at::Tensor(), 2 * intermediate, small_m_max_rows);
    lora(gate_up, o, l, 2, {intermediate, intermediate});
    {
      RECORD_FUNCTION("tokenmill::silu_and_mul", std::vector<c10::IValue>());
      silu_and_mul(act, gate_up);
    }
    h = layer_linear(act, w[9], w[13], at::Tensor(), hidden, small_m_max_rows);
    lora(h, act, l, 3, {hidden});
  }
  RECORD_FUNCTION("tokenmill::fused_add_rms_norm", std::vector<c10::IValue>());
  fused_add_rms_norm(h, residual, final_norm, eps);
  return h;
}

}  // namespace TM_NAMESPACE
