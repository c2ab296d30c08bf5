// W8A8 linear layers (`--quantization w8a8`): int8 weights per output channel, int8 activations per token
// quantized at run time (a scale per 64 K of each token), int32 dot products, float output.
//
// Prefill is compute-bound, and a bf16 or float32 GEMM is bounded by the float FMA rate; integer dot products
// do 4 multiply-adds per 32-bit lane (AVX512-VNNI vpdpbusd) where vdpbf16ps does 2 and an FMA 1, and on CPUs
// without native bf16 (AVX2 EPYC, older Xeons) they are the only fast path at all. The same kernel serves
// decode batches: its weight stream is one byte per weight, half of bf16's.
//
// Numerics (tokenmill/models/quantization.py W8A8Weight quantizes the weights at load):
// - weights: per output row n, sw = amax_n / 127, wq = round(w / sw) in -127..127 (symmetric: -128 is never
//   used, which the AVX2 path below needs);
// - activations: per row (token) m and block b of 64 K, symmetric: sx = amax / 127, xq = round(x * (127 / amax))
//   in -127..127 (round half to even, as torch.round). A scale per token alone (one for all of K) lost too much
//   on the default model (SmolLM2-135M, float32, tests/data/heldout_text.txt): perplexity +2.2% (asymmetric
//   per token; +3.6% symmetric) and tie-aware agreement 0.984, against issue 41's 2% and 0.99; a scale per 64 K
//   gave +0.7% in the same emulation (per 32: +0.6%), at the cost of one int32 -> float conversion and FMA per
//   accumulator and block (16 vpdpbusd);
// - the kernels compute per block the int32 sums sum_{k in b} xq wq, the exact product of the two int8
//   matrices on every path (the tests compare them bit for bit), and y[m, n] = sw_n sum_b sx_mb sum_b + b_n,
//   float32, rounded once more to bf16 where the model runs in bf16.
//
// Two instruction paths, chosen at run time like quant_linear.cpp's:
// - AVX512-VNNI: vpdpbusd multiplies unsigned by signed bytes, so each activation is stored as xq + 128 (u8 in
//   1..255) and the 128 sum_{k in b} wq that this adds is subtracted per output and block (SGLang's sgl-kernel
//   CPU int8 GEMM and oneDNN's u8s8 GEMM compensate the same way; the sums are computed once at load, in meta:
//   the accumulators start from minus it). A block's sum is at most 64 * 255 * 127 < 2^24, exact in float32.
// - AVX2 (the AVX2 build, or an AVX-512 CPU without VNNI): vpmaddubsw multiplies u8 by s8 and adds pairs with
//   int16 saturation, which u8 activations up to 255 against weights down to -128 would reach (2 * 255 * 128).
//   Instead, as llama.cpp does, it multiplies |xq| (u8, <= 127) by sign(xq) wq (vpsignb, s8: |wq| <= 127 because
//   -128 is never produced): a pair sums to at most 2 * 127 * 127 = 32258 < 32767, so it cannot saturate (the
//   tests run it at that bound); vpmaddwd by ones then widens pairs into int32.
// There is no AMX-INT8 path: build.py has no AMX variant, and the CPUs this is developed on (Zen 4/5) lack AMX,
// so it could not be tested.
//
// Layout: qweight [N/16][K/4][16][4] int8 (N padded to 16 outputs, K to a multiple of 64 with zero weights): one
// 64-byte vector holds 16 outputs x 4 consecutive K, the 32-bit lane vpdpbusd takes. meta float32
// [N/16][1 + K/64][16]: per group of 16 outputs sw, then per K block 128 sum_{k in b} wq (exact integers).
// Register blocking: 6 rows x 32 outputs on AVX-512 (12 int32 and 12 float accumulators), 4 rows x 8 outputs on
// AVX2 (16 registers); the weight tile stays in L1/L2 while every row block of the chunk streams past it.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace TM_NAMESPACE {
namespace {

constexpr int kGroup = 16;          // outputs per packed group: one 64-byte vector of 16 x 4 K
constexpr int kBlock = 64;          // K per activation scale
constexpr int kSteps = kBlock / 4;  // 4-K steps per block
constexpr int kRowsVnni = 6;        // rows per register block on AVX-512 (6 x 2 int32 + 6 x 2 float)
constexpr int kGroupsVnni = 2;      // groups per register block on AVX-512: 32 outputs
constexpr int kRowsAvx2 = 4;        // AVX2: 4 rows x 8 outputs (4 int32 + 4 float accumulators)
constexpr int64_t kRowChunk = 240;  // rows per parallel work item: a chunk of activations stays in L2

inline int32_t load32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

bool use_vnni() {
#if defined(__AVX512F__)
  static const bool has = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  return has;
#else
  return false;
#endif
}

// ---- activations: per row and 64-K block, xq = round(x * 127 / amax), plus 128 for the VNNI path (as u8) ----

template <typename In>
void quantize_rows(const In* x, int64_t stride, int64_t M, int64_t K, int64_t kp, bool shift, uint8_t* q,
                   float* scale) {
  const int64_t nb = kp / kBlock;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    float f[kBlock];
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t k0 = b * kBlock, n = std::min<int64_t>(kBlock, K - k0);
        const In* src = x + r * stride + k0;
        float amax = 0.0f;
#pragma omp simd reduction(max : amax)
        for (int64_t k = 0; k < n; ++k) {
          if constexpr (std::is_same_v<In, float>) f[k] = src[k];
          else f[k] = bf16_to_float(src[k]);
          amax = std::max(amax, std::fabs(f[k]));
        }
        for (int64_t k = n; k < kBlock; ++k) f[k] = 0.0f;  // K's tail: against zero weights
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const int offset = shift ? 128 : 0;
        uint8_t* dst = q + r * kp + k0;
#pragma omp simd
        for (int k = 0; k < kBlock; ++k) {
          const float v = std::min(127.0f, std::max(-127.0f, std::nearbyint(f[k] * inv)));
          dst[k] = static_cast<uint8_t>(static_cast<int>(v) + offset);
        }
        scale[r * nb + b] = amax / 127.0f;
      }
    }
  });
}

// ---- the register blocks: R rows x G groups, all K. Raw: out int32 [R][K/64][G * 16], each block's sums;
// else out float32 [R][G * 16] = sum_b sx[r][b] (block b's sums) ----

#if defined(__AVX512F__)
template <int R, int G, bool Raw>
__attribute__((target("avx512vnni,avx512bw,avx512f"))) void block_vnni(const uint8_t* x, int64_t kp,
                                                                        const float* xs, const int8_t* w,
                                                                        int64_t group_stride, const float* meta,
                                                                        int64_t meta_stride, void* out) {
  const int64_t nb = kp / kBlock;
  __m512 facc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) facc[r][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[R][G];
    for (int g = 0; g < G; ++g) {  // start from -128 sum_{k in b} wq: the shift of the activations
      const __m512 comp = _mm512_loadu_ps(meta + g * meta_stride + (1 + b) * kGroup);
      const __m512i start = _mm512_cvtps_epi32(_mm512_sub_ps(_mm512_setzero_ps(), comp));
      for (int r = 0; r < R; ++r) acc[r][g] = start;
    }
    const uint8_t* xb0 = x + b * kBlock;
    const int8_t* wb = w + b * kSteps * 64;
#pragma GCC unroll 4
    for (int k = 0; k < kSteps; ++k) {
      __m512i wv[G];
      for (int g = 0; g < G; ++g) wv[g] = _mm512_loadu_si512(wb + g * group_stride + k * 64);
      for (int r = 0; r < R; ++r) {
        const __m512i xb = _mm512_set1_epi32(load32(xb0 + r * kp + 4 * k));
        for (int g = 0; g < G; ++g) acc[r][g] = _mm512_dpbusd_epi32(acc[r][g], xb, wv[g]);
      }
    }
    if constexpr (Raw) {
      int32_t* o = static_cast<int32_t*>(out);
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) _mm512_storeu_si512(o + (r * nb + b) * G * kGroup + g * kGroup, acc[r][g]);
    } else {
      for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_set1_ps(xs[r * nb + b]);
        for (int g = 0; g < G; ++g) facc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][g]), s, facc[r][g]);
      }
    }
  }
  if constexpr (!Raw) {
    float* o = static_cast<float*>(out);
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(o + r * G * kGroup + g * kGroup, facc[r][g]);
  }
}
#endif

template <int R, bool Raw>
__attribute__((target("avx2,fma,f16c"))) void block_avx2(const uint8_t* x, int64_t kp, const float* xs,
                                                          const int8_t* w, int64_t /*group_stride*/,
                                                          const float* /*meta*/, int64_t /*meta_stride*/,
                                                          void* out) {
  const int64_t nb = kp / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {  // the group's two halves of 8 outputs
    __m256 facc[R];
    for (int r = 0; r < R; ++r) facc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256i acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
      const uint8_t* xb0 = x + b * kBlock;
      const int8_t* wb = w + b * kSteps * 64 + h * 32;
      for (int k = 0; k < kSteps; ++k) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + k * 64));
        for (int r = 0; r < R; ++r) {
          const __m256i xb = _mm256_set1_epi32(load32(xb0 + r * kp + 4 * k));
          // |xq| * sign(xq) wq: pairs of at most 2 * 127 * 127, no int16 saturation (see the top of the file)
          const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(xb), _mm256_sign_epi8(wv, xb));
          acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(p, ones));
        }
      }
      if constexpr (Raw) {
        int32_t* o = static_cast<int32_t*>(out);
        for (int r = 0; r < R; ++r)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + (r * nb + b) * kGroup + h * 8), acc[r]);
      } else {
        for (int r = 0; r < R; ++r)
          facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_set1_ps(xs[r * nb + b]), facc[r]);
      }
    }
    if constexpr (!Raw) {
      float* o = static_cast<float*>(out);
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(o + r * kGroup + h * 8, facc[r]);
    }
  }
}

using BlockFn = void (*)(const uint8_t*, int64_t, const float*, const int8_t*, int64_t, const float*, int64_t, void*);

// The kernel of this CPU: blocks by rows (1..rows) and, on AVX-512, by groups (1 or 2, for an odd last group);
// [0]: float output, [1]: raw per-block sums.
struct Kernel {
  std::array<std::array<std::array<BlockFn, kRowsVnni + 1>, kGroupsVnni + 1>, 2> fn{};
  int rows = 0, groups = 0;
  bool shift = false;  // activations stored as xq + 128 (u8), compensated per output and block
};

template <bool Raw, int... Rs>
void fill_avx2(Kernel& k, std::integer_sequence<int, Rs...>) {
  ((k.fn[Raw][1][Rs + 1] = &block_avx2<Rs + 1, Raw>), ...);
}
#if defined(__AVX512F__)
template <bool Raw, int G, int... Rs>
void fill_vnni(Kernel& k, std::integer_sequence<int, Rs...>) {
  ((k.fn[Raw][G][Rs + 1] = &block_vnni<Rs + 1, G, Raw>), ...);
}
#endif

const Kernel& kernel() {
  static const Kernel k = [] {
    Kernel k;
#if defined(__AVX512F__)
    if (use_vnni()) {
      fill_vnni<false, 1>(k, std::make_integer_sequence<int, kRowsVnni>());
      fill_vnni<false, 2>(k, std::make_integer_sequence<int, kRowsVnni>());
      fill_vnni<true, 1>(k, std::make_integer_sequence<int, kRowsVnni>());
      fill_vnni<true, 2>(k, std::make_integer_sequence<int, kRowsVnni>());
      k.rows = kRowsVnni;
      k.groups = kGroupsVnni;
      k.shift = true;
      return k;
    }
#endif
    fill_avx2<false>(k, std::make_integer_sequence<int, kRowsAvx2>());
    fill_avx2<true>(k, std::make_integer_sequence<int, kRowsAvx2>());
    k.rows = kRowsAvx2;
    k.groups = 1;
    return k;
  }();
  return k;
}

void check_weight(const at::Tensor& qweight, const at::Tensor& meta, int64_t K) {
  TORCH_CHECK(qweight.dim() == 4 && qweight.scalar_type() == at::kChar && qweight.is_contiguous() &&
                  qweight.size(2) == kGroup && qweight.size(3) == 4 && qweight.size(1) % kSteps == 0,
              "w8a8: qweight is [N/16, K/4, 16, 4] int8, K padded to a multiple of 64");
  TORCH_CHECK(qweight.size(1) == (K + kBlock - 1) / kBlock * kSteps, "w8a8: weight packed for K = ",
              qweight.size(1) * 4, ", got ", K);
  const int64_t nb = qweight.size(1) / kSteps;
  TORCH_CHECK(meta.scalar_type() == at::kFloat && meta.is_contiguous() && meta.dim() == 3 &&
                  meta.size(0) == qweight.size(0) && meta.size(1) == 1 + nb && meta.size(2) == kGroup,
              "w8a8: meta is [N/16, 1 + K/64, 16] float32 (scales, then the blocks' weight sums)");
}

// Every row against every output, handed block by block to emit(m0, rows, n0, width, out) (the block function's
// out: float [rows][width], or Raw: int32 [rows][K/64][width]).
template <bool Raw, typename Emit>
void gemm(const uint8_t* xq, const float* xs, int64_t M, int64_t kp, const at::Tensor& qweight,
          const at::Tensor& meta, const Emit& emit) {
  const Kernel& kn = kernel();
  const int64_t groups = qweight.size(0), group_stride = kp / 4 * 64, nb = kp / kBlock;
  const int64_t meta_stride = (1 + nb) * kGroup;
  const int8_t* w = qweight.data_ptr<int8_t>();
  const float* mp = meta.data_ptr<float>();
  const int64_t tiles = (groups + kn.groups - 1) / kn.groups, chunks = (M + kRowChunk - 1) / kRowChunk;
  at::parallel_for(0, chunks * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<char> buf(kRowsVnni * kGroupsVnni * kGroup * 4 * (Raw ? nb : 1));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t chunk = i / tiles, g0 = (i % tiles) * kn.groups;
      const int g = static_cast<int>(std::min<int64_t>(kn.groups, groups - g0));
      const int64_t m_end = std::min(M, (chunk + 1) * kRowChunk);
      for (int64_t m0 = chunk * kRowChunk; m0 < m_end; m0 += kn.rows) {
        const int rows = static_cast<int>(std::min<int64_t>(kn.rows, m_end - m0));
        kn.fn[Raw][g][rows](xq + m0 * kp, kp, xs + m0 * nb, w + g0 * group_stride, group_stride,
                            mp + g0 * meta_stride, meta_stride, buf.data());
        emit(m0, rows, g0 * kGroup, g * kGroup, buf.data());
      }
    }
  });
}

template <typename Out>
at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& meta,
                       const std::optional<at::Tensor>& bias, int64_t out_features) {
  using In = std::conditional_t<std::is_same_v<Out, float>, float, uint16_t>;
  const int64_t M = x.size(0), K = x.size(1), kp = qweight.size(1) * 4, nb = kp / kBlock;
  const int64_t padded = qweight.size(0) * kGroup;
  std::vector<uint8_t> xq(M * kp);
  std::vector<float> xs(M * nb);
  quantize_rows<In>(reinterpret_cast<const In*>(x.data_ptr()), x.stride(0), M, K, kp, kernel().shift, xq.data(),
                    xs.data());
  std::vector<float> b(padded, 0.0f), sw(padded);
  if (bias.has_value() && bias->numel() > 0) {
    at::Tensor b32 = bias->to(at::kFloat).contiguous();
    std::copy(b32.data_ptr<float>(), b32.data_ptr<float>() + out_features, b.begin());
  }
  const float* mp = meta.data_ptr<float>();
  for (int64_t n = 0; n < padded; ++n) sw[n] = mp[(n / kGroup) * (1 + nb) * kGroup + n % kGroup];
  at::Tensor y = at::empty({M, out_features}, x.options());
  Out* yp = reinterpret_cast<Out*>(y.data_ptr());
  gemm<false>(xq.data(), xs.data(), M, kp, qweight, meta, [&](int64_t m0, int rows, int64_t n0, int width,
                                                             const void* out) {
    const float* acc = static_cast<const float*>(out);
    const int n = static_cast<int>(std::min<int64_t>(width, out_features - n0));
    for (int r = 0; r < rows; ++r) {
      Out* dst = yp + (m0 + r) * out_features + n0;
      const float* s = acc + r * width;
#pragma omp simd
      for (int i = 0; i < n; ++i) {
        const float v = s[i] * sw[n0 + i] + b[n0 + i];
        if constexpr (std::is_same_v<Out, float>) dst[i] = v;
        else dst[i] = float_to_bf16(v);
      }
    }
  });
  return y;
}

}  // namespace

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& meta,
                       const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "w8a8_linear: x is [rows, K] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "w8a8_linear: float32 or bfloat16 activations");
  check_weight(qweight, meta, x.size(1));
  TORCH_CHECK(out_features <= qweight.size(0) * kGroup && out_features > (qweight.size(0) - 1) * kGroup,
              "w8a8_linear: weight packed for another shape");
  TORCH_CHECK(!bias.has_value() || bias->numel() == 0 || bias->numel() == out_features,
              "w8a8_linear: bias of out_features");
  if (x.scalar_type() == at::kFloat) return linear_impl<float>(x, qweight, meta, bias, out_features);
  return linear_impl<uint16_t>(x, qweight, meta, bias, out_features);
}

std::tuple<at::Tensor, at::Tensor> w8a8_quantize(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "w8a8_quantize: x is [rows, K] float32 or bfloat16 with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), kp = (K + kBlock - 1) / kBlock * kBlock;
  at::Tensor q = at::empty({M, kp}, x.options().dtype(at::kChar));
  at::Tensor s = at::empty({M, kp / kBlock}, x.options().dtype(at::kFloat));
  auto run = [&](auto tag) {
    using In = decltype(tag);
    quantize_rows<In>(reinterpret_cast<const In*>(x.data_ptr()), x.stride(0), M, K, kp, false,
                      reinterpret_cast<uint8_t*>(q.data_ptr()), s.data_ptr<float>());
  };
  if (x.scalar_type() == at::kFloat) run(float{});
  else run(uint16_t{});
  return {q.narrow(1, 0, K), s};
}

at::Tensor w8a8_int_gemm(const at::Tensor& xq, const at::Tensor& qweight, const at::Tensor& meta) {
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kChar && xq.stride(1) == 1,
              "w8a8_int_gemm: xq [rows, K] int8 with contiguous rows");
  const int64_t M = xq.size(0), K = xq.size(1), kp = qweight.size(1) * 4, nb = kp / kBlock;
  const int64_t padded = qweight.size(0) * kGroup;
  check_weight(qweight, meta, K);
  // the kernel's own activation layout: K padded, shifted to u8 on the VNNI path
  const int shift = kernel().shift ? 128 : 0;
  std::vector<uint8_t> x(M * kp, static_cast<uint8_t>(shift));
  const int8_t* src = xq.data_ptr<int8_t>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) x[m * kp + k] = static_cast<uint8_t>(src[m * xq.stride(0) + k] + shift);
  std::vector<float> unused(M * nb, 1.0f);
  at::Tensor out = at::empty({M, nb, padded}, xq.options().dtype(at::kInt));
  int32_t* op = out.data_ptr<int32_t>();
  gemm<true>(x.data(), unused.data(), M, kp, qweight, meta, [&](int64_t m0, int rows, int64_t n0, int width,
                                                               const void* buf) {
    const int32_t* sums = static_cast<const int32_t*>(buf);
    for (int r = 0; r < rows; ++r)
      for (int64_t b = 0; b < nb; ++b)
        std::memcpy(op + ((m0 + r) * nb + b) * padded + n0, sums + (r * nb + b) * width, width * 4);
  });
  return out;
}

std::string w8a8_linear_path() { return use_vnni() ? "avx512_vnni" : "avx2"; }

}  // namespace TM_NAMESPACE
