// RoPE (rotate-half layout) applied to q and k straight from the fused qkv projection, with the optional
// per-head RMSNorm of q and k (Qwen3) before it; writes q to q_out and k, v into their KV-cache slots, in the
// layout paged_attention reads, and k to k_out too when given (paged_attention's `key`: this step's keys as the
// model's dtype holds them, before a one-byte cache quantizes them).
// cos and sin: float32 [max_positions, head_dim] (both halves repeated). A slot < 0 is not written.
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kv_quant.h"
#include "ops.h"
#include "vec.h"

namespace TM_NAMESPACE {

namespace {

template <typename T>
void rope_row(float* x, const float* cos, const float* sin, int D) {
  const int half = D / 2;
  for (int i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

template <typename T>
void head_rms_norm(float* x, const at::Tensor& w, int D, double eps) {
  if (!w.defined()) return;
  float ss = 0.0f;
  for (int d = 0; d < D; ++d) ss += x[d] * x[d];
  const float r = 1.0f / std::sqrt(ss / D + static_cast<float>(eps));
  const auto* wr = raw_ptr<T>(w);
  for (int d = 0; d < D; ++d) x[d] = round_to<T>(Elem<T>::load(wr[d]) * round_to<T>(x[d] * r));
}

template <typename T>
void rope_and_cache_impl(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& slot_mapping, at::Tensor& q_out, const at::Tensor& q_norm,
                         const at::Tensor& k_norm, double eps, tm_kv::KVFormat fmt, const float* kv_scales,
                         typename Elem<T>::raw* k_out) {
  const int64_t T_ = qkv.size(0);
  const int Hq = q_out.size(1), D = q_out.size(2), Hkv = k_cache.size(1);
  const int64_t B = k_cache.size(3);
  const int64_t row_stride = qkv.stride(0);
  const auto* src = raw_ptr<T>(qkv);
  auto* qo = raw_ptr<T>(q_out);
  auto* kc = raw_ptr<T>(k_cache);
  auto* vc = raw_ptr<T>(v_cache);
  auto* kc8 = static_cast<uint8_t*>(k_cache.data_ptr());
  auto* vc8 = static_cast<uint8_t*>(v_cache.data_ptr());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> x(D);
    for (int64_t t = begin; t < end; ++t) {
      const auto* row = src + t * row_stride;
      const float* c = cs + pos[t] * D;
      const float* s = sn + pos[t] * D;
      for (int h = 0; h < Hq; ++h) {
        load_row<T>(x.data(), row + h * D, D);
        head_rms_norm<T>(x.data(), q_norm, D, eps);
        rope_row<T>(x.data(), c, s, D);
        store_row<T>(qo + (t * Hq + h) * D, x.data(), D);
      }
      const int64_t slot = slots[t];
      if (slot < 0 && k_out == nullptr) continue;
      const int64_t block = slot / B, offset = slot % B;
      for (int h = 0; h < Hkv; ++h) {
        load_row<T>(x.data(), row + (Hq + h) * D, D);
        head_rms_norm<T>(x.data(), k_norm, D, eps);
        rope_row<T>(x.data(), c, s, D);
        if (k_out != nullptr) store_row<T>(k_out + (t * Hkv + h) * D, x.data(), D);
        if (slot < 0) continue;
        const int64_t k_at = ((block * Hkv + h) * D) * B + offset;  // K transposed: stride B between dims
        const int64_t v_at = ((block * Hkv + h) * B + offset) * D;
        if (fmt != tm_kv::KVFormat::kNative) {  // K as the model's dtype would hold it, then quantized
          const float* ks = kv_scales + h * D;
          const float* vs = kv_scales + (Hkv + h) * D;
#pragma omp simd
          for (int d = 0; d < D; ++d) x[d] = round_to<T>(x[d]) * (1.0f / ks[d]);
          tm_kv::encode_row(kc8 + k_at, B, x.data(), D, fmt, 1.0f);
          load_row<T>(x.data(), row + (Hq + Hkv + h) * D, D);
#pragma omp simd
          for (int d = 0; d < D; ++d) x[d] *= 1.0f / vs[d];
          tm_kv::encode_row(vc8 + v_at, 1, x.data(), D, fmt, 1.0f);
          continue;
        }
        auto* k_dst = kc + k_at;
        for (int d = 0; d < D; ++d) k_dst[d * B] = Elem<T>::store(x[d]);
        std::memcpy(vc + v_at, row + (Hq + Hkv + h) * D, D * sizeof(typename Elem<T>::raw));
      }
    }
  });
}

}  // namespace

void rope_and_cache(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping, at::Tensor q_out,
                    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double eps,
                    const std::optional<at::Tensor>& kv_scales,
                    const std::optional<at::Tensor>& k_out) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv: [tokens, (heads + 2 kv_heads) * head_dim], rows contiguous");
  TORCH_CHECK(!k_out.has_value() || (k_out->is_contiguous() && k_out->scalar_type() == qkv.scalar_type() &&
                                     k_out->numel() == qkv.size(0) * k_cache.size(1) * q_out.size(2)),
              "rope_and_cache: k_out is a contiguous [tokens, kv_heads, head_dim] in qkv's dtype");
  TORCH_CHECK(q_out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "outputs must be contiguous");
  TORCH_CHECK(qkv.size(1) == (q_out.size(1) + 2 * k_cache.size(1)) * q_out.size(2), "qkv width does not match heads");
  TORCH_CHECK(k_cache.size(2) == q_out.size(2) && v_cache.size(3) == q_out.size(2) && v_cache.size(2) == k_cache.size(3),
              "k_cache [blocks, kv_heads, head_dim, block_size], v_cache [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong, "positions, slots: int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.size(1) == q_out.size(2),
              "cos, sin: float32 [positions, head_dim]");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && q_out.scalar_type() == qkv.scalar_type(), "dtypes differ");
  const tm_kv::KVFormat fmt = kv_format(k_cache, qkv.scalar_type());
  const float* scales = kv_scales_ptr(kv_scales, fmt, k_cache.size(1), k_cache.size(2));
  const at::Tensor qn = q_norm.has_value() ? q_norm->contiguous() : at::Tensor();
  const at::Tensor kn = k_norm.has_value() ? k_norm->contiguous() : at::Tensor();
  TM_DISPATCH(qkv.scalar_type(), "rope_and_cache", [&] {
    rope_and_cache_impl<scalar_t>(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, q_out, qn, kn, eps, fmt,
                                  scales, k_out ? raw_ptr<scalar_t>(*k_out) : nullptr);
  });
}

}  // namespace TM_NAMESPACE
