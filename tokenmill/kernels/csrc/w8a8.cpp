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
// Three instruction paths, the best the CPU runs chosen at run time like quant_linear.cpp's:
// - AVX512-VNNI: vpdpbusd multiplies unsigned by signed bytes, so each activation is stored as xq + 128 (u8 in
//   1..255) and the 128 sum_{k in b} wq that this adds is subtracted per output and block (SGLang's sgl-kernel
//   CPU int8 GEMM and oneDNN's u8s8 GEMM compensate the same way; the sums are computed once at load, in meta:
//   the accumulators start from minus it). A block's sum is at most 64 * 255 * 127 < 2^24, exact in float32.
// - AVX2 (the AVX2 build, or an AVX-512 CPU without VNNI): vpmaddubsw multiplies u8 by s8 and adds pairs with
//   int16 saturation, which u8 activations up to 255 against weights down to -128 would reach (2 * 255 * 128).
//   Instead, as llama.cpp does, it multiplies |xq| (u8, <= 127) by sign(xq) wq (vpsignb, s8: |wq| <= 127 because
//   -128 is never produced): a pair sums to at most 2 * 127 * 127 = 32258 < 32767, so it cannot saturate (the
//   tests run it at that bound); vpmaddwd by ones then widens pairs into int32. Each |xq| serves a group's two
//   halves of 8 outputs. Five vector ops per 32 multiply-adds, against one 8-wide FMA per 8 in float32: on an
//   AVX2-only Zen 3 the register block alone does 1.2-1.3x the multiply-adds per second of a float32 FMA block,
//   and a 512-row linear runs at 0.9-1.0x oneDNN's float32 GEMM (benchmarks/results/w8a8.md): this path's gain
//   is decode batches (a byte per weight), not prefill.
// - AMX-INT8 (Sapphire Rapids and later, in the AVX-512 build): tdpbssd multiplies signed by signed bytes, so the
//   activations stay int8 and need no compensation. A tile holds 16 rows x 64 bytes: the A tile is 16 tokens x one
//   64-K block, and the B tile is exactly one group's block in the layout below (16 rows of 16 outputs x 4 K,
//   64 bytes apart), so the packed weight is read in place. One tdpbssd gives a 16 x 16 block of int32 sums; it
//   goes through memory (tilestored) into 16 float accumulators, scaled by each token's block scale (the scale per
//   64 K is what keeps this from accumulating all of K in the tile, as a bf16 AMX GEMM does). Four blocks per
//   round in four sum tiles keep four tdpbssd in flight while the previous round is scaled. amx.h says how the
//   tiles are set up.
// w8a8_select_path() picks another path this CPU runs (the tests check each; benchmarks compare them).
//
// Layout: qweight [N/16][K/4][16][4] int8 (N padded to 16 outputs, K to a multiple of 64 with zero weights): one
// 64-byte vector holds 16 outputs x 4 consecutive K, the 32-bit lane vpdpbusd takes. meta float32
// [N/16][1 + K/64][16]: per group of 16 outputs sw, then per K block 128 sum_{k in b} wq (exact integers).
// Register blocking: 6 rows x 32 outputs on AVX-512 (12 int32 and 12 float accumulators), 2 rows x 16 outputs on AVX2
// (4 int32 and 4 float accumulators), 16 rows x 16 outputs on AMX (a tile; 16 float accumulators); the weight tile
// stays in L1/L2 while every row block of the chunk streams past it. On AMX a work item spans 8 groups, rows outer, so
// that each output row is written 512 bytes at a time: one 64-byte piece per row, 12 KB apart, ran 2-4x slower.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx.h"
#include "ops.h"
#include "vec.h"

namespace TM_NAMESPACE {
namespace {

constexpr int kGroup = 16;          // outputs per packed group: one 64-byte vector of 16 x 4 K
constexpr int kBlock = 64;          // K per activation scale
constexpr int kSteps = kBlock / 4;  // 4-K steps per block
constexpr int kRowsVnni = 6;        // rows per register block on AVX-512 (6 x 2 int32 + 6 x 2 float)
constexpr int kGroupsVnni = 2;      // groups per register block on AVX-512: 32 outputs
constexpr int kRowsAvx2 = 2;        // AVX2: 2 rows x 16 outputs (4 int32 + 4 float accumulators)
constexpr int kRowsAmx = 16;        // AMX: a tile's 16 rows x one group of 16 outputs (16 float accumulators)
constexpr int kRowsMax = kRowsAmx;  // the buffers' rows; activations are padded to a multiple of it
constexpr int64_t kRowChunk = 240;  // rows per parallel work item at most: a chunk of activations stays in L2

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

bool use_amx() {
#if defined(__AVX512F__)
  return use_vnni() && amx_available(AmxUnit::kInt8);
#else
  return false;
#endif
}

// ---- activations: per row and 64-K block, xq = round(x * 127 / amax), plus 128 for the VNNI path (as u8) ----

#if defined(__AVX512F__)
// One row's 64-K block on AVX-512: four vectors, the block's amax, then round(x * 127 / amax) as the scalar loop
// below does (vcvtps2dq rounds half to even under the default MXCSR, as nearbyint and torch.round do).
template <typename In>
inline float quantize_block_avx512(const In* src, int64_t n, int offset, uint8_t* dst) {
  __m512 v[4];
  __m512 amax = _mm512_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, n - 16 * i));
    const __mmask16 m = static_cast<__mmask16>((1u << left) - 1);
    if constexpr (std::is_same_v<In, float>) {
      v[i] = _mm512_maskz_loadu_ps(m, src + 16 * i);
    } else {
      const __m256i h = _mm256_maskz_loadu_epi16(m, src + 16 * i);
      v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
  }
  const float a = _mm512_reduce_max_ps(amax);
  const __m512 inv = _mm512_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), off = _mm512_set1_epi32(offset);
  for (int i = 0; i < 4; ++i) {
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv));
    q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), off);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * i), _mm512_cvtepi32_epi8(q));
  }
  return a / 127.0f;
}
#else
// One row's 64-K block on AVX2: eight vectors, the block's amax, then round(x * 127 / amax) as the scalar loop of
// the reference (vcvtps2dq rounds half to even, as nearbyint and torch.round do); K's tail goes through a zeroed
// copy (its weights are zero).
template <typename In>
inline float quantize_block_avx2(const In* src, int64_t n, int offset, uint8_t* dst) {
  alignas(32) float tail[kBlock];
  const float* f = nullptr;
  if (n < kBlock || !std::is_same_v<In, float>) {
    for (int64_t k = 0; k < kBlock; ++k) {
      if constexpr (std::is_same_v<In, float>) tail[k] = k < n ? src[k] : 0.0f;
      else tail[k] = k < n ? bf16_to_float(src[k]) : 0.0f;
    }
    f = tail;
  } else {
    f = reinterpret_cast<const float*>(src);
  }
  __m256 v[8];
  __m256 amax = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int i = 0; i < 8; ++i) {
    v[i] = _mm256_loadu_ps(f + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  const float a = _mm_cvtss_f32(m);
  const __m256 inv = _mm256_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127), off = _mm256_set1_epi32(offset);
  for (int i = 0; i < 8; ++i) {
    __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    q = _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(q, lo), hi), off);
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    const __m128i b8 = offset ? _mm_packus_epi16(w16, w16) : _mm_packs_epi16(w16, w16);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + 8 * i), b8);
  }
  return a / 127.0f;
}
#endif

template <typename In>
void quantize_rows(const In* x, int64_t stride, int64_t M, int64_t K, int64_t kp, bool shift, uint8_t* q,
                   float* scale) {
  const int64_t nb = kp / kBlock;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t k0 = b * kBlock, n = std::min<int64_t>(kBlock, K - k0);
        const In* src = x + r * stride + k0;
        const int offset = shift ? 128 : 0;
        uint8_t* dst = q + r * kp + k0;
#if defined(__AVX512F__)
        scale[r * nb + b] = quantize_block_avx512(src, n, offset, dst);
#else
        scale[r * nb + b] = quantize_block_avx2(src, n, offset, dst);
#endif
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
  __m256 facc[R][2];
  for (int r = 0; r < R; ++r) facc[r][0] = facc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const uint8_t* xb0 = x + b * kBlock;
    const int8_t* wb = w + b * kSteps * 64;
    for (int k = 0; k < kSteps; ++k) {
      // the group's two halves of 8 outputs x 4 K, |xq| shared by both: |xq| * sign(xq) wq, pairs of at most
      // 2 * 128 * 127, no int16 saturation (see the top of the file)
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + k * 64));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + k * 64 + 32));
      for (int r = 0; r < R; ++r) {
        const __m256i xb = _mm256_set1_epi32(load32(xb0 + r * kp + 4 * k)), ax = _mm256_abs_epi8(xb);
        const __m256i p0 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xb));
        const __m256i p1 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xb));
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(p0, ones));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(p1, ones));
      }
    }
    if constexpr (Raw) {
      int32_t* o = static_cast<int32_t*>(out);
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + (r * nb + b) * kGroup + h * 8), acc[r][h]);
    } else {
      for (int r = 0; r < R; ++r) {
        const __m256 s = _mm256_set1_ps(xs[r * nb + b]);
        for (int h = 0; h < 2; ++h) facc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), s, facc[r][h]);
      }
    }
  }
  if constexpr (!Raw) {
    float* o = static_cast<float*>(out);
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(o + r * kGroup + h * 8, facc[r][h]);
  }
}

#if defined(__AVX512F__)
// 16 rows (the activations are padded to them) x one group, all K. Raw: out int32 [16][K/64][16]; else out
// float32 [16][16] = sum_b sx[r][b] (block b's sums). Four blocks per round, each in its own sum tile (4-7),
// so that four tdpbssd are in flight while the previous round's sums are scaled.
#define TM_AMX_BLOCK(C, A, B, BLK)                  \
  _tile_zero(C);                                     \
  _tile_loadd(A, x + (BLK) * kBlock, kp);            \
  _tile_loadd(B, w + (BLK) * kSteps * 64, 64);       \
  _tile_dpbssd(C, A, B)
#define TM_AMX_SCALE(J, BLK)                                                                            \
  for (int r = 0; r < kRowsAmx; ++r)                                                                    \
    facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[J][r])), _mm512_set1_ps(xs[r * nb + (BLK)]), \
                              facc[r])

template <int R, int G, bool Raw>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw"))) void block_amx(const uint8_t* x, int64_t kp,
                                                                           const float* xs, const int8_t* w,
                                                                           int64_t /*group_stride*/,
                                                                           const float* /*meta*/,
                                                                           int64_t /*meta_stride*/, void* out) {
  static_assert(G == 1);
  const int64_t nb = kp / kBlock;
  alignas(64) int32_t c[4][kRowsAmx][kGroup];
  __m512 facc[kRowsAmx];
  for (int r = 0; r < kRowsAmx; ++r) facc[r] = _mm512_setzero_ps();
  int32_t* raw = static_cast<int32_t*>(out);
  const int64_t raw_stride = nb * kGroup * 4;  // bytes between rows of the raw output
  int64_t b = 0;
  for (; b + 3 < nb; b += 4) {
    TM_AMX_BLOCK(4, 0, 2, b);
    TM_AMX_BLOCK(5, 1, 3, b + 1);
    TM_AMX_BLOCK(6, 0, 2, b + 2);
    TM_AMX_BLOCK(7, 1, 3, b + 3);
    if constexpr (Raw) {
      _tile_stored(4, raw + b * kGroup, raw_stride);
      _tile_stored(5, raw + (b + 1) * kGroup, raw_stride);
      _tile_stored(6, raw + (b + 2) * kGroup, raw_stride);
      _tile_stored(7, raw + (b + 3) * kGroup, raw_stride);
    } else {
      _tile_stored(4, c[0], 64);
      _tile_stored(5, c[1], 64);
      _tile_stored(6, c[2], 64);
      _tile_stored(7, c[3], 64);
      TM_AMX_SCALE(0, b);
      TM_AMX_SCALE(1, b + 1);
      TM_AMX_SCALE(2, b + 2);
      TM_AMX_SCALE(3, b + 3);
    }
  }
  for (; b < nb; ++b) {
    TM_AMX_BLOCK(4, 0, 2, b);
    if constexpr (Raw) {
      _tile_stored(4, raw + b * kGroup, raw_stride);
    } else {
      _tile_stored(4, c[0], 64);
      TM_AMX_SCALE(0, b);
    }
  }
  if constexpr (!Raw) {
    float* o = static_cast<float*>(out);
    for (int r = 0; r < kRowsAmx; ++r) _mm512_storeu_ps(o + r * kGroup, facc[r]);
  }
}
#undef TM_AMX_BLOCK
#undef TM_AMX_SCALE
#endif

using BlockFn = void (*)(const uint8_t*, int64_t, const float*, const int8_t*, int64_t, const float*, int64_t, void*);

// A path's kernel: blocks by rows (1..rows) and, on AVX-512, by groups (1 or 2, for an odd last group);
// [0]: float output, [1]: raw per-block sums.
struct Kernel {
  std::array<std::array<std::array<BlockFn, kRowsMax + 1>, kGroupsVnni + 1>, 2> fn{};
  int rows = 0, groups = 0;
  bool shift = false;  // activations stored as xq + 128 (u8), compensated per output and block
  bool amx = false;    // tiles configured per work item
  int span = 1;        // register blocks side by side per work item (gemm)
  const char* name = "";
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

enum Path { kAvx2, kVnni, kAmx, kPaths };

bool runs(int path) { return path == kAvx2 || (path == kVnni && use_vnni()) || (path == kAmx && use_amx()); }

const Kernel& kernel_of(int path) {
  static const std::array<Kernel, kPaths> kernels = [] {
    std::array<Kernel, kPaths> ks;
    Kernel& a = ks[kAvx2];
    fill_avx2<false>(a, std::make_integer_sequence<int, kRowsAvx2>());
    fill_avx2<true>(a, std::make_integer_sequence<int, kRowsAvx2>());
    a.rows = kRowsAvx2;
    a.groups = 1;
    a.name = "avx2";
#if defined(__AVX512F__)
    Kernel& v = ks[kVnni];
    fill_vnni<false, 1>(v, std::make_integer_sequence<int, kRowsVnni>());
    fill_vnni<false, 2>(v, std::make_integer_sequence<int, kRowsVnni>());
    fill_vnni<true, 1>(v, std::make_integer_sequence<int, kRowsVnni>());
    fill_vnni<true, 2>(v, std::make_integer_sequence<int, kRowsVnni>());
    v.rows = kRowsVnni;
    v.groups = kGroupsVnni;
    v.shift = true;
    v.name = "avx512_vnni";
    Kernel& t = ks[kAmx];
    for (int r = 1; r <= kRowsAmx; ++r) {  // always 16 rows computed; the caller reads those it has
      t.fn[0][1][r] = &block_amx<kRowsAmx, 1, false>;
      t.fn[1][1][r] = &block_amx<kRowsAmx, 1, true>;
    }
    t.rows = kRowsAmx;
    t.groups = 1;
    t.amx = true;
    t.span = 8;
    t.name = "amx_int8";
#endif
    return ks;
  }();
  return kernels[path];
}

int best_path() { return use_amx() ? kAmx : use_vnni() ? kVnni : kAvx2; }

std::atomic<int> selected{-1};  // w8a8_select_path's choice; -1: the best this CPU runs

const Kernel& kernel() {
  const int p = selected.load(std::memory_order_relaxed);
  return kernel_of(p < 0 ? best_path() : p);
}

// Scratch per calling thread, grown to the largest call and kept, on a 64-byte boundary (a tile row that straddles
// two cache lines loads at about half the speed). Not a fresh buffer per call: a prefill's activations are
// hundreds of KB, and fresh pages cost their faults on every call (a 512-row gate_up ran 2.3x slower so, on AMX).
// Elements [from, n) are set to fill; the caller writes those before.
template <typename T>
T* scratch(int slot, int64_t n, int64_t from, T fill) {
  static thread_local std::array<std::vector<char>, 2> buffers;
  std::vector<char>& v = buffers[slot];
  const size_t bytes = n * sizeof(T) + 64;
  if (v.size() < bytes) v.resize(bytes);
  T* p = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(v.data()) + 63) / 64 * 64);
  std::fill(p + from, p + n, fill);
  return p;
}

int64_t padded_rows(int64_t M) { return (M + kRowsMax - 1) / kRowsMax * kRowsMax; }

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

// Every row against every output, handed block by block (xq and xs hold M rounded up to kRowsMax rows: the AMX
// path reads whole tiles) to emit(m0, rows, n0, width, out) (the block function's
// out: float [rows][width], or Raw: int32 [rows][K/64][width]).
template <bool Raw, typename Emit>
void gemm(const uint8_t* xq, const float* xs, int64_t M, int64_t kp, const at::Tensor& qweight,
          const at::Tensor& meta, const Emit& emit) {
  const Kernel& kn = kernel();
  const int64_t groups = qweight.size(0), group_stride = kp / 4 * 64, nb = kp / kBlock;
  const int64_t meta_stride = (1 + nb) * kGroup;
  const int8_t* w = qweight.data_ptr<int8_t>();
  const float* mp = meta.data_ptr<float>();
  // a work item: a chunk of rows x a span of register blocks' groups, rows outer (a row's outputs are written
  // span x 16 at a time; the span's weights stay in L1/L2 while the chunk's rows pass)
  const int64_t per_item = kn.groups * kn.span;
  const RowChunks chunks = even_row_chunks(M, kRowChunk, kn.rows);
  const int64_t tiles = (groups + per_item - 1) / per_item;
  at::parallel_for(0, chunks.count * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<char> buf(kRowsMax * kGroupsVnni * kGroup * 4 * (Raw ? nb : 1));
#if defined(__AVX512F__)
    if (kn.amx) amx_configure();
#endif
    for (int64_t i = begin; i < end; ++i) {
      const int64_t chunk = i / tiles, first = (i % tiles) * per_item;
      const int64_t last = std::min(groups, first + per_item);
      const int64_t m_end = std::min(M, (chunk + 1) * chunks.rows);
      for (int64_t m0 = chunk * chunks.rows; m0 < m_end; m0 += kn.rows) {
        const int rows = static_cast<int>(std::min<int64_t>(kn.rows, m_end - m0));
        for (int64_t g0 = first; g0 < last; g0 += kn.groups) {
          const int g = static_cast<int>(std::min<int64_t>(kn.groups, last - g0));
          kn.fn[Raw][g][rows](xq + m0 * kp, kp, xs + m0 * nb, w + g0 * group_stride, group_stride,
                              mp + g0 * meta_stride, meta_stride, buf.data());
          emit(m0, rows, g0 * kGroup, g * kGroup, buf.data());
        }
      }
    }
#if defined(__AVX512F__)
    if (kn.amx) amx_release();
#endif
  });
}

template <typename Out>
at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& meta,
                       const std::optional<at::Tensor>& bias, int64_t out_features) {
  using In = std::conditional_t<std::is_same_v<Out, float>, float, uint16_t>;
  const int64_t M = x.size(0), K = x.size(1), kp = qweight.size(1) * 4, nb = kp / kBlock;
  const int64_t padded = qweight.size(0) * kGroup;
  const int64_t rows = padded_rows(M);
  uint8_t* xq = scratch<uint8_t>(0, rows * kp, M * kp, 0);  // the rows past M: zeros, read by the AMX tiles
  float* xs = scratch<float>(1, rows * nb, M * nb, 0.0f);
  quantize_rows<In>(reinterpret_cast<const In*>(x.data_ptr()), x.stride(0), M, K, kp, kernel().shift, xq, xs);
  std::vector<float> b(padded, 0.0f), sw(padded);
  if (bias.has_value() && bias->numel() > 0) {
    at::Tensor b32 = bias->to(at::kFloat).contiguous();
    std::copy(b32.data_ptr<float>(), b32.data_ptr<float>() + out_features, b.begin());
  }
  const float* mp = meta.data_ptr<float>();
  for (int64_t n = 0; n < padded; ++n) sw[n] = mp[(n / kGroup) * (1 + nb) * kGroup + n % kGroup];
  at::Tensor y = at::empty({M, out_features}, x.options());
  Out* yp = reinterpret_cast<Out*>(y.data_ptr());
  gemm<false>(xq, xs, M, kp, qweight, meta, [&](int64_t m0, int rows, int64_t n0, int width,
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
  uint8_t* x = scratch<uint8_t>(0, padded_rows(M) * kp, 0, static_cast<uint8_t>(shift));
  const int8_t* src = xq.data_ptr<int8_t>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) x[m * kp + k] = static_cast<uint8_t>(src[m * xq.stride(0) + k] + shift);
  float* unused = scratch<float>(1, padded_rows(M) * nb, 0, 1.0f);
  at::Tensor out = at::empty({M, nb, padded}, xq.options().dtype(at::kInt));
  int32_t* op = out.data_ptr<int32_t>();
  gemm<true>(x, unused, M, kp, qweight, meta, [&](int64_t m0, int rows, int64_t n0, int width,
                                                               const void* buf) {
    const int32_t* sums = static_cast<const int32_t*>(buf);
    for (int r = 0; r < rows; ++r)
      for (int64_t b = 0; b < nb; ++b)
        std::memcpy(op + ((m0 + r) * nb + b) * padded + n0, sums + (r * nb + b) * width, width * 4);
  });
  return out;
}

std::string w8a8_linear_path() { return kernel().name; }

std::string w8a8_select_path(const std::string& path) {
  const std::string previous = w8a8_linear_path();
  int p = -1;
  for (int i = 0; i < kPaths; ++i)
    if (path == kernel_of(i).name && *kernel_of(i).name) p = i;
  TORCH_CHECK(path == "auto" || p >= 0, "w8a8_select_path: unknown path '", path,
              "' (auto, avx2, avx512_vnni, amx_int8)");
  TORCH_CHECK(p < 0 || runs(p), "w8a8_select_path: this CPU and build do not run ", path);
  selected.store(p, std::memory_order_relaxed);
  return previous;
}

}  // namespace TM_NAMESPACE
