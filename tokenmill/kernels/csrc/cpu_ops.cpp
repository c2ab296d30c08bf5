// tokenmill's CPU kernels: paged attention over decode rows and prefill chunks in one call, RoPE fused with the
// KV-cache write, RMSNorm (plain and fused with the residual add), SiLU-and-mul, and greedy argmax.
//
// One source, compiled once per ISA (-mavx512f..., or -mavx2 -mfma) by tokenmill/kernels/build.py; the loader
// picks the build that matches the CPU's flags. The loops are written so that GCC vectorizes them for the ISA
// at hand: contiguous fp32 inner loops, bf16 converted by integer shifts. Storage is float32 or bfloat16 (the KV
// cache may also be one byte per element: kv_quant.h); arithmetic is float32 throughout.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/library.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kv_quant.h"
#include "lora.h"
#include "quant_linear.h"

namespace {

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

template <typename T>
inline typename Elem<T>::raw* raw_ptr(const at::Tensor& t) {
  return reinterpret_cast<typename Elem<T>::raw*>(t.data_ptr());
}

#define TM_DISPATCH(dtype, NAME, ...)                                              \
  [&] {                                                                             \
    if ((dtype) == at::kFloat) { using scalar_t = float; return __VA_ARGS__(); }    \
    if ((dtype) == at::kBFloat16) { using scalar_t = at::BFloat16; return __VA_ARGS__(); } \
    TORCH_CHECK(false, NAME ": float32 or bfloat16 only, got ", dtype);             \
  }()

// ---------------------------------------------------------------------------------------------------------
// Paged attention, varlen: sequence s owns query rows [query_start_loc[s], query_start_loc[s+1]) and, after
// this step, seq_lens[s] tokens of KV in the blocks block_tables[s, :]. Its last query row is the newest token,
// so query row i of a chunk of q_len rows sits at position seq_lens[s] - q_len + i and attends to keys 0..pos
// (causal). Decode rows (q_len 1) and prefill chunks with cached context are the same case. With a sliding
// window W > 0 (Gemma's local layers), the row at pos sees only keys pos - W + 1..pos: blocks wholly before a
// tile's window are never read, so a local layer's cost stays bounded by W however long the context grows.
//
// KV layout (this backend's own): k_cache [blocks, kv_heads, head_dim, block_size] (K transposed within a
// block), v_cache [blocks, kv_heads, block_size, head_dim]. A block of one head is contiguous, and the scores
// of a query row against a whole block are one chain of vector FMAs over head_dim with no horizontal sums.
//
// Work item: (sequence, KV head, tile of query tokens). The query heads that share the KV head (GQA) are
// processed together, so each KV block is read once per item. The online softmax works a block at a time. A
// decode with a long context in a small batch is split along the context (flash-decoding) so that every
// thread has work, and the parts are merged at the end.
//
// With a one-byte cache (kv_quant.h) the caller also passes this step's own K and V as computed: the keys at
// positions seq_lens[s] - q_len.. (a prefill chunk's, a decode's own token) are read from them, unquantized, and
// only earlier steps' keys from the cache.
// ---------------------------------------------------------------------------------------------------------
struct WorkItem {
  int seq, kv_head, q_begin, q_end;  // query tokens [q_begin, q_end) of the sequence, relative to its start
  int kv_begin, kv_end;              // the keys this item covers (a split covers part of the context)
  int partial;                       // -1: writes the output; else the index of its partial-result slot
};

constexpr int kQueryTile = 16;     // query tokens per item (times the GQA group = rows)
constexpr int kSplitTokens = 256;  // context per part when a decode is split
constexpr int kRowBlock = 4;       // query rows whose scores are computed together (kept in registers)
constexpr int kDimChunk = 32;      // head_dim must be a multiple of this (two AVX-512 vectors)

struct AttnShape {
  int num_heads, num_kv_heads, head_dim;
  float scale;
  int window;  // sliding window in tokens; 0: every earlier key is visible
  tm_kv::KVFormat kv_format;  // how the caches store an element (kv_quant.h)
  const float* kv_scales;     // one-byte formats: [2][kv_heads][head_dim] (K, then V), else null
  // This step's own K/V ([tokens][kv_heads][head_dim] rows, as the model's dtype holds them), or null: with a
  // one-byte cache, the keys this step computed are read from here instead of their quantized copies.
  const void* new_k;
  const void* new_v;
  int64_t new_k_stride, new_v_stride;  // elements between tokens
};

// A run of n cache elements from element `offset`, as float32 (one-byte formats: times `scale`).
template <typename T>
inline void load_kv(float* dst, const void* cache, int64_t offset, int n, tm_kv::KVFormat fmt, float scale) {
  if (fmt == tm_kv::KVFormat::kNative)
    load_row<T>(dst, static_cast<const typename Elem<T>::raw*>(cache) + offset, n);
  else
    tm_kv::decode_row(dst, static_cast<const uint8_t*>(cache) + offset, n, fmt, scale);
}

// Scores of kRowBlock query rows against a block at a time: p[r][j] = q_r . k_j, with K transposed ([D][B]).
// The accumulators stay in registers: two independent chains per row (two key vectors, or even and odd dims).
template <int B>
inline void block_scores(const float* qf, const float* kt, float* p, int R4, int D) {
  constexpr int NKV = B / VL;
  constexpr int NJ = NKV >= 2 ? 2 : 1;  // key vectors per pass
  constexpr int ND = 2 / NJ;            // interleaved partial sums over head_dim
  for (int r0 = 0; r0 < R4; r0 += kRowBlock) {
    for (int jv = 0; jv < NKV; jv += NJ) {
      vfloat acc[kRowBlock][NJ][ND];
      for (int i = 0; i < kRowBlock; ++i)
        for (int j = 0; j < NJ; ++j)
          for (int e = 0; e < ND; ++e) acc[i][j][e] = vzero();
      for (int d = 0; d < D; d += ND) {
        for (int e = 0; e < ND; ++e) {
          vfloat kv[NJ];
          for (int j = 0; j < NJ; ++j) kv[j] = vload(kt + (d + e) * B + (jv + j) * VL);
          for (int i = 0; i < kRowBlock; ++i) {
            const vfloat q = vset1(qf[(r0 + i) * D + d + e]);
            for (int j = 0; j < NJ; ++j) acc[i][j][e] = vfma(q, kv[j], acc[i][j][e]);
          }
        }
      }
      for (int i = 0; i < kRowBlock; ++i) {
        for (int j = 0; j < NJ; ++j) {
          vfloat total = acc[i][j][0];
          for (int e = 1; e < ND; ++e) total = vadd(total, acc[i][j][e]);
          vstore(p + (r0 + i) * B + (jv + j) * VL, total);
        }
      }
    }
  }
}

// acc[r] = acc[r] * corr[r] + sum_j p[r][j] v_j over keys [lo, n), kRowBlock rows and two vectors of head_dim
// at a time, in registers: each V row is loaded once per row block.
inline void block_values(const float* p, const float* vf, float* acc, const float* corr, int R4, int D, int B,
                         int lo, int n) {
  for (int r0 = 0; r0 < R4; r0 += kRowBlock) {
    for (int d0 = 0; d0 < D; d0 += 2 * VL) {
      vfloat a[kRowBlock][2];
      for (int i = 0; i < kRowBlock; ++i) {
        const vfloat c = vset1(corr[r0 + i]);
        a[i][0] = vmul(vload(acc + (r0 + i) * D + d0), c);
        a[i][1] = vmul(vload(acc + (r0 + i) * D + d0 + VL), c);
      }
      for (int j = lo; j < n; ++j) {
        const vfloat v0 = vload(vf + j * D + d0), v1 = vload(vf + j * D + d0 + VL);
        for (int i = 0; i < kRowBlock; ++i) {
          const vfloat pj = vset1(p[(r0 + i) * B + j]);
          a[i][0] = vfma(pj, v0, a[i][0]);
          a[i][1] = vfma(pj, v1, a[i][1]);
        }
      }
      for (int i = 0; i < kRowBlock; ++i) {
        vstore(acc + (r0 + i) * D + d0, a[i][0]);
        vstore(acc + (r0 + i) * D + d0 + VL, a[i][1]);
      }
    }
  }
}

template <typename T, int B>
void attention_item(const WorkItem& w, const typename Elem<T>::raw* q, typename Elem<T>::raw* out,
                    const void* k_cache, const void* v_cache, const float* fresh, const int32_t* block_table,
                    int ctx_len, int q_len, const AttnShape& shape, float* partial_out, std::vector<float>& scratch) {
  const int D = shape.head_dim, Hkv = shape.num_kv_heads, G = shape.num_heads / Hkv;
  const int tokens = w.q_end - w.q_begin, R = tokens * G;
  const int R4 = (R + kRowBlock - 1) / kRowBlock * kRowBlock;
  scratch.resize(static_cast<size_t>(R4) * D * 2 + static_cast<size_t>(R4) * (B + 5) + 2 * B * D);
  float* qf = scratch.data();  // [R4][D], scaled, rows past R zero
  float* acc = qf + R4 * D;    // [R4][D]
  float* p = acc + R4 * D;     // [R4][B] scores, then probabilities
  float* m = p + R4 * B;       // running max per row
  float* l = m + R4;           // running sum per row
  float* corr = l + R4;        // this block's rescaling of each row's accumulator
  int* last = reinterpret_cast<int*>(corr + R4);  // the last key position each row may see
  int* first = last + R4;                         // the first (the sliding window's start; else 0)
  float* kt = reinterpret_cast<float*>(first + R4);  // [D][B]
  float* vf = kt + B * D;      // [B][D]
  const int64_t q_row_stride = static_cast<int64_t>(shape.num_heads) * D;
  const int first_pos = ctx_len - q_len;
  std::fill(qf, qf + R4 * D, 0.0f);
  std::fill(acc, acc + R4 * D, 0.0f);
  // One-byte caches are read as their raw codes: K's per-channel scales are folded into q (q . (k * s) =
  // (q * s) . k), V's are applied to the output (sum_j p_j v_j * s = (sum_j p_j v_j) * s), so the inner loops
  // stay what they are for float caches.
  const float* k_scales = shape.kv_scales ? shape.kv_scales + w.kv_head * D : nullptr;
  const float* v_scales = shape.kv_scales ? shape.kv_scales + (Hkv + w.kv_head) * D : nullptr;
  for (int t = 0; t < tokens; ++t) {
    for (int g = 0; g < G; ++g) {
      const int r = t * G + g;
      const auto* src = q + (w.q_begin + t) * q_row_stride + (w.kv_head * G + g) * D;
      load_row<T>(qf + r * D, src, D);
#pragma omp simd
      for (int d = 0; d < D; ++d) qf[r * D + d] *= shape.scale * (k_scales ? k_scales[d] : 1.0f);
      m[r] = -1e30f;
      l[r] = 0.0f;
      last[r] = first_pos + w.q_begin + t;
      first[r] = shape.window > 0 ? std::max(0, last[r] - shape.window + 1) : 0;
    }
  }
  const int64_t block_elems = static_cast<int64_t>(B) * D;
  const int kv_end = std::min(w.kv_end, first_pos + w.q_end);  // no row sees past the tile's last token
  for (int start = w.kv_begin - w.kv_begin % B; start < kv_end; start += B) {
    const int lo = std::max(start, w.kv_begin) - start;  // first key of the block this item covers
    const int n = std::min(B, kv_end - start);
    const int64_t base = (static_cast<int64_t>(block_table[start / B]) * Hkv + w.kv_head) * block_elems;
    // Keys [lo, cached) come from the cache; [cached, n) are this step's own, from the fresh blocks when given
    // (fresh_blocks: the same layouts, in code units). A block of this step's keys only is read where it lies.
    const int cached = fresh ? std::clamp(first_pos - start, lo, n) : n;
    const float* fk = fresh ? fresh + (start / B - first_pos / B) * Hkv * 2 * block_elems + w.kv_head * 2 * block_elems
                            : nullptr;  // this block's fresh K, then V
    const float* kb = kt;
    const float* vb = vf;
    if (fresh && cached == lo) {
      kb = fk;
      vb = fk + block_elems;
    } else {
      load_kv<T>(kt, k_cache, base, B * D, shape.kv_format, 1.0f);
      load_kv<T>(vf + lo * D, v_cache, base + lo * D, (cached - lo) * D, shape.kv_format, 1.0f);
      if (cached < n) {
        const size_t fresh_bytes = (n - cached) * sizeof(float);
        for (int d = 0; d < D; ++d) std::memcpy(kt + d * B + cached, fk + d * B + cached, fresh_bytes);
        std::memcpy(vf + cached * D, fk + block_elems + cached * D, fresh_bytes * D);
      }
    }
    block_scores<B>(qf, kb, p, R4, D);
    for (int r = 0; r < R4; ++r) {
      float* pr = p + r * B;
      const int hi = r < R ? std::min(n, last[r] - start + 1) : lo;  // keys [lo_r, hi) are visible to row r
      const int lo_r = r < R ? std::max(lo, first[r] - start) : lo;
      if (hi <= lo_r) {  // nothing visible (a later query's keys, keys before its window, or a padding row)
        std::fill(pr, pr + B, 0.0f);
        corr[r] = 1.0f;
        continue;
      }
      for (int j = 0; j < lo_r; ++j) pr[j] = -1e30f;
      for (int j = hi; j < B; ++j) pr[j] = -1e30f;
      vfloat mx = vload(pr);
      for (int jv = 1; jv < B / VL; ++jv) mx = vmax(mx, vload(pr + jv * VL));
      const float bm = std::max(m[r], vreduce_max(mx));
      vfloat sum = vzero();
      for (int jv = 0; jv < B / VL; ++jv) {
        const vfloat e = vexp_masked(vsub(vload(pr + jv * VL), vset1(bm)));
        vstore(pr + jv * VL, e);
        sum = vadd(sum, e);
      }
      corr[r] = exp_approx(m[r] - bm);
      m[r] = bm;
      l[r] = l[r] * corr[r] + vreduce_add(sum);
    }
    block_values(p, vb, acc, corr, R4, D, B, lo, n);
  }
  for (int t = 0; t < tokens; ++t) {
    for (int g = 0; g < G; ++g) {
      const int r = t * G + g;
      if (w.partial >= 0) {  // [G][D + 2]: unnormalized acc, max, sum
        float* part = partial_out + (static_cast<int64_t>(w.partial) * R + r) * (D + 2);
        std::memcpy(part, acc + r * D, D * sizeof(float));
        part[D] = m[r];
        part[D + 1] = l[r];
        continue;
      }
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[r * D + d] *= inv * (v_scales ? v_scales[d] : 1.0f);
      store_row<T>(out + (w.q_begin + t) * q_row_stride + (w.kv_head * G + g) * D, acc + r * D, D);
    }
  }
}

// This step's own keys and values (shape.new_k, new_v), laid out as attention_item reads a block: per sequence,
// the blocks that hold its new tokens, per block and KV head K [D][B] then V [B][D], float32 in the cache's
// code units (divided by the scales that the codes' path folds into q and the output; 1 for a cache of the
// model's dtype). Positions that are not this step's are left as they are: attention_item reads them from the
// cache, or masks them. Built once per call, so that the query tiles that read a block share its
// transposition; kept per thread, so that steps reuse the pages.
template <typename T, int B>
const float* fresh_blocks(const AttnShape& shape, const int32_t* lens, const int32_t* qsl, int num_seqs,
                          std::vector<int64_t>& first_block) {
  const int D = shape.head_dim, Hkv = shape.num_kv_heads;
  const int64_t block_elems = static_cast<int64_t>(B) * D;
  first_block.assign(num_seqs + 1, 0);
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = qsl[s + 1] - qsl[s], first_pos = lens[s] - q_len;
    first_block[s + 1] = first_block[s] + (q_len > 0 ? (lens[s] - 1) / B - first_pos / B + 1 : 0);
  }
  static thread_local std::vector<float> buffer;
  const int64_t entries = first_block[num_seqs] * Hkv;  // (block, KV head) pairs
  if (static_cast<int64_t>(buffer.size()) < entries * 2 * block_elems) buffer.resize(entries * 2 * block_elems);
  float* out = buffer.data();
  const auto* new_k = static_cast<const typename Elem<T>::raw*>(shape.new_k);
  const auto* new_v = static_cast<const typename Elem<T>::raw*>(shape.new_v);
  std::vector<float> inv(2 * Hkv * D, 1.0f);  // [K, V][kv_heads][head_dim]: 1 / scale, once per call
  if (shape.kv_scales)
    for (size_t i = 0; i < inv.size(); ++i) inv[i] = 1.0f / shape.kv_scales[i];
  at::parallel_for(0, entries, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(D);
    for (int64_t e = begin; e < end; ++e) {
      const int64_t block = e / Hkv;
      const int h = static_cast<int>(e % Hkv);
      const int s = static_cast<int>(std::upper_bound(first_block.begin(), first_block.end(), block) -
                                     first_block.begin()) - 1;
      const int first_pos = lens[s] - (qsl[s + 1] - qsl[s]);
      const int start = (first_pos / B + static_cast<int>(block - first_block[s])) * B;  // its first position
      const float* inv_k = inv.data() + h * D;
      const float* inv_v = inv.data() + (Hkv + h) * D;
      float* kb = out + e * 2 * block_elems;  // [D][B]
      float* vb = kb + block_elems;           // [B][D]
      for (int j = std::max(0, first_pos - start); j < std::min(B, lens[s] - start); ++j) {
        const int64_t token = qsl[s] + start + j - first_pos;
        load_row<T>(row.data(), new_k + token * shape.new_k_stride + h * D, D);
        for (int d = 0; d < D; ++d) kb[d * B + j] = row[d] * inv_k[d];
        load_row<T>(vb + j * D, new_v + token * shape.new_v_stride + h * D, D);
#pragma omp simd
        for (int d = 0; d < D; ++d) vb[j * D + d] *= inv_v[d];
      }
    }
  });
  return out;
}

template <typename T, int B>
void paged_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, const AttnShape& shape) {
  const int num_seqs = seq_lens.size(0), window = shape.window;
  const int G = shape.num_heads / shape.num_kv_heads, D = shape.head_dim;
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int threads = at::get_num_threads();

  int64_t base_items = 0;
  for (int s = 0; s < num_seqs; ++s)
    base_items += static_cast<int64_t>((qsl[s + 1] - qsl[s] + kQueryTile - 1) / kQueryTile) * shape.num_kv_heads;
  std::vector<WorkItem> items;
  std::vector<std::array<int, 4>> merges;  // (first partial slot, parts, seq, kv_head)
  int num_partials = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = qsl[s + 1] - qsl[s], ctx = lens[s];
    if (q_len == 0) continue;
    // The first key a query tile starting at row b can see: its first row's window start.
    auto first_key = [&](int b) { return window > 0 ? std::max(0, ctx - q_len + b - window + 1) : 0; };
    const int decode_keys = ctx - first_key(0);
    int parts = 1;
    if (q_len == 1 && base_items < 4 * threads && decode_keys >= 2 * kSplitTokens)
      parts = std::min<int>(decode_keys / kSplitTokens, 4 * threads);
    for (int h = 0; h < shape.num_kv_heads; ++h) {
      if (parts > 1) {
        const int begin = first_key(0), per = (decode_keys + parts - 1) / parts;
        merges.push_back({num_partials, parts, s, h});
        for (int i = 0; i < parts; ++i)
          items.push_back({s, h, 0, 1, begin + i * per, std::min(ctx, begin + (i + 1) * per), num_partials++});
        continue;
      }
      for (int b = 0; b < q_len; b += kQueryTile)
        items.push_back({s, h, b, std::min(q_len, b + kQueryTile), first_key(b), ctx, -1});
    }
  }
  // Longest items first, handed out dynamically: a long prefill tile must not be the last one started.
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) {
    return static_cast<int64_t>(a.q_end - a.q_begin) * (a.kv_end - a.kv_begin) >
           static_cast<int64_t>(b.q_end - b.q_begin) * (b.kv_end - b.kv_begin);
  });
  std::vector<float> partials(static_cast<size_t>(num_partials) * G * (D + 2));
  const auto* q = raw_ptr<T>(query);
  auto* o = raw_ptr<T>(out);
  const void* kc = k_cache.data_ptr();
  const void* vc = v_cache.data_ptr();
  const int64_t block_elems = static_cast<int64_t>(B) * D;
  std::vector<int64_t> fresh_at;  // per sequence: its first fresh block in `fresh`
  const float* fresh = shape.new_k ? fresh_blocks<T, B>(shape, lens, qsl, num_seqs, fresh_at) : nullptr;
  const int n_items = static_cast<int>(items.size());
  const int64_t row = static_cast<int64_t>(shape.num_heads) * D;
#pragma omp parallel num_threads(threads) if (threads > 1 && n_items > 1)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n_items; ++i) {
      const WorkItem& w = items[i];
      attention_item<T, B>(w, q + qsl[w.seq] * row, o + qsl[w.seq] * row, kc, vc,
                           fresh ? fresh + fresh_at[w.seq] * shape.num_kv_heads * 2 * block_elems : nullptr,
                           tables + w.seq * table_stride, lens[w.seq], qsl[w.seq + 1] - qsl[w.seq], shape,
                           partials.data(), scratch);
    }
  }
  // Merge the parts of each split (sequence, head): rescale each part to the common max.
  std::vector<float> acc(D);
  for (const auto& [first, parts, s, h] : merges) {
    for (int g = 0; g < G; ++g) {
      float mx = -1e30f;
      for (int i = 0; i < parts; ++i) mx = std::max(mx, partials[((first + i) * G + g) * (D + 2) + D]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      float total = 0.0f;
      for (int i = 0; i < parts; ++i) {
        const float* part = partials.data() + ((first + i) * G + g) * (D + 2);
        const float weight = std::exp(part[D] - mx);
        total += part[D + 1] * weight;
        for (int d = 0; d < D; ++d) acc[d] += part[d] * weight;
      }
      const float inv = total > 0.0f ? 1.0f / total : 0.0f;
      const float* v_scales = shape.kv_scales ? shape.kv_scales + (shape.num_kv_heads + h) * D : nullptr;
      for (int d = 0; d < D; ++d) acc[d] *= inv * (v_scales ? v_scales[d] : 1.0f);
      store_row<T>(o + qsl[s] * row + (h * G + g) * D, acc.data(), D);
    }
  }
}

void check_attention_args(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous() && out.is_contiguous() && out.sizes() == query.sizes(),
              "query and out: contiguous [tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches: contiguous 4-d tensors");
  const int64_t n = k_cache.size(0), h = k_cache.size(1), d = k_cache.size(2), b = k_cache.size(3);
  TORCH_CHECK(v_cache.size(0) == n && v_cache.size(1) == h && v_cache.size(2) == b && v_cache.size(3) == d,
              "k_cache [blocks, kv_heads, head_dim, block_size], v_cache [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "query and out share a dtype, and so do the caches");
  TORCH_CHECK(d == query.size(2) && query.size(1) % h == 0, "head shapes differ");
  TORCH_CHECK(d % kDimChunk == 0, "head_dim must be a multiple of ", kDimChunk);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt, "block_tables, seq_lens, query_start_loc: int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 && seq_lens.is_contiguous() &&
                  query_start_loc.is_contiguous(), "index tensors must be contiguous");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) >= seq_lens.size(0),
              "one seq_lens entry and one block-table row per sequence, query_start_loc has one more");
}

// The caches' element format: the model's dtype, or a one-byte format (kv_quant.h) named by the cache's dtype.
tm_kv::KVFormat kv_format(const at::Tensor& cache, at::ScalarType model_dtype) {
  const at::ScalarType t = cache.scalar_type();
  if (t == model_dtype) return tm_kv::KVFormat::kNative;
  if (t == at::kFloat8_e4m3fn) return tm_kv::KVFormat::kE4M3;
  if (t == at::kFloat8_e5m2) return tm_kv::KVFormat::kE5M2;
  if (t == at::kChar) return tm_kv::KVFormat::kInt8;
  TORCH_CHECK(false, "KV cache of ", t, " for a ", model_dtype, " model: the model's dtype, float8_e4m3fn, "
              "float8_e5m2 or int8");
}

// One-byte formats need their scales: float32 [2, kv_heads, head_dim] (K, then V; one per channel); the model's
// dtype needs none.
const float* kv_scales_ptr(const std::optional<at::Tensor>& kv_scales, tm_kv::KVFormat fmt, int64_t kv_heads,
                           int64_t head_dim) {
  if (fmt == tm_kv::KVFormat::kNative) return nullptr;
  TORCH_CHECK(kv_scales.has_value() && kv_scales->scalar_type() == at::kFloat && kv_scales->is_contiguous() &&
                  kv_scales->numel() == 2 * kv_heads * head_dim,
              "a one-byte KV cache needs kv_scales: float32 [2, kv_heads, head_dim]");
  return kv_scales->data_ptr<float>();
}

// This step's own K or V: [tokens, kv_heads, head_dim] in the query's dtype, heads and dims contiguous (rows may be
// strided: V is a view of the qkv projection).
void check_new_kv(const std::optional<at::Tensor>& x, const at::Tensor& query, const at::Tensor& k_cache,
                  const char* name) {
  if (!x.has_value()) return;
  TORCH_CHECK(x->dim() == 3 && x->size(0) == query.size(0) && x->size(1) == k_cache.size(1) &&
                  x->size(2) == query.size(2) && x->stride(2) == 1 && x->stride(1) == x->size(2) &&
                  x->scalar_type() == query.scalar_type(),
              "paged_attention: ", name, " is this step's [tokens, kv_heads, head_dim] in the query's dtype");
}

// key, value: this step's own K (after RoPE) and V, or none. Given, the attention reads the keys this step
// computed from them rather than from the cache (with a one-byte cache: unquantized, as the prompt path of vLLM's
// V0 attention backends attends a prompt's own keys; earlier steps' keys are read as stored). Both or neither.
void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, int64_t window = 0,
                     const std::optional<at::Tensor>& kv_scales = std::nullopt,
                     const std::optional<at::Tensor>& key = std::nullopt,
                     const std::optional<at::Tensor>& value = std::nullopt) {
  TORCH_CHECK(window >= 0, "paged_attention: window must be >= 0 (0: none), got ", window);
  check_attention_args(out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc);
  TORCH_CHECK(key.has_value() == value.has_value(), "paged_attention: key and value, or neither");
  check_new_kv(key, query, k_cache, "key");
  check_new_kv(value, query, k_cache, "value");
  const int64_t block_size = k_cache.size(3);
  const tm_kv::KVFormat fmt = kv_format(k_cache, query.scalar_type());
  const AttnShape shape{static_cast<int>(query.size(1)), static_cast<int>(k_cache.size(1)),
                        static_cast<int>(query.size(2)), static_cast<float>(scale), static_cast<int>(window), fmt,
                        kv_scales_ptr(kv_scales, fmt, k_cache.size(1), k_cache.size(2)),
                        key ? key->data_ptr() : nullptr, value ? value->data_ptr() : nullptr,
                        key ? key->stride(0) : 0, value ? value->stride(0) : 0};
  TM_DISPATCH(query.scalar_type(), "paged_attention", [&] {
    switch (block_size) {
      case 16: return paged_attention_impl<scalar_t, 16>(out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, shape);
      case 32: return paged_attention_impl<scalar_t, 32>(out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, shape);
      case 64: return paged_attention_impl<scalar_t, 64>(out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, shape);
      case 128: return paged_attention_impl<scalar_t, 128>(out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, shape);
      default: TORCH_CHECK(false, "paged_attention: block size must be 16, 32, 64 or 128, got ", block_size);
    }
  });
}

// ---------------------------------------------------------------------------------------------------------
// RoPE (rotate-half layout) applied to q and k straight from the fused qkv projection, with the optional
// per-head RMSNorm of q and k (Qwen3) before it; writes q to q_out and k, v into their KV-cache slots, in the
// layout paged_attention reads, and k to k_out too when given (paged_attention's `key`: this step's keys as the
// model's dtype holds them, before a one-byte cache quantizes them).
// cos and sin: float32 [max_positions, head_dim] (both halves repeated). A slot < 0 is not written.
// ---------------------------------------------------------------------------------------------------------
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

void rope_and_cache(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping, at::Tensor q_out,
                    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double eps,
                    const std::optional<at::Tensor>& kv_scales = std::nullopt,
                    const std::optional<at::Tensor>& k_out = std::nullopt) {
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

// ---------------------------------------------------------------------------------------------------------
// RMSNorm as the reference computes it: float32 statistics, the normalized value rounded to the storage type,
// then scaled by the weight. The fused form first adds x into the residual stream (rounded, as a bf16 add is)
// and normalizes that: residual <- x + residual; x <- rms_norm(residual).
// ---------------------------------------------------------------------------------------------------------
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

// ---------------------------------------------------------------------------------------------------------
// Linear layers for a few rows (decode batches): y = x W^T (+ b), reading each weight byte once per call.
// oneDNN reaches ~20 GB/s on these shapes; the weight stream is the whole cost, so the layout is made for it:
// W is packed as [N / VL][K][VL] (float32) or, for bf16 with AVX512-BF16, [N / 16][K / 2][16 x (2 bf16)], so
// one vector load feeds VL (or 16) outputs and every row of x reuses it from a register; no horizontal sums.
// pack_small_m packs; small_m_linear multiplies. Rows are processed 8 at a time (8 accumulators in registers).
// ---------------------------------------------------------------------------------------------------------
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
        const int32_t pair = reinterpret_cast<const int32_t*>(x + m * x_stride)[k];
        acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_set1_epi32(pair));
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

// The lanes of one packed block: VL floats, or 16 bf16 outputs on the AVX512-BF16 path.
int64_t small_m_lanes(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 16 : VL; }

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

// ---------------------------------------------------------------------------------------------------------
// The Llama-family decoder stack in one call: on a 135M model a decode step is ~300 small ops, and calling
// them one by one from Python cost 15% of the step. Same kernels, same order as LlamaForCausalLM.forward (the
// Python loop stays the reference); the linear layers are oneDNN's, on the prepacked weights. Each kernel call
// is a profiler range under its op's name, so `tokenmill bench step` still sees where the time goes.
// layer_weights: per layer [input_norm, qkv_w, qkv_b, q_norm, k_norm, o_w, o_b, post_norm, gate_up_w, down_w,
// then the small-M layouts of qkv_w, o_w, gate_up_w, down_w]; an empty tensor stands for a bias or norm the
// model does not have, or a small-M layout this CPU has no kernel for. Batches of up to small_m_max_rows tokens
// use the small-M kernel. A linear kept quantized passes (qweight uint8, meta) in its two slots instead and
// always runs quant_linear (quant_linear.cpp). kv_scales: per layer, the KV cache's float32
// [2, kv_heads, head_dim] scales (read only when the cache is one-byte: --kv-cache-dtype; then the attention
// also reads this step's own K and V as computed).
// ---------------------------------------------------------------------------------------------------------
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
  if (small_m.numel() > 0 && x.size(0) <= small_m_max_rows) {
    RECORD_FUNCTION("tokenmill::small_m_linear", std::vector<c10::IValue>());
    return small_m_linear(x, small_m, present(bias), out_features);
  }
  return onednn_linear(x, packed, bias);
}

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

}  // namespace

TORCH_LIBRARY(TM_NAMESPACE, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, float scale, int window=0, Tensor? kv_scales=None, "
        "Tensor? key=None, Tensor? value=None) -> ()");
  m.def("rope_and_cache(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, Tensor(c!) q_out, Tensor? q_norm, Tensor? k_norm, float eps, "
        "Tensor? kv_scales=None, Tensor(d!)? k_out=None) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("argmax(Tensor logits) -> Tensor");
  m.def("small_m_supported(ScalarType dtype) -> bool", [](at::ScalarType dtype) { return small_m_supported(dtype); });
  m.def("pack_small_m(Tensor weight) -> Tensor");
  m.def("small_m_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("llama_forward(Tensor embeddings, Tensor[] layer_weights, Tensor final_norm, Tensor[] k_caches, "
        "Tensor[] v_caches, Tensor positions, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, int num_heads, int head_dim, int intermediate, float eps, "
        "float scale, int small_m_max_rows, Tensor[] kv_scales, Tensor[] lora_weights, Tensor[] lora_ranks, "
        "Tensor? lora_segments) -> Tensor");
}

TORCH_LIBRARY_IMPL(TM_NAMESPACE, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("rope_and_cache", &rope_and_cache);
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax", &argmax);
  m.impl("pack_small_m", &pack_small_m);
  m.impl("small_m_linear", &small_m_linear);
  m.impl("llama_forward", &llama_forward);
}

// llama_forward also receives oneDNN's prepacked weights, whose dispatch key is MkldnnCPU.
TORCH_LIBRARY_IMPL(TM_NAMESPACE, MkldnnCPU, m) {
  m.impl("llama_forward", &llama_forward);
}
