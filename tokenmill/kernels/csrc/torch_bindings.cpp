// The one place the library's ops are declared to torch: every schema and its CPU implementation (ops.h lists
// the functions, one source per kernel family). Built once per ISA, each build under its own namespace
// (torch.ops.tokenmill_avx512, torch.ops.tokenmill_avx2), so one process can load both.
#include <torch/library.h>

#include "ops.h"

namespace {
// The schema's out argument is a Tensor(a!) by value; lora_delta takes it by reference for the fused stack.
void lora_delta_op(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
                   const at::Tensor& segments, const at::Tensor& ranks, at::IntArrayRef shard_out) {
  TM_NAMESPACE::lora_delta(out, x, a, b_t, segments, ranks, shard_out);
}
}  // namespace

TORCH_LIBRARY(TM_NAMESPACE, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, float scale, int window=0, Tensor? kv_scales=None, "
        "Tensor? key=None, Tensor? value=None) -> ()");
  m.def("attention_prefill_path() -> str", [] { return TM_NAMESPACE::attention_prefill_path(); });
  m.def("attention_select_path(str path) -> str",
        [](std::string p) { return TM_NAMESPACE::attention_select_path(p); });
  m.def("rope_and_cache(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, Tensor(c!) q_out, Tensor? q_norm, Tensor? k_norm, float eps, "
        "Tensor? kv_scales=None, Tensor(d!)? k_out=None) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("argmax(Tensor logits) -> Tensor");
  m.def("small_m_supported(ScalarType dtype) -> bool",
        [](at::ScalarType dtype) { return TM_NAMESPACE::small_m_supported(dtype); });
  m.def("pack_small_m(Tensor weight) -> Tensor");
  m.def("small_m_large_path(ScalarType dtype) -> str",
        [](at::ScalarType dtype) { return TM_NAMESPACE::small_m_large_path(dtype); });
  m.def("small_m_select_path(str path) -> str", [](std::string p) { return TM_NAMESPACE::small_m_select_path(p); });
  m.def("small_m_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("llama_forward(Tensor embeddings, Tensor[] layer_weights, Tensor final_norm, Tensor[] k_caches, "
        "Tensor[] v_caches, Tensor positions, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, int num_heads, int head_dim, int intermediate, float eps, "
        "float scale, int small_m_max_rows, Tensor[] kv_scales, Tensor[] lora_weights, Tensor[] lora_ranks, "
        "Tensor? lora_segments) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor meta, Tensor? bias, int out_features) -> Tensor");
  m.def("quant_dequantize(Tensor qweight, Tensor meta, int out_features, ScalarType dtype) -> Tensor");
  m.def("quant_linear_path() -> str", [] { return TM_NAMESPACE::quant_linear_path(); });
  m.def("quant_linear_select_path(str path) -> str",
        [](std::string p) { return TM_NAMESPACE::quant_linear_select_path(p); });
  m.def("w8a8_linear(Tensor x, Tensor qweight, Tensor meta, Tensor? bias, int out_features) -> Tensor");
  m.def("w8a8_quantize(Tensor x) -> (Tensor, Tensor)");
  m.def("w8a8_int_gemm(Tensor xq, Tensor qweight, Tensor meta) -> Tensor");
  m.def("w8a8_linear_path() -> str", [] { return TM_NAMESPACE::w8a8_linear_path(); });
  m.def("w8a8_select_path(str path) -> str", [](std::string p) { return TM_NAMESPACE::w8a8_select_path(p); });
  m.def("lora_delta(Tensor(a!) out, Tensor x, Tensor a, Tensor b_t, Tensor segments, Tensor ranks, int[] shard_out) "
        "-> ()");
}

TORCH_LIBRARY_IMPL(TM_NAMESPACE, CPU, m) {
  m.impl("paged_attention", &TM_NAMESPACE::paged_attention);
  m.impl("rope_and_cache", &TM_NAMESPACE::rope_and_cache);
  m.impl("rms_norm", &TM_NAMESPACE::rms_norm);
  m.impl("fused_add_rms_norm", &TM_NAMESPACE::fused_add_rms_norm);
  m.impl("silu_and_mul", &TM_NAMESPACE::silu_and_mul);
  m.impl("argmax", &TM_NAMESPACE::argmax);
  m.impl("pack_small_m", &TM_NAMESPACE::pack_small_m);
  m.impl("small_m_linear", &TM_NAMESPACE::small_m_linear);
  m.impl("llama_forward", &TM_NAMESPACE::llama_forward);
  m.impl("quant_linear", &TM_NAMESPACE::quant_linear);
  m.impl("quant_dequantize", &TM_NAMESPACE::quant_dequantize);
  m.impl("w8a8_linear", &TM_NAMESPACE::w8a8_linear);
  m.impl("w8a8_quantize", &TM_NAMESPACE::w8a8_quantize);
  m.impl("w8a8_int_gemm", &TM_NAMESPACE::w8a8_int_gemm);
  m.impl("lora_delta", &lora_delta_op);
}

// llama_forward also receives oneDNN's prepacked weights, whose dispatch key is MkldnnCPU.
TORCH_LIBRARY_IMPL(TM_NAMESPACE, MkldnnCPU, m) {
  m.impl("llama_forward", &TM_NAMESPACE::llama_forward);
}
