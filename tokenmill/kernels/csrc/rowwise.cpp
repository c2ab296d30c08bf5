// Row-wise kernels: RMSNorm (plain and fused with the residual add), SiLU-and-mul, and greedy argmax. Each row
// is independent, so the rows are split across threads and each row's loop is a contiguous float32 one.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace TM_NAMESPACE {

// RMSNorm as the reference computes it: float32 statistics, the normalized value rounded to the storage type,
// then scaled by the weight. The fused form first adds x into the residual stream (rounded, as a bf16 add is)
// and normalizes that: residual <- x + residual; x <- rms_norm(residual).
namespace {

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps,
                   at::Tensor* residual) {
  const int64_t rows = x.size(0);
  const int H = x.size(1);
  const auto* w = raw_ptr<T>(weight);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(H);
    for (int64_t r = begin; r < end; ++r) {
      auto* xr = raw_ptr<T>(x) + r * x.stride(0);
      load_row<T>(buf.data(), xr, H);
      if (residual != nullptr) {
        auto* rr = raw_ptr<T>(*residual) + r * residual->stride(0);
#pragma omp simd
        for (int i = 0; i < H; ++i) buf[i] = round_to<T>(buf[i] + Elem<T>::load(rr[i]));
        store_row<T>(rr, buf.data(), H);
      }
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int i = 0; i < H; ++i) ss += buf[i] * buf[i];
      const float inv = 1.0f / std::sqrt(ss / H + static_cast<float>(eps));
      auto* o = raw_ptr<T>(out) + r * out.stride(0);
#pragma omp simd
      for (int i = 0; i < H; ++i) o[i] = Elem<T>::store(Elem<T>::load(w[i]) * round_to<T>(buf[i] * inv));
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": [rows, hidden] with contiguous rows");
}

}  // namespace

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "rms_norm: shapes or dtypes differ");
  TM_DISPATCH(x.scalar_type(), "rms_norm", [&] { rms_norm_impl<scalar_t>(out, x, weight, eps, nullptr); });
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type() && residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: shapes or dtypes differ");
  TM_DISPATCH(x.scalar_type(), "fused_add_rms_norm", [&] { rms_norm_impl<scalar_t>(x, x, weight, eps, &residual); });
}

namespace {

// silu(gate) * up, where x = [gate | up] along the last dimension; silu rounded to the storage type first.
template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0);
  const int I = out.size(1);
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> g(I), u(I);
    for (int64_t r = begin; r < end; ++r) {
      const auto* xr = raw_ptr<T>(x) + r * x.stride(0);
      load_row<T>(g.data(), xr, I);
      load_row<T>(u.data(), xr + I, I);
      int i = 0;
      for (; i + VL <= I; i += VL) {
        const vfloat x = vload(g.data() + i);
        const vfloat e = vexp(vmin(vsub(vzero(), x), vset1(88.0f)));
        vstore(g.data() + i, vdiv(x, vadd(vset1(1.0f), e)));
      }
      for (; i < I; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i]));
#pragma omp simd
      for (int k = 0; k < I; ++k) g[k] = round_to<T>(g[k]) * u[k];
      store_row<T>(raw_ptr<T>(out) + r * out.stride(0), g.data(), I);
    }
  });
}

}  // namespace

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.size(1) == 2 * out.size(1) && x.size(0) == out.size(0) && x.scalar_type() == out.scalar_type(),
              "silu_and_mul: out is [rows, n], x is [rows, 2n]");
  TM_DISPATCH(x.scalar_type(), "silu_and_mul", [&] { silu_and_mul_impl<scalar_t>(out, x); });
}

// Greedy sampling: the first index of each row's maximum (torch.argmax's tie rule).
at::Tensor argmax(const at::Tensor& logits) {
  check_rows(logits, "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "argmax: float32 logits");
  const int64_t rows = logits.size(0), V = logits.size(1);
  auto result = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* res = result.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = logits.data_ptr<float>() + r * logits.stride(0);
      float best = row[0];
      int64_t best_i = 0;
      for (int64_t i = 1; i < V; ++i) {
        if (row[i] > best) {
          best = row[i];
          best_i = i;
        }
      }
      res[r] = best_i;
    }
  });
  return result;
}

}  // namespace TM_NAMESPACE
