// The element types and the vector of the build's width that every kernel source shares (as vLLM's
// csrc/cpu/cpu_types.hpp and SGLang's sgl-kernel/csrc/cpu/vec.h).
//
// Every source is compiled once per ISA (-mavx512f..., or -mavx2 -mfma) by tokenmill/kernels/build.py; the loader
// picks the build that matches the CPU's flags. The loops are written so that GCC vectorizes them for the ISA
// at hand: contiguous fp32 inner loops, bf16 converted by integer shifts. Storage is float32 or bfloat16 (the KV
// cache may also be one byte per element: kv_quant.h); arithmetic is float32 throughout. The hot loops that GCC
// does not vectorize well enough use vfloat below: 16 lanes under AVX-512, 8 under AVX2, one set of names.
// Everything here is inside TM_NAMESPACE, so the two builds' inline functions never meet in one process.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace TM_NAMESPACE {

// ---- bf16 <-> fp32 by bits, so that the loops vectorize ----
inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does (NaN is not expected here)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

template <typename T> struct Elem;
template <> struct Elem<float> {
  using raw = float;
  static inline float load(raw x) { return x; }
  static inline raw store(float x) { return x; }
};
template <> struct Elem<at::BFloat16> {
  using raw = uint16_t;
  static inline float load(raw x) { return bf16_to_float(x); }
  static inline raw store(float x) { return float_to_bf16(x); }
};

template <typename T>
inline void load_row(float* __restrict dst, const typename Elem<T>::raw* __restrict src, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = Elem<T>::load(src[i]);
}
template <typename T>
inline void store_row(typename Elem<T>::raw* __restrict dst, const float* __restrict src, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = Elem<T>::store(src[i]);
}
// Round through the storage type: keeps the float32 value a bf16 op would have produced.
template <typename T>
inline float round_to(float x) { return Elem<T>::load(Elem<T>::store(x)); }

// exp for the softmax, vectorizable (Cephes' single-precision polynomial, ~1 ulp); x <= 0 here.
inline float exp_approx(float x) {
  x = std::max(x, -87.0f);
  float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  x = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  int32_t e = (static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return y * scale;
}

// ---- a float vector of the build's width: 16 lanes (AVX-512) or 8 (AVX2), for the attention inner loops ----
#if defined(__AVX512F__)
using vfloat = __m512;
constexpr int VL = 16;
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline vfloat vmin(vfloat a, vfloat b) { return _mm512_min_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
inline vfloat vfloor(vfloat a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline vfloat vpow2i(vfloat n) {  // 2^n for integral n in the normal range
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline float vreduce_max(vfloat a) { return _mm512_reduce_max_ps(a); }
inline float vreduce_add(vfloat a) { return _mm512_reduce_add_ps(a); }
#else
using vfloat = __m256;
constexpr int VL = 8;
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
inline vfloat vset1(float x) { return _mm256_set1_ps(x); }
inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline vfloat vmin(vfloat a, vfloat b) { return _mm256_min_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
inline vfloat vfloor(vfloat a) { return _mm256_floor_ps(a); }
inline vfloat vpow2i(vfloat n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline float vreduce_max(vfloat a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline float vreduce_add(vfloat a) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
#endif

// exp_approx on a vector, for x <= 88 (same polynomial).
inline vfloat vexp(vfloat x) {
  x = vmax(x, vset1(-87.0f));
  const vfloat fx = vfloor(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
  x = vfma(fx, vset1(2.12194440e-4f), vfma(fx, vset1(-0.693359375f), x));
  vfloat y = vset1(1.9875691500e-4f);
  y = vfma(y, x, vset1(1.3981999507e-3f));
  y = vfma(y, x, vset1(8.3334519073e-3f));
  y = vfma(y, x, vset1(4.1665795894e-2f));
  y = vfma(y, x, vset1(1.6666665459e-1f));
  y = vfma(y, x, vset1(5.0000001201e-1f));
  y = vadd(vfma(vmul(y, x), x, x), vset1(1.0f));
  return vmul(y, vpow2i(fx));
}
// vexp, and exactly 0 where x <= -87 (masked keys carry -1e30)
inline vfloat vexp_masked(vfloat x) {
#if defined(__AVX512F__)
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset1(-87.0f), _CMP_GT_OQ), vexp(x));
#else
  return _mm256_and_ps(vexp(x), _mm256_cmp_ps(x, vset1(-87.0f), _CMP_GT_OQ));
#endif
}

#if defined(__AVX512F__)
// Two consecutive bf16 at p (a pair: one of x's K pairs, or of P's key pairs) in every float32 lane, as vdpbf16ps
// reads the operand it pairs with a vector of packed pairs.
__attribute__((target("avx512f,avx512bf16"))) inline __m512bh bf16_pair(const uint16_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return (__m512bh)_mm512_set1_epi32(bits);
}
#endif

template <typename T>
inline typename Elem<T>::raw* raw_ptr(const at::Tensor& t) {
  return reinterpret_cast<typename Elem<T>::raw*>(t.data_ptr());
}

// How a GEMM whose parallel items are (chunk of rows) x (span of outputs) cuts its M rows: into ceil(M / target)
// chunks of one size, a multiple of `multiple` (the register block's rows); no chunk for no rows. at::parallel_for
// hands each thread an equal count of items, so they must weigh the same: chunks of `target` rows and one short
// tail gave one of two threads 70% of a 512-row W8A8 linear (240 + 240 + 32 rows; 1.43x its one-thread speed).
struct RowChunks {
  int64_t rows, count;  // rows per chunk (the last may have fewer), chunks
};
inline RowChunks even_row_chunks(int64_t M, int64_t target, int64_t multiple) {
  const int64_t count = (M + target - 1) / target;
  if (count == 0) return {multiple, 0};
  const int64_t rows = ((M + count - 1) / count + multiple - 1) / multiple * multiple;
  return {rows, (M + rows - 1) / rows};
}

#define TM_DISPATCH(dtype, NAME, ...)                                              \
  [&] {                                                                             \
    if ((dtype) == at::kFloat) { using scalar_t = float; return __VA_ARGS__(); }    \
    if ((dtype) == at::kBFloat16) { using scalar_t = at::BFloat16; return __VA_ARGS__(); } \
    TORCH_CHECK(false, NAME ": float32 or bfloat16 only, got ", dtype);             \
  }()

}  // namespace TM_NAMESPACE
