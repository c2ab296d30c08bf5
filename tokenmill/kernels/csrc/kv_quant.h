// One-byte KV-cache elements (--kv-cache-dtype fp8_e4m3 | fp8_e5m2 | int8): the encode that rope_and_cache
// uses to write them, and the decode to float32 that paged_attention runs as it reads a block.
//
// Stored value = round(x / scale), read value = stored * scale, with one float32 scale per (layer, K or V,
// KV head, channel) handed in by the caller (tokenmill/models/kv_quant.py decides them). The encode is what torch's
// casts do (round to nearest even; fp8 subnormals kept), except that it saturates at the format's largest
// finite value instead of producing inf/NaN, so a later token larger than the calibration saw is clipped, not
// poisoned. The decode runs in registers on a block's bytes:
// - e5m2 is the top byte of an IEEE half: widen to 16 bits, shift left 8, and the F16C convert does the rest
//   (subnormals included).
// - e4m3 (bias 7) becomes a half with the same 4-bit exponent field under bias 15, that is the value times
//   2^-8: sign-extend to 16 bits, shift left 7 and clear bit 14 (the sign lands in bit 15, exponent and
//   mantissa in bits 13..7), convert, and multiply by 2^8 * scale (one multiply, folded into the scale).
//   Subnormals map to half subnormals with the same factor, so they need no special case.
// - int8: sign-extend to 32 bits, convert, multiply by the scale.
// NaN and inf codes are never written, so they are not decoded specially.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tm_kv {

enum class KVFormat { kNative, kE4M3, kE5M2, kInt8 };  // kNative: the model's dtype, no scale

constexpr float kE4M3Max = 448.0f, kE5M2Max = 57344.0f, kInt8Max = 127.0f;

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// float32 -> fp8 e4m3fn, round to nearest even, saturating at +-448. Branch-free, so loops vectorize.
inline uint8_t float_to_e4m3(float x) {
  const uint32_t sign = (bits_of(x) >> 24) & 0x80u;
  const float a = std::min(std::fabs(x), kE4M3Max);
  const uint32_t abits = bits_of(a);
  // Below 2^-6 (subnormal): 2^14 + a rounds a to a multiple of 2^-9 (the ulp of 2^14) in the FPU; the
  // difference of the bit patterns is that multiple, the subnormal's code (8 -> 0x08, the smallest normal).
  const uint32_t sub = bits_of(a + 16384.0f) - bits_of(16384.0f);
  // Normal: re-bias the exponent (127 -> 7) and round the 20 dropped mantissa bits to nearest even.
  const uint32_t norm = (abits - (120u << 23) + 0x7FFFFu + ((abits >> 20) & 1u)) >> 20;
  return static_cast<uint8_t>(sign | (a < 0.015625f ? sub : norm));
}

// float32 -> fp8 e5m2, round to nearest even, saturating at +-57344.
inline uint8_t float_to_e5m2(float x) {
  const uint32_t sign = (bits_of(x) >> 24) & 0x80u;
  const float a = std::min(std::fabs(x), kE5M2Max);
  const uint32_t abits = bits_of(a);
  const uint32_t sub = bits_of(a + 128.0f) - bits_of(128.0f);  // below 2^-14: multiples of 2^-16
  const uint32_t norm = (abits - (112u << 23) + 0xFFFFFu + ((abits >> 21) & 1u)) >> 21;
  return static_cast<uint8_t>(sign | (a < 6.103515625e-05f ? sub : norm));
}

inline uint8_t float_to_int8(float x) {  // round half to even (the FPU's mode), clamp to +-127
  return static_cast<uint8_t>(static_cast<int8_t>(std::clamp(std::nearbyint(x), -kInt8Max, kInt8Max)));
}

// dst[i * stride] = encode(src[i] * inv_scale) for i < n.
inline void encode_row(uint8_t* dst, int64_t stride, const float* src, int n, KVFormat fmt, float inv_scale) {
  switch (fmt) {
    case KVFormat::kE4M3:
#pragma omp simd
      for (int i = 0; i < n; ++i) dst[i * stride] = float_to_e4m3(src[i] * inv_scale);
      break;
    case KVFormat::kE5M2:
#pragma omp simd
      for (int i = 0; i < n; ++i) dst[i * stride] = float_to_e5m2(src[i] * inv_scale);
      break;
    case KVFormat::kInt8:
#pragma omp simd
      for (int i = 0; i < n; ++i) dst[i * stride] = float_to_int8(src[i] * inv_scale);
      break;
    case KVFormat::kNative:
      break;
  }
}

inline float half_bits_to_float(uint16_t h) { return _cvtsh_ss(h); }

// dst[i] = decode(src[i]) * scale for i < n: whole vectors in registers, then a scalar tail.
inline void decode_row(float* __restrict dst, const uint8_t* __restrict src, int n, KVFormat fmt, float scale) {
  int i = 0;
  if (fmt == KVFormat::kE5M2) {
#if defined(__AVX512F__)
    const __m512 s = _mm512_set1_ps(scale);
    for (; i + 16 <= n; i += 16) {
      const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))), 8);
      _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtph_ps(h), s));
    }
#else
    const __m256 s = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i))), 8);
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(h), s));
    }
#endif
    for (; i < n; ++i) dst[i] = half_bits_to_float(static_cast<uint16_t>(src[i] << 8)) * scale;
  } else if (fmt == KVFormat::kE4M3) {
    const float s2 = scale * 256.0f;
#if defined(__AVX512F__)
    const __m512 s = _mm512_set1_ps(s2);
    const __m256i keep = _mm256_set1_epi16(static_cast<int16_t>(0xBF80));
    for (; i + 16 <= n; i += 16) {
      const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), keep);
      _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtph_ps(h), s));
    }
#else
    const __m256 s = _mm256_set1_ps(s2);
    const __m128i keep = _mm_set1_epi16(static_cast<int16_t>(0xBF80));
    for (; i + 8 <= n; i += 8) {
      const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
      const __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), keep);
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(h), s));
    }
#endif
    for (; i < n; ++i) {
      const uint16_t h = static_cast<uint16_t>(((src[i] & 0x80u) << 8) | ((src[i] & 0x7Fu) << 7));
      dst[i] = half_bits_to_float(h) * s2;
    }
  } else if (fmt == KVFormat::kInt8) {
#if defined(__AVX512F__)
    const __m512 s = _mm512_set1_ps(scale);
    for (; i + 16 <= n; i += 16) {
      const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtepi32_ps(w), s));
    }
#else
    const __m256 s = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) {
      const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(w), s));
    }
#endif
    for (; i < n; ++i) dst[i] = static_cast<float>(static_cast<int8_t>(src[i])) * scale;
  }
}

}  // namespace tm_kv
