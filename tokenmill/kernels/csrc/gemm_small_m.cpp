// Linear layers for a few rows (decode batches): y = x W^T (+ b), reading each weight byte once per call.
// oneDNN reaches ~20 GB/s on these shapes; the weight stream is the whole cost, so the layout is made for it:
// W is packed as [N / VL][K][VL] (float32) or, for bf16 with AVX512-BF16, [N / 16][K / 2][16 x (2 bf16)], so
// one vector load feeds VL (or 16) outputs and every row of x reuses it from a register; no horizontal sums.
// pack_small_m packs; small_m_linear multiplies. Rows are processed 8 at a time (8 accumulators in registers).
//
// Prefill chunks (more than kSmallMRows rows) on CPUs with AMX-BF16 read the same packed weight: a group's 16 rows
// of [16 outputs x 2 bf16] for 32 consecutive K are exactly a tdpbf16ps B tile (16 rows x 64 bytes), so the
// weight needs no second layout (issue 41's "one copy of the weights": the model keeps only this one where the
// CPU runs this path; tokenmill/models/linear.py). A register block is 32 rows x 32 outputs (two activation
// tiles, two weight tiles, four float32 sum tiles accumulating all of K, as oneDNN's AMX GEMM does); rows past
// M are read from a zeroed copy of the last rows. Float32 prefill chunks go through a blocked GEMM on the same
// layout (f32_gemm below); bf16 ones without AMX-BF16 through the 8-row blocks. small_m_select_path() picks the
// path for the tests and benchmarks ("vector", the 8-row blocks, for both dtypes).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <string>
#include <vector>

#include "amx.h"
#include "ops.h"
#include "vec.h"

namespace TM_NAMESPACE {

namespace {

constexpr int kSmallMRows = 8;

#if defined(__AVX512F__)
__attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f"))) void small_m_bf16_block(
    const uint16_t* x, int64_t x_stride, int rows, const uint32_t* w, int64_t k2, const float* bias,
    uint16_t* y, int64_t y_stride) {
  __m512 acc[kSmallMRows];
  for (int m = 0; m < kSmallMRows; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k2; ++k) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k * 16);
#pragma GCC unroll 8
    for (int m = 0; m < kSmallMRows; ++m) {
      if (m < rows) {
        acc[m] = _mm512_dpbf16_ps(acc[m], wv, bf16_pair(x + m * x_stride + 2 * k));
      }
    }
  }
  const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int m = 0; m < rows; ++m)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * y_stride), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m], b)));
}

bool cpu_has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}
#endif

void small_m_f32_block(const float* x, int64_t x_stride, int rows, const float* w, int64_t K, const float* bias,
                       float* y, int64_t y_stride) {
  vfloat acc[kSmallMRows];
  for (int m = 0; m < kSmallMRows; ++m) acc[m] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const vfloat wv = vload(w + k * VL);
#pragma GCC unroll 8
    for (int m = 0; m < kSmallMRows; ++m)
      if (m < rows) acc[m] = vfma(vset1(x[m * x_stride + k]), wv, acc[m]);
  }
  const vfloat b = bias ? vload(bias) : vzero();
  for (int m = 0; m < rows; ++m) vstore(y + m * y_stride, vadd(acc[m], b));
}

// Float32 batches of more than kSmallMRows rows (prefill chunks) read the same [N / VL][K][VL] layout, blocked as
// BLIS blocks a GEMM whose weight is already packed in panels: a register block of kGemmRows rows x two panels
// (12 accumulators, 2 weight vectors and a broadcast: 15 of AVX2's 16 registers) runs over kGemmK consecutive K,
// so the two panels' slices (kGemmK x 2 VL floats, 16 KB on AVX2) stay in L1 while it walks a chunk of kGemmChunk
// rows whose kGemmK-wide slice of x (128 KB) stays in L2; the sums go through y between K slices (the first slice
// starts from the bias). The 8-row blocks above re-read x from L2 for every 8 outputs and load a broadcast per
// multiply-add, which made them ~1.9x oneDNN's time at 512 rows on an AVX2-only EPYC; this is what lets the model
// keep the small-M layout alone in float32 where it is the default (kF32Default below).
constexpr int kGemmRows = 6;
constexpr int64_t kGemmK = 256;
constexpr int64_t kGemmChunk = 126;  // a multiple of kGemmRows
// Outputs are taken kGemmSpan panel pairs at a time (512 on AVX2): every chunk of rows passes over that span's K
// slice while it is in cache, so a weight with many outputs (an lm_head: 49,152 or 262,144) is read from memory
// once per call, not once per chunk (which made a 512-row lm_head 1.3x oneDNN's time on an AVX2-only EPYC;
// 8 to 64 pairs and 60 to 252 rows a chunk were tried there, 32 and 126 were best).
constexpr int64_t kGemmSpan = 32;

template <int R, int P>
void f32_gemm_block(const float* x, int64_t xs, const float* w, int64_t panel_stride, int64_t kc, const float* bias,
                    bool first, float* y, int64_t ys) {
  vfloat acc[R][P];
#pragma GCC unroll 6
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p)
      acc[m][p] = !first ? vload(y + m * ys + p * VL) : bias ? vload(bias + p * VL) : vzero();
  for (int64_t k = 0; k < kc; ++k) {
    vfloat wv[P];
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) wv[p] = vload(w + p * panel_stride + k * VL);
#pragma GCC unroll 6
    for (int m = 0; m < R; ++m) {
      const vfloat a = vset1(x[m * xs + k]);
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p) acc[m][p] = vfma(a, wv[p], acc[m][p]);
    }
  }
#pragma GCC unroll 6
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) vstore(y + m * ys + p * VL, acc[m][p]);
}

using GemmBlock = void (*)(const float*, int64_t, const float*, int64_t, int64_t, const float*, bool, float*, int64_t);

template <int... Rs>
constexpr std::array<std::array<GemmBlock, 2>, sizeof...(Rs)> gemm_blocks(std::integer_sequence<int, Rs...>) {
  return {{{&f32_gemm_block<Rs + 1, 1>, &f32_gemm_block<Rs + 1, 2>}...}};
}
constexpr auto kGemmBlocks = gemm_blocks(std::make_integer_sequence<int, kGemmRows>());

// Panel pairs [begin, end) of y [M, Np], over every K slice and chunk of rows: the span's K slice of the weight
// stays in cache while every chunk passes over it (kGemmSpan).
void f32_gemm_span(const float* x, int64_t xs, int64_t M, int64_t K, const float* w, int64_t panels,
                   const float* bias, float* y, int64_t begin, int64_t end) {
  const int64_t Np = panels * VL;
  for (int64_t k0 = 0; k0 < K; k0 += kGemmK) {
    const int64_t kc = std::min(kGemmK, K - k0);
    for (int64_t c0 = 0; c0 < M; c0 += kGemmChunk) {
      const int64_t c1 = std::min(M, c0 + kGemmChunk);
      for (int64_t p0 = begin * 2; p0 < end * 2; p0 += 2) {
        const int np = static_cast<int>(std::min<int64_t>(2, panels - p0));
        const float* b = bias ? bias + p0 * VL : nullptr;
        for (int64_t m0 = c0; m0 < c1; m0 += kGemmRows) {
          const int r = static_cast<int>(std::min<int64_t>(kGemmRows, c1 - m0));
          kGemmBlocks[r - 1][np - 1](x + m0 * xs + k0, xs, w + p0 * K * VL + k0 * VL, K * VL, kc, b, k0 == 0,
                                     y + m0 * Np + p0 * VL, Np);
        }
      }
    }
  }
}

// y [M, Np] = x [M, K] W^T (+ bias), W packed [Np / VL][K][VL] float32; the threads split the panel pairs, and
// each takes its own kGemmSpan pairs at a time.
void f32_gemm(const at::Tensor& x, const at::Tensor& packed, const float* bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (panels + 1) / 2, 1, [&](int64_t first, int64_t last) {
    for (int64_t begin = first; begin < last; begin += kGemmSpan)
      f32_gemm_span(xp, x.stride(0), M, K, wp, panels, bias, yp, begin, std::min(last, begin + kGemmSpan));
  });
}

#if defined(__AVX512F__)
constexpr int64_t kAmxChunk = 256;  // rows per work item at most

// y [M, Np] = x [M, K] W^T (+ bias), W packed [Np/16][K/2][16][2] bf16, K a multiple of 32: work items of
// up to kAmxChunk rows (cut evenly: even_row_chunks) x kAmxSpan groups (amx.h's amx_bf16_rows).
void amx_bf16_gemm(const at::Tensor& x, const at::Tensor& packed, const float* bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), groups = packed.size(0), Np = groups * 16;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const RowChunks chunks = even_row_chunks(M, kAmxChunk, 16);
  const int64_t spans = (groups + kAmxSpan - 1) / kAmxSpan;
  at::parallel_for(0, chunks.count * spans, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> tail;
    amx_configure();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t chunk = i / spans, g_first = (i % spans) * kAmxSpan;
      amx_bf16_rows(xp, x.stride(0), chunk * chunks.rows, std::min(M, (chunk + 1) * chunks.rows), M,
                    wp + g_first * K * 16, std::min<int64_t>(kAmxSpan, groups - g_first), K,
                    bias ? bias + g_first * 16 : nullptr, yp + g_first * 16, Np, tail);
    }
    amx_release();
  });
}
#endif

enum Path { kVector, kAmxBf16, kF32Gemm };
const char* const kPathNames[] = {"vector", "amx_bf16", "f32_gemm"};
std::atomic<int> selected{-1};  // small_m_select_path's choice; -1: the best this CPU runs for each dtype

// The float32 default: f32_gemm where it was measured faster than oneDNN (the AVX2 build on an AVX2-only EPYC:
// benchmarks/results/one-copy.md), so the model keeps this layout alone there (models/linear.py one_layout). The
// AVX-512 build's 16-lane f32_gemm has not been timed against oneDNN yet: the 8-row blocks stay its default, so
// the model keeps oneDNN's copy for prefill chunks, and f32_gemm runs only when selected (tests, benchmarks).
#if defined(__AVX512F__)
constexpr int kF32Default = kVector;
#else
constexpr int kF32Default = kF32Gemm;
#endif

bool runs(int path) {
#if defined(__AVX512F__)
  if (path == kAmxBf16) return cpu_has_avx512_bf16() && amx_available(AmxUnit::kBf16);
#endif
  return path == kVector || path == kF32Gemm;
}

// The path for batches of more than kSmallMRows rows of this dtype: the selected one where it is this dtype's
// ("vector", the 8-row blocks, is both dtypes'), else the best this CPU runs.
int large_path(at::ScalarType dtype) {
  const int p = selected.load(std::memory_order_relaxed);
  if (dtype != at::kBFloat16) return p == kVector || p == kF32Gemm ? p : kF32Default;
  return p == kVector || p == kAmxBf16 ? p : (runs(kAmxBf16) ? kAmxBf16 : kVector);
}

int path_for_rows(int64_t rows, const at::Tensor& x) {
  if (rows <= kSmallMRows || (x.scalar_type() == at::kBFloat16 && x.size(1) % 32)) return kVector;
  return large_path(x.scalar_type());
}

// The lanes of one packed block: VL floats, or 16 bf16 outputs on the AVX512-BF16 path.
int64_t small_m_lanes(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 16 : VL; }

}  // namespace

bool small_m_supported(at::ScalarType dtype) {
#if defined(__AVX512F__)
  if (dtype == at::kBFloat16) return cpu_has_avx512_bf16();
#endif
  return dtype == at::kFloat;
}

// weight [N, K] -> packed blocks (N padded to the lanes with zero rows); bf16: pairs along K as one int32.
at::Tensor pack_small_m(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_small_m: a [N, K] weight");
  TORCH_CHECK(small_m_supported(weight.scalar_type()), "pack_small_m: no small-M kernel for ", weight.scalar_type(),
              " on this CPU");
  const int64_t N = weight.size(0), K = weight.size(1), lanes = small_m_lanes(weight.scalar_type());
  const int64_t Np = (N + lanes - 1) / lanes * lanes;
  at::Tensor w = at::zeros({Np, K}, weight.options());
  w.narrow(0, 0, N).copy_(weight);
  if (weight.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(K % 2 == 0, "pack_small_m: bf16 needs an even K");
    return w.view({Np / lanes, lanes, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  }
  return w.view({Np / lanes, lanes, K}).permute({0, 2, 1}).contiguous();
}

at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                          int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == packed.scalar_type(),
              "small_m_linear: x [rows, K] with contiguous rows, the weight's dtype");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t rows = x.size(0), K = x.size(1), lanes = small_m_lanes(x.scalar_type());
  const int64_t blocks = packed.size(0), Np = blocks * lanes;
  TORCH_CHECK(packed.numel() == Np * K && out_features <= Np, "small_m_linear: weight packed for another shape");
  at::Tensor b;
  if (bias.has_value() && bias->numel() > 0) {
    b = at::zeros({Np}, x.options().dtype(at::kFloat));
    b.narrow(0, 0, out_features).copy_(*bias);
  }
  at::Tensor y = at::empty({rows, Np}, x.options());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const int path = path_for_rows(rows, x);
#if defined(__AVX512F__)
  if (path == kAmxBf16) {
    amx_bf16_gemm(x, packed, bp, y);
    return Np == out_features ? y : y.narrow(1, 0, out_features);
  }
#endif
  if (path == kF32Gemm) {
    f32_gemm(x, packed, bp, y);
    return Np == out_features ? y : y.narrow(1, 0, out_features);
  }
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      for (int64_t m0 = 0; m0 < rows; m0 += kSmallMRows) {
        const int r = static_cast<int>(std::min<int64_t>(kSmallMRows, rows - m0));
        const float* bias_block = bp ? bp + nb * lanes : nullptr;
        if (bf16) {
#if defined(__AVX512F__)
          small_m_bf16_block(reinterpret_cast<const uint16_t*>(x.data_ptr()) + m0 * x.stride(0), x.stride(0), r,
                             reinterpret_cast<const uint32_t*>(packed.data_ptr()) + nb * (K / 2) * 16, K / 2,
                             bias_block, reinterpret_cast<uint16_t*>(y.data_ptr()) + m0 * Np + nb * lanes, Np);
#endif
        } else {
          small_m_f32_block(x.data_ptr<float>() + m0 * x.stride(0), x.stride(0), r,
                            packed.data_ptr<float>() + nb * K * lanes, K, bias_block,
                            y.data_ptr<float>() + m0 * Np + nb * lanes, Np);
        }
      }
    }
  });
  return Np == out_features ? y : y.narrow(1, 0, out_features);
}

std::string small_m_large_path(at::ScalarType dtype) { return kPathNames[large_path(dtype)]; }

std::string small_m_select_path(const std::string& path) {
  const int previous = selected.load(std::memory_order_relaxed);
  int p = -1;
  for (int i = 0; i < static_cast<int>(std::size(kPathNames)); ++i)
    if (path == kPathNames[i]) p = i;
  TORCH_CHECK(path == "auto" || p >= 0, "small_m_select_path: unknown path '", path,
              "' (auto, vector, amx_bf16, f32_gemm)");
  TORCH_CHECK(p < 0 || runs(p), "small_m_select_path: this CPU and build do not run ", path);
  selected.store(p, std::memory_order_relaxed);
  return previous < 0 ? "auto" : kPathNames[previous];
}

}  // namespace TM_NAMESPACE
