// Linear layers over weights kept quantized: 4-bit (GGUF Q4_0/Q4_1, tokenmill's int4) and 8-bit (GGUF Q8_0,
// tokenmill's int8), y = x W^T (+ b). A decode step streams every weight once, so reading 4.5-5 bits per weight
// instead of bf16's 16 is the whole gain at small batch; the arithmetic has to keep up with that stream.
//
// Weight-only quantization, as torch's _weight_int8pack_mm / _weight_int4pack_mm_for_cpu, torchao and vLLM do it:
// the activations keep their precision. llama.cpp's way (int8 activations per 32-block) flipped near-ties:
// teacher-forced top-1 agreement of the Q4_1 model with the same file dequantized was 0.980, and int8 weights
// against float32 0.957 (tests/test_quantization.py).
//
// Three paths, by the number of rows M:
// - M <= kDenseMinRows (decode; bf16 on AVX512-BF16: M <= kTiledMinRows): integer dot products in registers.
//   The activations are converted once per call to int16 per row and 32-wide K block, scale dx = amax / 32767
//   (a 1/65534 step: 2^-16 relative, finer than bf16's own 2^-9 rounding of the activations, so the result
//   equals the dequantized model's up to float rounding). Each weight block (32 K, one output) has a scale d and
//   an offset m, w = d q + m (Q4_0's w = d(q - 8) is stored as m = -8d; Q8_0 has m = 0), with q in 0..15
//   (4-bit) or -128..127 (8-bit):
//     sum_k w_k x_k = dx (d * sum q xq + m * sum xq)
//   The weight bytes are widened to int16 in registers (one byte shuffle per 2 K) and multiplied by
//   AVX512-VNNI vpdpwssd (2 products per 32-bit lane), or vpmaddwd on AVX2. Sums fit int32: 32 * 128 * 32767.
// - M > kDenseMinRows (prefill chunks): compute dominates, so each weight is dequantized (d q + m in float32, as
//   QuantizedTensor.dequantize and the GGUF loader compute it, then rounded to the activations' dtype: the very
//   values `--quantization none` holds) into a transient buffer, in tiles of output rows, and multiplied by
//   oneDNN. Prefill numerics then equal the dequantized model's; no dense copy stays resident.
// - M > kTiledMinRows with bf16 activations on a CPU with AVX512-BF16 (the serving case): the same dequantized
//   bf16 values, 32 outputs at a time into a buffer that stays in L1/L2 (as bf16 pairs along K, the layout
//   vdpbf16ps takes), multiplied with every row in registers (12 rows x 32 outputs per block, float32 sums). No
//   weight-sized buffer is written, faulted in and reordered by oneDNN on every call, and the dequantization,
//   once per weight and call, is shared by all M rows: from 32 rows up this beats both the int16 kernel and
//   dequantize + oneDNN, and matches oneDNN on a prepacked dense weight. Where the CPU has AMX-BF16 (Sapphire
//   Rapids), the same bf16 values go through AMX tiles instead (amx_span_linear: each group dequantized into the
//   packed dense weight's layout, multiplied by amx.h's amx_bf16_rows, the dense model's own AMX GEMM): the
//   dense model's prefill GEMMs run on AMX, and so must the kept weights' (a 1,500-token prefill of the default
//   GGUF model took 2.3 s on the vdpbf16ps tiles against 0.5 s dense; on AMX 0.55 s).
//   quant_linear_select_path() forces either, for the tests and benchmarks.
//
// Layout (tokenmill/models/quantization.py packs it at load): outputs in groups of 16; per group and K block,
// the quants of 4 consecutive K of one output are one 32-bit lane, so one 64-byte vector holds 16 outputs x 4 K.
// 8-bit: [G][K/32][8][16][4] int8. 4-bit: [G][K/32][4][16][4] bytes whose low nibbles are K 4j..4j+3 and high
// nibbles K 16+4j..16+4j+3. meta [G][K/32][2][16] 16-bit: d, then m (fp16 bits).
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx.h"
#include "ops.h"
#include "vec.h"

namespace TM_NAMESPACE {
namespace {

constexpr int kGroup = 16;  // outputs per packed group
constexpr int kBlock = 32;  // K per quantization block

// Above this many rows the weight is dequantized and multiplied by oneDNN (see the top of the file): the two
// cross between 64 and 128 rows. Measured per linear of SmolLM2-135M with bf16 activations
// (benchmarks/quant_linear.py, fastest call, 1 thread, 2-core Zen 4 with VNNI and AVX512-BF16, shared machine;
// ms, int16 kernel / dequantize + oneDNN): qkv 960x576 at 64 rows 0.41 / 0.46, 128 rows 0.81 / 0.77, 512 rows
// 3.35 / 2.81; gate_up 3072x576 1.28 / 1.50, 2.59 / 2.63, 10.8 / 9.5; down 576x1536 0.65 / 0.73, 1.30 / 1.21,
// 5.60 / 4.97; o 576x576 0.25 / 0.29, 0.50 / 0.47, 2.00 / 1.63. At 1 row the int16 kernel takes 0.041 ms on
// gate_up (4-bit) against 0.068 for oneDNN on the dense bf16 weight; at 8 rows 0.163 / 0.148; at 32 0.64 / 0.52.
constexpr int64_t kDenseMinRows = 96;
// bf16 activations on AVX512-BF16: above this many rows, the tiled path (dequantize 32 outputs into bf16 pairs,
// vdpbf16ps over every row) replaces both. Measured as above (1 thread, bf16, ms, int16 / tiled / oneDNN bf16 on
// a prepacked dense weight): gate_up 16 rows 0.320 / 0.367 / 0.273, 24 rows 0.478 / 0.490 / 0.396, 32 rows
// 0.636 / 0.617 / 0.521, 48 rows 0.958 / 0.871 / 0.803, 128 rows 2.77 (dequantize + oneDNN) / 2.28 / 2.29;
// qkv 24 rows 0.154 / 0.155, 32 rows 0.205 / 0.195, 512 rows 2.97 (dequantize + oneDNN) / 2.70 / 2.80.
constexpr int64_t kTiledMinRows = 24;
// Output rows dequantized at a time on the dense path: a tile of at most 4M elements (16 MB in float32) bounds
// the transient buffer for the 49152-row lm_head while every other linear is one tile.
constexpr int64_t kDenseTileElements = int64_t{1} << 22;

inline float half_bits_to_float(uint16_t h) {
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}
inline float bf16_bits_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16_bits(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

bool cpu_has_vnni() {
#if defined(__AVX512F__)
  static const bool has = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  return has;
#else
  return false;
#endif
}

// ---- small M: int16 activations, integer dot products ----

// The activations of one call: per row, K int16 quants; per row and 32-block, the scale dx and the sum of quants.
struct Int16Acts {
  std::vector<int16_t> q;
  std::vector<float> scale, sum;
};

template <typename In>
void quantize_rows(const at::Tensor& x, int64_t K, Int16Acts& a) {
  const int64_t M = x.size(0), nb = K / kBlock;
  a.q.resize(M * K);
  a.scale.resize(M * nb);
  a.sum.resize(M * nb);
  const In* base = reinterpret_cast<const In*>(x.data_ptr());
  const int64_t stride = x.stride(0);
  for (int64_t r = 0; r < M; ++r) {  // M <= kDenseMinRows rows: not worth threads
    for (int64_t b = 0; b < nb; ++b) {
      const In* src = base + r * stride + b * kBlock;
      float f[kBlock];
      float amax = 0.0f;
#pragma omp simd reduction(max : amax)
      for (int k = 0; k < kBlock; ++k) {
        if constexpr (std::is_same_v<In, float>) f[k] = src[k];
        else f[k] = bf16_bits_to_float(src[k]);
        amax = std::max(amax, std::fabs(f[k]));
      }
      const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
      int sum = 0;
      int16_t* dst = a.q.data() + r * K + b * kBlock;
#pragma omp simd reduction(+ : sum)
      for (int k = 0; k < kBlock; ++k) {
        const int q = static_cast<int>(std::nearbyint(f[k] * inv));
        sum += q;
        dst[k] = static_cast<int16_t>(q);
      }
      a.scale[r * nb + b] = amax / 32767.0f;
      a.sum[r * nb + b] = static_cast<float>(sum);
    }
  }
}

// The int16 pair of K 2p, 2p+1, broadcast to every lane.
inline int32_t x2(const int16_t* xr, int p) {
  int32_t v;
  std::memcpy(&v, xr + 2 * p, 4);
  return v;
}

// Byte shuffles that widen the 4 bytes of each 32-bit lane (K 4g..4g+3) to two int16 pairs: bytes 0,1 (lo) or
// 2,3 (hi) of each lane. Unsigned quants (4-bit) go to the low byte of each int16 with a zero high byte; signed
// ones (8-bit) to the high byte, then an arithmetic shift right by 8 sign-extends them.
template <bool Q4>
inline void widen_masks(int8_t lo[16], int8_t hi[16]) {
  for (int lane = 0; lane < 4; ++lane) {
    for (int j = 0; j < 2; ++j) {
      const int zero = lane * 4 + j * 2 + (Q4 ? 1 : 0), byte = lane * 4 + j * 2 + (Q4 ? 0 : 1);
      lo[zero] = -128;
      hi[zero] = -128;
      lo[byte] = static_cast<int8_t>(lane * 4 + j);
      hi[byte] = static_cast<int8_t>(lane * 4 + 2 + j);
    }
  }
}

#if defined(__AVX512F__)
// R rows of x against one group of 16 outputs, all K blocks, with AVX512-VNNI. out: [R][16] float32.
template <bool Q4, int R>
__attribute__((target("avx512vnni,avx512bw,avx512f"))) void group_vnni(const uint8_t* w, const uint16_t* meta,
                                                                        int64_t nb, const int16_t* xq, int64_t K,
                                                                        const float* xs, const float* xsum,
                                                                        float* out) {
  int8_t lo_idx[16], hi_idx[16];
  widen_masks<Q4>(lo_idx, hi_idx);
  const __m512i lo_mask = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo_idx)));
  const __m512i hi_mask = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi_idx)));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {  // K 4g..4g+3
      __m512i v;
      if constexpr (Q4) {
        const __m512i packed = _mm512_loadu_si512(w + (b * 4 + (g & 3)) * 64);
        v = g < 4 ? _mm512_and_si512(packed, low4) : _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
      } else {
        v = _mm512_loadu_si512(w + (b * 8 + g) * 64);
      }
      __m512i wlo = _mm512_shuffle_epi8(v, lo_mask), whi = _mm512_shuffle_epi8(v, hi_mask);
      if constexpr (!Q4) {
        wlo = _mm512_srai_epi16(wlo, 8);
        whi = _mm512_srai_epi16(whi, 8);
      }
      for (int r = 0; r < R; ++r) {
        const int16_t* xr = xq + r * K + b * kBlock;
        s[r] = _mm512_dpwssd_epi32(s[r], wlo, _mm512_set1_epi32(x2(xr, 2 * g)));
        s[r] = _mm512_dpwssd_epi32(s[r], whi, _mm512_set1_epi32(x2(xr, 2 * g + 1)));
      }
    }
    const uint16_t* mb = meta + b * 2 * kGroup;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mb)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mb + kGroup)));
    for (int r = 0; r < R; ++r) {
      const __m512 t = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * nb + b]), _mm512_mul_ps(d, _mm512_cvtepi32_ps(s[r])));
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * nb + b]), t, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kGroup, acc[r]);
}
#endif

// The same with AVX2 (vpmaddwd), one half of the group (8 outputs) at a time: AVX2 has 16 registers. Runs on
// the AVX2 build, and on the AVX-512 build where the CPU lacks VNNI.
template <bool Q4, int R>
__attribute__((target("avx2,fma,f16c"))) void group_avx2(const uint8_t* w, const uint16_t* meta, int64_t nb,
                                                          const int16_t* xq, int64_t K, const float* xs,
                                                          const float* xsum, float* out) {
  int8_t lo_idx[16], hi_idx[16];
  widen_masks<Q4>(lo_idx, hi_idx);
  const __m256i lo_mask = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo_idx)));
  const __m256i hi_mask = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi_idx)));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256i s[R];
      for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g) {
        __m256i v;
        if constexpr (Q4) {
          const __m256i packed =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b * 4 + (g & 3)) * 64 + h * 32));
          v = g < 4 ? _mm256_and_si256(packed, low4) : _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
        } else {
          v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b * 8 + g) * 64 + h * 32));
        }
        __m256i wlo = _mm256_shuffle_epi8(v, lo_mask), whi = _mm256_shuffle_epi8(v, hi_mask);
        if constexpr (!Q4) {
          wlo = _mm256_srai_epi16(wlo, 8);
          whi = _mm256_srai_epi16(whi, 8);
        }
        for (int r = 0; r < R; ++r) {
          const int16_t* xr = xq + r * K + b * kBlock;
          s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(wlo, _mm256_set1_epi32(x2(xr, 2 * g))));
          s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(whi, _mm256_set1_epi32(x2(xr, 2 * g + 1))));
        }
      }
      const uint16_t* mb = meta + b * 2 * kGroup + h * 8;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mb)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mb + kGroup)));
      for (int r = 0; r < R; ++r) {
        const __m256 t =
            _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[r * nb + b]), _mm256_mul_ps(d, _mm256_cvtepi32_ps(s[r])));
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(xs[r * nb + b]), t, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * kGroup + h * 8, acc[r]);
  }
}

using GroupFn = void (*)(const uint8_t*, const uint16_t*, int64_t, const int16_t*, int64_t, const float*,
                         const float*, float*);

template <bool Q4, int... Rs>
void fill_avx2(GroupFn* table, std::integer_sequence<int, Rs...>) {
  ((table[Rs + 1] = &group_avx2<Q4, Rs + 1>), ...);
}
#if defined(__AVX512F__)
template <bool Q4, int... Rs>
void fill_vnni(GroupFn* table, std::integer_sequence<int, Rs...>) {
  ((table[Rs + 1] = &group_vnni<Q4, Rs + 1>), ...);
}
#endif

constexpr int kRowsVnni = 8;  // rows per pass: 8 int32 and 8 float accumulators, the widened weights, masks
constexpr int kRowsAvx2 = 4;

struct Kernel {
  GroupFn fn[kRowsVnni + 1] = {};
  int rows = 0;
};

const Kernel& kernel_for(bool q4) {
  static const std::vector<Kernel> table = [] {
    std::vector<Kernel> k(2);
    for (int q = 0; q < 2; ++q) {
#if defined(__AVX512F__)
      if (cpu_has_vnni()) {
        if (q) fill_vnni<true>(k[q].fn, std::make_integer_sequence<int, kRowsVnni>());
        else fill_vnni<false>(k[q].fn, std::make_integer_sequence<int, kRowsVnni>());
        k[q].rows = kRowsVnni;
        continue;
      }
#endif
      if (q) fill_avx2<true>(k[q].fn, std::make_integer_sequence<int, kRowsAvx2>());
      else fill_avx2<false>(k[q].fn, std::make_integer_sequence<int, kRowsAvx2>());
      k[q].rows = kRowsAvx2;
    }
    return k;
  }();
  return table[q4 ? 1 : 0];
}

template <typename Out>
void store_group(Out* y, int64_t y_stride, const float* acc, int rows, int n, const float* bias) {
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < n; ++i) {
      const float v = acc[r * kGroup + i] + (bias ? bias[i] : 0.0f);
      if constexpr (std::is_same_v<Out, float>) y[r * y_stride + i] = v;
      else y[r * y_stride + i] = float_to_bf16_bits(v);
    }
  }
}

at::Tensor int16_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& meta,
                        const std::optional<at::Tensor>& bias, int64_t out_features, bool q4) {
  const int64_t M = x.size(0), K = x.size(1), groups = qweight.size(0), nb = qweight.size(1);
  const Kernel& kernel = kernel_for(q4);
  Int16Acts acts;
  if (x.scalar_type() == at::kFloat) quantize_rows<float>(x, K, acts);
  else quantize_rows<uint16_t>(x, K, acts);
  std::vector<float> b;
  if (bias.has_value() && bias->numel() > 0) {
    at::Tensor b32 = bias->to(at::kFloat).contiguous();
    b.assign(b32.data_ptr<float>(), b32.data_ptr<float>() + out_features);
    b.resize(groups * kGroup, 0.0f);
  }
  at::Tensor y = at::empty({M, out_features}, x.options());
  const uint8_t* wbase = qweight.data_ptr<uint8_t>();
  const uint16_t* mbase = reinterpret_cast<const uint16_t*>(meta.data_ptr());
  const int64_t group_bytes = nb * (q4 ? 4 : 8) * 64;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    float acc[kRowsVnni * kGroup];
    for (int64_t g = begin; g < end; ++g) {
      const int n = static_cast<int>(std::min<int64_t>(kGroup, out_features - g * kGroup));
      for (int64_t m0 = 0; m0 < M; m0 += kernel.rows) {
        const int rows = static_cast<int>(std::min<int64_t>(kernel.rows, M - m0));
        kernel.fn[rows](wbase + g * group_bytes, mbase + g * nb * 2 * kGroup, nb, acts.q.data() + m0 * K, K,
                        acts.scale.data() + m0 * nb, acts.sum.data() + m0 * nb, acc);
        const float* bg = b.empty() ? nullptr : b.data() + g * kGroup;
        if (x.scalar_type() == at::kFloat)
          store_group<float>(y.data_ptr<float>() + m0 * out_features + g * kGroup, out_features, acc, rows, n, bg);
        else
          store_group<uint16_t>(reinterpret_cast<uint16_t*>(y.data_ptr()) + m0 * out_features + g * kGroup,
                                out_features, acc, rows, n, bg);
      }
    }
  });
  return y;
}

// ---- large M: dequantize, then oneDNN ----

inline int32_t load32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// One output's 32 weights of one block, from its 32-bit lanes in the packed vectors (wb: the first lane).
template <bool Q4, typename Out>
__attribute__((target("avx2,fma,f16c"))) inline void dequantize_block(const uint8_t* wb, float d, float m, Out* out) {
  __m256 f[4];  // K 0..7, 8..15, 16..23, 24..31
  if constexpr (Q4) {  // lanes j = 0..3: low nibbles K 4j..4j+3, high nibbles K 16+4j..16+4j+3
    const __m128i bytes = _mm_setr_epi32(load32(wb), load32(wb + 64), load32(wb + 128), load32(wb + 192));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  } else {  // lanes j = 0..7: K 4j..4j+3
    for (int h = 0; h < 4; ++h)
      f[h] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_setr_epi32(load32(wb + 2 * h * 64),
                                                                    load32(wb + (2 * h + 1) * 64), 0, 0)));
  }
  const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
  for (int h = 0; h < 4; ++h) {
    // mul, then add (no FMA): the roundings of QuantizedTensor.dequantize and the GGUF loader
    const __m256 w = _mm256_add_ps(_mm256_mul_ps(f[h], dv), mv);
    if constexpr (std::is_same_v<Out, float>) {
      _mm256_storeu_ps(out + 8 * h, w);
    } else {  // bf16, round to nearest even, as torch does
      __m256i u = _mm256_castps_si256(w);
      u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                               _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
      u = _mm256_srli_epi32(u, 16);
      const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8 * h), packed);
    }
  }
}

// Output rows [row0, row0 + rows) of the dense weight, in Out (float or bf16 bits).
template <bool Q4, typename Out>
void dequantize_rows(const uint8_t* wbase, const uint16_t* mbase, int64_t nb, int64_t row0, int64_t rows, Out* dst) {
  const int64_t K = nb * kBlock, block_bytes = (Q4 ? 4 : 8) * 64;
  at::parallel_for(0, rows, kGroup, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t n = row0 + row, g = n / kGroup;
      const int i = static_cast<int>(n % kGroup);
      for (int64_t b = 0; b < nb; ++b) {
        const uint16_t* mb = mbase + (g * nb + b) * 2 * kGroup;
        dequantize_block<Q4, Out>(wbase + (g * nb + b) * block_bytes + i * 4, half_bits_to_float(mb[i]),
                                  half_bits_to_float(mb[kGroup + i]), dst + row * K + b * kBlock);
      }
    }
  });
}

template <typename Out>
void dequantize_rows(const at::Tensor& qweight, const at::Tensor& meta, int64_t row0, int64_t rows, Out* dst) {
  const uint8_t* wbase = qweight.data_ptr<uint8_t>();
  const uint16_t* mbase = reinterpret_cast<const uint16_t*>(meta.data_ptr());
  if (qweight.size(2) == 4) dequantize_rows<true, Out>(wbase, mbase, qweight.size(1), row0, rows, dst);
  else dequantize_rows<false, Out>(wbase, mbase, qweight.size(1), row0, rows, dst);
}

// Out rows [row0, row0 + rows) of the weight into w ([rows, K], float32 or bfloat16).
void dequantize_into(const at::Tensor& qweight, const at::Tensor& meta, int64_t row0, at::Tensor& w) {
  if (w.scalar_type() == at::kFloat) dequantize_rows<float>(qweight, meta, row0, w.size(0), w.data_ptr<float>());
  else dequantize_rows<uint16_t>(qweight, meta, row0, w.size(0), reinterpret_cast<uint16_t*>(w.data_ptr()));
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         std::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<std::string_view>)>();
  return op.call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), std::string_view(""));
}

// Whether oneDNN has an inner product for this dtype here (bf16 needs AVX-512; on AVX2 it refuses instead of
// emulating), probed once as tokenmill/models/linear.py's onednn_linear_supported probes it for the dense model.
bool onednn_linear_supported(at::ScalarType dtype) {
  auto probe = [](at::ScalarType t) {
    try {
      onednn_linear(at::ones({2, 8}, at::TensorOptions().dtype(t)), at::ones({8, 8}, at::TensorOptions().dtype(t)),
                    std::nullopt);
      return true;
    } catch (const std::exception&) {  // oneDNN's own error type, not a c10::Error
      return false;
    }
  };
  static const bool float32 = probe(at::kFloat), bfloat16 = probe(at::kBFloat16);
  return dtype == at::kFloat ? float32 : dtype == at::kBFloat16 ? bfloat16 : false;
}

// The dense model's linear on the dequantized weight: oneDNN where it serves the dtype, else at::linear, as
// the dense model falls back to F.linear; bf16 without oneDNN's (emulated by torch) from 32 rows through float32,
// as tokenmill/models/linear.py's linear() does from BF16_VIA_FLOAT32_MIN_ROWS (the same threshold).
at::Tensor dense_model_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  if (onednn_linear_supported(x.scalar_type())) return onednn_linear(x, weight, bias);
  if (x.scalar_type() == at::kBFloat16 && x.numel() >= 32 * x.size(-1)) {
    std::optional<at::Tensor> b32;
    if (bias.has_value() && bias->defined()) b32 = bias->to(at::kFloat);
    return at::linear(x.to(at::kFloat), weight.to(at::kFloat), b32).to(at::kBFloat16);
  }
  return at::linear(x, weight, bias);
}

// ---- large M, bf16 activations on AVX512-BF16: dequantize 32 outputs at a time into bf16 pairs, multiply in
// registers ----

#if defined(__AVX512F__)
bool cpu_has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

constexpr int kTileOutputs = 2 * kGroup;  // two packed groups: two vectors of outputs
constexpr int kTileRows = 12;             // rows per register block: 12 x 2 accumulators
std::atomic<bool> vdpbf16ps_forced{false};  // quant_linear_select_path("bf16_tiles"): no AMX for the tiles

bool amx_tiles() { return !vdpbf16ps_forced.load(std::memory_order_relaxed) && amx_available(AmxUnit::kBf16); }

// Two vectors of 16 outputs' weights (float32) → bf16 pairs: lane i holds (lo_i, hi_i).
__attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f"))) inline __m512i bf16_pairs(__m512 lo, __m512 hi,
                                                                                       __m512i interleave) {
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // [lo_0..15, hi_0..15]
}

// One output group (16 outputs) of the packed weight, all K, as bf16 pairs along K: pairs[k2 * ld + i] holds
// output i's weights K 2 k2 (low half) and 2 k2 + 1 (high half), the layout vdpbf16ps multiplies. The values are
// dequantize_block's, rounded to bf16 as torch rounds (round to nearest even; no subnormal arises from d q + m).
template <bool Q4>
__attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f"))) void dequantize_pairs(
    const uint8_t* wg, const uint16_t* mg, int64_t nb, uint32_t* pairs, int64_t ld) {
  const __m512i byte = _mm512_set1_epi32(0xFF), low4 = _mm512_set1_epi8(0x0F);
  alignas(64) int16_t order[32];
  for (int i = 0; i < 16; ++i) order[2 * i] = i, order[2 * i + 1] = 16 + i;
  const __m512i interleave = _mm512_load_si512(order);
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i* mb = reinterpret_cast<const __m256i*>(mg + b * 2 * kGroup);  // 16 d, then 16 m
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(mb)), m = _mm512_cvtph_ps(_mm256_loadu_si256(mb + 1));
    // each 32-bit lane: the quants of K 4j..4j+3 of its output; two pairs of K
    auto emit = [&](__m512i q4k, int j) {
      __m512 w[4];
      for (int c = 0; c < 4; ++c) {
        __m512i q;
        if constexpr (Q4) q = _mm512_and_si512(_mm512_srli_epi32(q4k, 8 * c), byte);
        else q = _mm512_srai_epi32(_mm512_slli_epi32(q4k, 24 - 8 * c), 24);
        // one rounding, as mul then add: d (fp16, 11 bits) times q (<= 8 bits) is exact in float32
        w[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, m);
      }
      uint32_t* dst = pairs + (b * (kBlock / 2) + 2 * j) * ld;
      _mm512_storeu_si512(dst, bf16_pairs(w[0], w[1], interleave));
      _mm512_storeu_si512(dst + ld, bf16_pairs(w[2], w[3], interleave));
    };
    if constexpr (Q4) {
      for (int j = 0; j < 4; ++j) {  // low nibbles: K 4j..4j+3; high nibbles: K 16+4j..16+4j+3
        const __m512i v = _mm512_loadu_si512(wg + (b * 4 + j) * 64);
        emit(_mm512_and_si512(v, low4), j);
        emit(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), 4 + j);
      }
    } else {
      for (int j = 0; j < 8; ++j) emit(_mm512_loadu_si512(wg + (b * 8 + j) * 64), j);
    }
  }
}

// R rows of bf16 x against 32 outputs in pairs ([K/2][32]): out [R][32] float32.
template <int R>
__attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f"))) void tile_bf16(const uint16_t* x, int64_t x_stride,
                                                                               const uint32_t* pairs, int64_t k2,
                                                                               float* out) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k2; ++k) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(pairs + k * kTileOutputs);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(pairs + k * kTileOutputs + kGroup);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = bf16_pair(x + r * x_stride + 2 * k);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xb);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xb);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * kTileOutputs, acc[r][0]);
    _mm512_storeu_ps(out + r * kTileOutputs + kGroup, acc[r][1]);
  }
}

// out [rows][32] float32 sums + bias → y rows (bf16, stride ld), n <= 32 outputs valid. vcvtneps2bf16 rounds to
// nearest even as torch does (it treats subnormal float32 as zero, which a linear's output never is in practice).
__attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f"))) void store_tile(const float* acc, int rows, int n,
                                                                                const float* bias, uint16_t* y,
                                                                                int64_t ld) {
  auto first_lanes = [](int count) {  // a mask of the first count of 16 lanes
    return static_cast<__mmask16>(count >= kGroup ? 0xFFFF : count <= 0 ? 0 : (1u << count) - 1);
  };
  const __mmask16 m0 = first_lanes(n), m1 = first_lanes(n - kGroup);
  const __m512 b0 = _mm512_maskz_loadu_ps(m0, bias), b1 = _mm512_maskz_loadu_ps(m1, bias + kGroup);
  for (int r = 0; r < rows; ++r) {
    const __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(acc + r * kTileOutputs), b0);
    const __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(acc + r * kTileOutputs + kGroup), b1);
    _mm256_mask_storeu_epi16(y + r * ld, m0, (__m256i)_mm512_cvtneps_pbh(v0));
    _mm256_mask_storeu_epi16(y + r * ld + kGroup, m1, (__m256i)_mm512_cvtneps_pbh(v1));
  }
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint32_t*, int64_t, float*);
template <int... Rs>
std::array<TileFn, kTileRows + 1> tile_table(std::integer_sequence<int, Rs...>) {
  return {nullptr, &tile_bf16<Rs + 1>...};
}

// The AMX-BF16 blocks: a work item dequantizes a span of kAmxSpan groups, each into the packed dense weight's
// layout, then multiplies every row with them (amx.h's amx_bf16_rows, as gemm_small_m.cpp's AMX GEMM does from
// the packed weight). y: [M, ld] bf16, ld = out_features, a multiple of 16.
void amx_span_linear(const uint16_t* xp, int64_t x_stride, int64_t M, int64_t K, const uint8_t* wbase,
                     const uint16_t* mbase, int64_t groups, int64_t nb, bool q4, const float* bias, uint16_t* yp,
                     int64_t ld) {
  const int64_t k2 = K / 2, group_bytes = nb * (q4 ? 4 : 8) * 64;
  const int64_t spans = (groups + kAmxSpan - 1) / kAmxSpan;
  at::parallel_for(0, spans, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> pairs(kAmxSpan * k2 * kGroup);
    std::vector<uint16_t> tail;
    amx_configure();
    for (int64_t s = begin; s < end; ++s) {
      const int64_t g_first = s * kAmxSpan, span = std::min<int64_t>(kAmxSpan, groups - g_first);
      for (int64_t g = 0; g < span; ++g) {
        const uint8_t* wg = wbase + (g_first + g) * group_bytes;
        const uint16_t* mg = mbase + (g_first + g) * nb * 2 * kGroup;
        if (q4) dequantize_pairs<true>(wg, mg, nb, pairs.data() + g * k2 * kGroup, kGroup);
        else dequantize_pairs<false>(wg, mg, nb, pairs.data() + g * k2 * kGroup, kGroup);
      }
      amx_bf16_rows(xp, x_stride, 0, M, M, reinterpret_cast<const uint16_t*>(pairs.data()), span, K,
                    bias + g_first * kGroup, yp + g_first * kGroup, ld, tail);
    }
    amx_release();
  });
}

at::Tensor bf16_tiled_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& meta,
                             const std::optional<at::Tensor>& bias, int64_t out_features) {
  static const auto tiles = tile_table(std::make_integer_sequence<int, kTileRows>());
  const int64_t M = x.size(0), K = x.size(1), groups = qweight.size(0), nb = qweight.size(1), k2 = K / 2;
  const bool q4 = qweight.size(2) == 4;
  const int64_t group_bytes = nb * (q4 ? 4 : 8) * 64;
  std::vector<float> b;
  if (bias.has_value() && bias->numel() > 0) {
    at::Tensor b32 = bias->to(at::kFloat).contiguous();
    b.assign(b32.data_ptr<float>(), b32.data_ptr<float>() + out_features);
  }
  b.resize(out_features, 0.0f);  // store_tile reads a tile's valid outputs only
  at::Tensor y = at::empty({M, out_features}, x.options());
  const uint8_t* wbase = qweight.data_ptr<uint8_t>();
  const uint16_t* mbase = reinterpret_cast<const uint16_t*>(meta.data_ptr());
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  uint16_t* yb = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t x_stride = x.stride(0), num_tiles = (groups + 1) / 2;
  if (amx_tiles() && out_features % kGroup == 0) {
    amx_span_linear(xb, x_stride, M, K, wbase, mbase, groups, nb, q4, b.data(), yb, out_features);
    return y;
  }
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> pairs(k2 * kTileOutputs);
    float acc[kTileRows * kTileOutputs];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g0 = 2 * t, n0 = g0 * kGroup;
      for (int h = 0; h < 2; ++h) {
        if (g0 + h >= groups) {  // an odd last group: zero weights in the tile's second half
          for (int64_t k = 0; k < k2; ++k) std::memset(pairs.data() + k * kTileOutputs + kGroup, 0, kGroup * 4);
          continue;
        }
        if (q4) dequantize_pairs<true>(wbase + (g0 + h) * group_bytes, mbase + (g0 + h) * nb * 2 * kGroup, nb,
                                       pairs.data() + h * kGroup, kTileOutputs);
        else dequantize_pairs<false>(wbase + (g0 + h) * group_bytes, mbase + (g0 + h) * nb * 2 * kGroup, nb,
                                     pairs.data() + h * kGroup, kTileOutputs);
      }
      const int n = static_cast<int>(std::min<int64_t>(kTileOutputs, out_features - n0));
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
        tiles[rows](xb + m0 * x_stride, x_stride, pairs.data(), k2, acc);
        store_tile(acc, rows, n, b.data() + n0, yb + m0 * out_features + n0, out_features);
      }
    }
  });
  return y;
}
#endif

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& meta,
                        const std::optional<at::Tensor>& bias, int64_t out_features) {
  const int64_t K = x.size(1);
  const int64_t tile = std::max<int64_t>(kGroup, kDenseTileElements / K / kGroup * kGroup);
  std::optional<at::Tensor> b;
  if (bias.has_value() && bias->numel() > 0) b = bias->to(x.scalar_type());
  at::Tensor y;
  for (int64_t n0 = 0; n0 < out_features; n0 += tile) {
    const int64_t rows = std::min(tile, out_features - n0);
    at::Tensor w = at::empty({rows, K}, x.options());
    dequantize_into(qweight, meta, n0, w);
    std::optional<at::Tensor> bt;
    if (b.has_value()) bt = b->narrow(0, n0, rows);
    at::Tensor part = dense_model_linear(x, w, bt);
    if (rows == out_features) return part;
    if (!y.defined()) y = at::empty({x.size(0), out_features}, x.options());
    y.narrow(1, n0, rows).copy_(part);
  }
  return y;
}

void check_packed(const at::Tensor& qweight, const at::Tensor& meta, int64_t K, int64_t out_features) {
  TORCH_CHECK(qweight.dim() == 5 && qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                  qweight.size(3) == kGroup && qweight.size(4) == 4 && (qweight.size(2) == 4 || qweight.size(2) == 8),
              "quant_linear: qweight is [groups, K/32, 4 or 8, 16, 4] uint8");
  const int64_t groups = qweight.size(0), nb = qweight.size(1);
  TORCH_CHECK(K == nb * kBlock && out_features <= groups * kGroup && out_features > (groups - 1) * kGroup,
              "quant_linear: weight packed for another shape");
  TORCH_CHECK(meta.is_contiguous() && meta.element_size() == 2 && meta.numel() == groups * nb * 2 * kGroup,
              "quant_linear: meta is [groups, K/32, 2, 16] 16-bit");
}

}  // namespace

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& meta,
                        const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "quant_linear: x is [rows, K] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_linear: float32 or bfloat16 activations");
  check_packed(qweight, meta, x.size(1), out_features);
  TORCH_CHECK(!bias.has_value() || bias->numel() == 0 || bias->numel() == out_features,
              "quant_linear: bias of out_features");
#if defined(__AVX512F__)
  if (x.size(0) > kTiledMinRows && x.scalar_type() == at::kBFloat16 && cpu_has_avx512_bf16())
    return bf16_tiled_linear(x.contiguous(), qweight, meta, bias, out_features);
#endif
  if (x.size(0) > kDenseMinRows) return dense_linear(x.contiguous(), qweight, meta, bias, out_features);
  return int16_linear(x, qweight, meta, bias, out_features, qweight.size(2) == 4);
}

// The dense weight in dtype (float32 or bfloat16), as the large-M path computes it.
at::Tensor quant_dequantize(const at::Tensor& qweight, const at::Tensor& meta, int64_t out_features,
                            at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_dequantize: float32 or bfloat16");
  const int64_t K = qweight.size(1) * kBlock;
  check_packed(qweight, meta, K, out_features);
  at::Tensor w = at::empty({out_features, K}, qweight.options().dtype(dtype));
  dequantize_into(qweight, meta, 0, w);
  return w;
}

// The small-M kernel's instructions, and whether bf16 batches above kTiledMinRows take the tiled path (its blocks
// on AMX-BF16: amx_bf16_tiles).
std::string quant_linear_path() {
  std::string path = cpu_has_vnni() ? "avx512_vnni" : "avx2";
#if defined(__AVX512F__)
  if (cpu_has_avx512_bf16()) path += amx_tiles() ? "+amx_bf16_tiles" : "+bf16_tiles";
#endif
  return path;
}

// The tiles' path: amx_bf16 (where the CPU runs it: what auto takes there), bf16_tiles (vdpbf16ps alone) or auto;
// returns the previous one (quant_linear_path's name for it).
std::string quant_linear_select_path(const std::string& path) {
  const std::string previous = quant_linear_path();
  TORCH_CHECK(path == "auto" || path == "bf16_tiles" || path == "amx_bf16",
              "quant_linear_select_path: unknown path '", path, "' (auto, bf16_tiles, amx_bf16)");
#if defined(__AVX512F__)
  TORCH_CHECK(path != "amx_bf16" || (cpu_has_avx512_bf16() && amx_available(AmxUnit::kBf16)),
              "quant_linear_select_path: this CPU does not run amx_bf16");
  TORCH_CHECK(path != "bf16_tiles" || cpu_has_avx512_bf16(), "quant_linear_select_path: this CPU has no AVX512-BF16");
  vdpbf16ps_forced.store(path == "bf16_tiles", std::memory_order_relaxed);
#else
  TORCH_CHECK(path == "auto", "quant_linear_select_path: this build does not run ", path);
#endif
  return previous;
}

}  // namespace TM_NAMESPACE
