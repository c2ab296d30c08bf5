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
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <iterator>
#include <string>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "kv_quant.h"
#include "ops.h"
#include "vec.h"

namespace TM_NAMESPACE {

namespace {

struct WorkItem {
  int seq, kv_head, q_begin, q_end;  // query tokens [q_begin, q_end) of the sequence, relative to its start
  int kv_begin, kv_end;              // the keys this item covers (a split covers part of the context)
  int partial;                       // -1: writes the output; else the index of its partial-result slot
};

constexpr int kQueryTile = 16;     // query tokens per item (times the GQA group = rows)
constexpr int kSplitTokens = 256;  // context per part when a decode is split
constexpr int kRowBlock = 4;       // query rows whose scores are computed together (kept in registers)
constexpr int kDimChunk = 32;      // head_dim must be a multiple of this (two AVX-512 vectors)
// bf16-pair prefill tiles (attention_item_pairs, AVX-512 build): the cache's block size they read, keys per softmax
// step, and query tokens per item
constexpr int kAmxAttnBlock = 16;
constexpr int kAmxKeys = 64;
constexpr int kAmxQueryTile = 32;
constexpr int kDotRows = 8;  // query rows per pass of the vdpbf16ps products (divides 16)

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

// Asks for a block's K and V (bytes from `offset` in each cache) ahead of their use. A decode reads each block
// once, and a sequence's blocks are scattered over the pool, so the hardware prefetcher, which follows runs of
// addresses, stops at every block's end: without this, a decode step of 64 sequences on a 2-core Sapphire
// Rapids read its KV at ~9 GB/s, a third of what the memory streams (benchmarks/attention.py). One block ahead
// measured as well as two or three there.
inline void prefetch_block(const void* k_cache, const void* v_cache, int64_t offset, int64_t bytes) {
  const char* k = static_cast<const char*>(k_cache) + offset;
  const char* v = static_cast<const char*>(v_cache) + offset;
  for (int64_t i = 0; i < bytes; i += 64) {
    __builtin_prefetch(k + i);
    __builtin_prefetch(v + i);
  }
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

// The online softmax over one block's scores p [rows][B] (keys start.. of the sequence; this item covers keys
// [lo, n) of the block): each row's keys past its position or before its window are masked, p becomes the block's
// unnormalized probabilities, and corr[r] rescales what row r accumulated before it (m: running max, l: sum).
template <int B>
inline void block_softmax(float* p, int R, int rows, int start, int lo, int n, const int* last, const int* first,
                          float* m, float* l, float* corr) {
  for (int r = 0; r < rows; ++r) {
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
  const int elem_bytes = shape.kv_format == tm_kv::KVFormat::kNative ? sizeof(typename Elem<T>::raw) : 1;
  for (int start = w.kv_begin - w.kv_begin % B; start < kv_end; start += B) {
    const int lo = std::max(start, w.kv_begin) - start;  // first key of the block this item covers
    const int n = std::min(B, kv_end - start);
    const int64_t base = (static_cast<int64_t>(block_table[start / B]) * Hkv + w.kv_head) * block_elems;
    if (start + B < kv_end)  // the next block, while this one is computed
      prefetch_block(k_cache, v_cache, (static_cast<int64_t>(block_table[start / B + 1]) * Hkv + w.kv_head) *
                                           block_elems * elem_bytes, block_elems * elem_bytes);
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
    block_softmax<B>(p, R, R4, start, lo, n, last, first, m, l, corr);
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

// The prefill tiles' products (below); the AVX2 build has only the float32 FMAs
enum class PrefillPath { kVector, kAmx, kDot };
constexpr const char* kPrefillPathNames[] = {"vector", "amx_bf16", "avx512_bf16"};  // by PrefillPath
std::atomic<int> attention_path{-1};  // -1: auto, else a PrefillPath forced (attention_select_path)

#if defined(__AVX512F__)
// Prefill tiles in bf16 pairs (a bf16 model with a bf16 cache, blocks of 16), on two kinds of CPU: a step's two
// products, S = Q K^T and P V, take bf16 pairs and sum in float32, instead of the float32 FMAs above, which cap
// that kernel at ~0.45 ms per 1,000 query-key pairs for SmolLM2's 30 layers on a 2-core Sapphire Rapids: most of a
// long prompt's prefill there, and what the step bound (engine/step_cost.py) spends a chunk's budget on.
// - kTiles (AMX-BF16): tile products (tdpbf16ps). Half the time or less on Sapphire Rapids.
// - else (AVX512-BF16 without AMX: Zen 4 and 5): vdpbf16ps, a pair of bf16 products per float32 lane, twice the
//   multiplies of a float32 FMA per instruction. On a 2-core Zen 4 the kernel takes half the time of the float32
//   FMA tiles or a little more; on Sapphire Rapids an earlier vdpbf16ps item was slower than them, and AMX runs
//   there (benchmarks/results/attention.md).
// The online softmax stays float32 (block_softmax) and works on kAmxKeys keys at a time (four cache blocks), so
// that its per-row work (reductions, rescaling the accumulator) is paid once per 64 keys rather than per 16; P
// enters its product rounded to bf16, as in flash attention on GPUs. K and V are interleaved by pairs (the tile's
// B layout, which is also what vdpbf16ps reads as its pairs) from the cache's own layout, once per block and item.
// Tiles, all 16 rows x 64 bytes: 0 Q (32 dims), 1 and 4 K (16 dim pairs x 16 keys x 2), 2 and 6 S (16 keys,
// float32), 3 P (32 keys, bf16), 4 and 6 V (16 key pairs x 16 dims x 2), 5 and 7 O (16 dims, float32); two sums in
// flight in each product.

bool amx_attention_runs() {
  static const bool runs = __builtin_cpu_supports("avx512bf16") && amx_available(AmxUnit::kBf16);
  return runs;
}

bool dot_attention_runs() {
  static const bool runs = __builtin_cpu_supports("avx512bf16");
  return runs;
}

// auto: AMX where it runs, else vdpbf16ps where it runs, else the float32 FMAs
PrefillPath prefill_path() {
  const int forced = attention_path.load(std::memory_order_relaxed);
  if (forced >= 0) return static_cast<PrefillPath>(forced);
  return amx_attention_runs() ? PrefillPath::kAmx : dot_attention_runs() ? PrefillPath::kDot : PrefillPath::kVector;
}

// a0 b0 a1 b1 ... a15 b15 from 16 bf16 in a and 16 in b.
__attribute__((target("avx512f,avx512bw"))) inline __m512i interleave_pairs(__m256i a, __m256i b) {
  alignas(64) static constexpr uint16_t order[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  return _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), _mm512_load_si512(order), _mm512_castsi256_si512(b));
}

__attribute__((target("avx512f"))) inline __m256i load16(const uint16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

__attribute__((target("avx512f,avx512bf16"))) inline __m512bh bf16_vec(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}

template <bool kTiles>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16"))) void attention_item_pairs(
    const WorkItem& w, const uint16_t* q, uint16_t* out, const uint16_t* k_cache, const uint16_t* v_cache,
    const int32_t* block_table, int ctx_len, int q_len, const AttnShape& shape, std::vector<float>& scratch) {
  constexpr int B = kAmxAttnBlock, KB = kAmxKeys, NB = KB / B;
  const int D = shape.head_dim, Hkv = shape.num_kv_heads, G = shape.num_heads / Hkv;
  const int tokens = w.q_end - w.q_begin, R = tokens * G, R16 = (R + 15) / 16 * 16;
  scratch.resize(static_cast<size_t>(R16) * (2 * D + KB + 5) + (static_cast<size_t>(R16) * (D + KB) + 2 * D * KB) / 2);
  float* acc = scratch.data();  // [R16][D]
  float* pv = acc + R16 * D;    // [R16][D]: these keys' P V
  float* p = pv + R16 * D;      // [R16][KB]: scores, then probabilities
  float* m = p + R16 * KB;
  float* l = m + R16;
  float* corr = l + R16;
  int* last = reinterpret_cast<int*>(corr + R16);
  int* first = last + R16;
  uint16_t* qb = reinterpret_cast<uint16_t*>(first + R16);  // [R16][D], rows past R zero
  uint16_t* pb = qb + R16 * D;                               // [R16][KB]
  uint16_t* kp = pb + R16 * KB;                              // [NB][D / 2][B][2]
  uint16_t* vp = kp + D * KB;                                // [KB / 32][D / 16][16][16][2]
  const int64_t q_row_stride = static_cast<int64_t>(shape.num_heads) * D;
  const int first_pos = ctx_len - q_len;
  std::fill(acc, acc + R16 * D, 0.0f);
  std::fill(qb + R * D, qb + R16 * D, 0);
  for (int r = 0; r < R16; ++r) {
    m[r] = -1e30f;
    l[r] = 0.0f;
    if (r >= R) continue;
    const int t = r / G, g = r % G;
    std::memcpy(qb + r * D, q + (w.q_begin + t) * q_row_stride + (w.kv_head * G + g) * D, D * sizeof(uint16_t));
    last[r] = first_pos + w.q_begin + t;
    first[r] = shape.window > 0 ? std::max(0, last[r] - shape.window + 1) : 0;
  }
  const __m512 scale = _mm512_set1_ps(shape.scale);
  const int64_t block_elems = static_cast<int64_t>(B) * D;
  const int kv_end = std::min(w.kv_end, first_pos + w.q_end);
  for (int start = w.kv_begin - w.kv_begin % B; start < kv_end; start += KB) {
    const int lo = std::max(start, w.kv_begin) - start;  // keys [lo, n) of these KB are this item's
    const int n = std::min(KB, kv_end - start);
    const int blocks = (n + B - 1) / B;  // past the context there is no block (nor a table entry) to read
    for (int b = 0; b < blocks; ++b) {  // keys outside [lo, n) may be anything: their scores are masked below
      const uint16_t* kb = k_cache + (static_cast<int64_t>(block_table[start / B + b]) * Hkv + w.kv_head) * block_elems;
      for (int d = 0; d < D; d += 2)
        _mm512_storeu_si512(kp + (b * D + d) * B, interleave_pairs(load16(kb + d * B), load16(kb + (d + 1) * B)));
    }
    for (int j = 0; j < KB; j += 2) {  // but their values are zeroed: a zero probability times a NaN is NaN
      const uint16_t* vb = j < n ? v_cache + (static_cast<int64_t>(block_table[(start + j) / B]) * Hkv + w.kv_head) *
                                                 block_elems + (j % B) * D : nullptr;
      const bool a_ok = j >= lo && j < n, b_ok = j + 1 >= lo && j + 1 < n;
      for (int d = 0; d < D; d += 16)
        _mm512_storeu_si512(vp + ((j / 32 * (D / 16) + d / 16) * 16 + j % 32 / 2) * 32,
                            interleave_pairs(a_ok ? load16(vb + d) : _mm256_setzero_si256(),
                                             b_ok ? load16(vb + D + d) : _mm256_setzero_si256()));
    }
    if constexpr (kTiles) {
      // two sum tiles in flight (2 and 6: two blocks' scores), so that no tile product waits for the one before
      for (int rt = 0; rt < R16; rt += 16) {
        for (int b = 0; b < blocks; b += 2) {
          const bool two = b + 1 < blocks;
          _tile_zero(2);
          if (two) _tile_zero(6);
          for (int d = 0; d < D; d += 32) {
            _tile_loadd(0, qb + rt * D + d, D * 2);
            _tile_loadd(1, kp + (b * D + d) * B, 64);
            _tile_dpbf16ps(2, 0, 1);
            if (two) {
              _tile_loadd(4, kp + ((b + 1) * D + d) * B, 64);
              _tile_dpbf16ps(6, 0, 4);
            }
          }
          _tile_stored(2, p + rt * KB + b * B, KB * 4);
          if (two) _tile_stored(6, p + rt * KB + (b + 1) * B, KB * 4);
        }
      }
    } else {
      // kDotRows rows of one block's 16 scores at a time, even and odd dim pairs in separate sums (2 * kDotRows
      // chains, past vdpbf16ps's latency), scaled as they are stored
      for (int rt = 0; rt < R; rt += kDotRows) {  // rows past R: block_softmax zeroes their p
        for (int b = 0; b < blocks; ++b) {
          __m512 s0[kDotRows], s1[kDotRows];
          for (int i = 0; i < kDotRows; ++i) s0[i] = s1[i] = _mm512_setzero_ps();
          const uint16_t* kb = kp + b * D * B;  // [D / 2][B][2]
          for (int d = 0; d < D; d += 4) {
            const __m512bh k0 = bf16_vec(kb + d * B), k1 = bf16_vec(kb + (d + 2) * B);
            for (int i = 0; i < kDotRows; ++i) {
              s0[i] = _mm512_dpbf16_ps(s0[i], bf16_pair(qb + (rt + i) * D + d), k0);
              s1[i] = _mm512_dpbf16_ps(s1[i], bf16_pair(qb + (rt + i) * D + d + 2), k1);
            }
          }
          for (int i = 0; i < kDotRows; ++i)
            _mm512_storeu_ps(p + (rt + i) * KB + b * B, _mm512_mul_ps(_mm512_add_ps(s0[i], s1[i]), scale));
        }
      }
    }
    if constexpr (kTiles)
      for (int r = 0; r < R16; ++r)
        for (int b = 0; b < blocks; ++b)
          _mm512_storeu_ps(p + r * KB + b * B, _mm512_mul_ps(_mm512_loadu_ps(p + r * KB + b * B), scale));
    block_softmax<KB>(p, R, R16, start, lo, n, last, first, m, l, corr);
    for (int r = 0; r < R16; ++r)
      for (int b = 0; b < NB; ++b)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + r * KB + b * B),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + r * KB + b * B)));
    if constexpr (kTiles) {
      const int chunks = (n + 31) / 32;
      for (int rt = 0; rt < R16; rt += 16) {  // two output tiles in flight (5 and 7: 32 dims), D a multiple of 32
        for (int d = 0; d < D; d += 32) {
          _tile_zero(5);
          _tile_zero(7);
          for (int c = 0; c < chunks; ++c) {
            _tile_loadd(3, pb + rt * KB + c * 32, KB * 2);
            _tile_loadd(4, vp + (c * (D / 16) + d / 16) * 16 * 32, 64);
            _tile_dpbf16ps(5, 3, 4);
            _tile_loadd(6, vp + (c * (D / 16) + d / 16 + 1) * 16 * 32, 64);
            _tile_dpbf16ps(7, 3, 6);
          }
          _tile_stored(5, pv + rt * D + d, D * 4);
          _tile_stored(7, pv + rt * D + d + 16, D * 4);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 c = _mm512_set1_ps(corr[r]);
        for (int d = 0; d < D; d += 16)
          _mm512_storeu_ps(acc + r * D + d, _mm512_fmadd_ps(_mm512_loadu_ps(acc + r * D + d), c,
                                                            _mm512_loadu_ps(pv + r * D + d)));
      }
    } else {
      // acc = acc * corr + P V, kDotRows rows and 32 dims at a time in registers, a key pair per step
      const int key_pairs = (n + 1) / 2;
      for (int rt = 0; rt < R; rt += kDotRows) {
        for (int d = 0; d < D; d += 32) {
          __m512 a0[kDotRows], a1[kDotRows];
          for (int i = 0; i < kDotRows; ++i) {
            const __m512 c = _mm512_set1_ps(corr[rt + i]);
            a0[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + (rt + i) * D + d), c);
            a1[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + (rt + i) * D + d + 16), c);
          }
          for (int jp = 0; jp < key_pairs; ++jp) {  // vp: [KB / 32][D / 16][16 key pairs][16 dims][2]
            const uint16_t* v = vp + ((jp / 16 * (D / 16) + d / 16) * 16 + jp % 16) * 32;
            const __m512bh v0 = bf16_vec(v), v1 = bf16_vec(v + 16 * 32);
            for (int i = 0; i < kDotRows; ++i) {
              const __m512bh pp = bf16_pair(pb + (rt + i) * KB + 2 * jp);
              a0[i] = _mm512_dpbf16_ps(a0[i], pp, v0);
              a1[i] = _mm512_dpbf16_ps(a1[i], pp, v1);
            }
          }
          for (int i = 0; i < kDotRows; ++i) {
            _mm512_storeu_ps(acc + (rt + i) * D + d, a0[i]);
            _mm512_storeu_ps(acc + (rt + i) * D + d + 16, a1[i]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int t = r / G, g = r % G;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int d = 0; d < D; ++d) acc[r * D + d] *= inv;
    store_row<at::BFloat16>(out + (w.q_begin + t) * q_row_stride + (w.kv_head * G + g) * D, acc + r * D, D);
  }
}
#endif

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

  // bf16 pairs (AMX tiles or vdpbf16ps) for the items with a tile of query rows (prefill chunks), where they run;
  // their items take more query tokens (kAmxQueryTile), which share each block's interleaving
  PrefillPath path = PrefillPath::kVector;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16> && B == kAmxAttnBlock)
    if (!shape.new_k && shape.kv_format == tm_kv::KVFormat::kNative && D % 32 == 0) path = prefill_path();
#endif
  const bool pairs = path != PrefillPath::kVector, amx = path == PrefillPath::kAmx;
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
      const int tile = pairs && q_len * G >= 16 ? kAmxQueryTile : kQueryTile;
      for (int b = 0; b < q_len; b += tile)
        items.push_back({s, h, b, std::min(q_len, b + tile), first_key(b), ctx, -1});
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
#if defined(__AVX512F__)
    if (amx) amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n_items; ++i) {
      const WorkItem& w = items[i];
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, at::BFloat16> && B == kAmxAttnBlock) {
        if (pairs && w.partial < 0 && (w.q_end - w.q_begin) * G >= 16) {
          (amx ? attention_item_pairs<true> : attention_item_pairs<false>)(
              w, q + qsl[w.seq] * row, o + qsl[w.seq] * row, static_cast<const uint16_t*>(kc),
              static_cast<const uint16_t*>(vc), tables + w.seq * table_stride, lens[w.seq],
              qsl[w.seq + 1] - qsl[w.seq], shape, scratch);
          continue;
        }
      }
#endif
      attention_item<T, B>(w, q + qsl[w.seq] * row, o + qsl[w.seq] * row, kc, vc,
                           fresh ? fresh + fresh_at[w.seq] * shape.num_kv_heads * 2 * block_elems : nullptr,
                           tables + w.seq * table_stride, lens[w.seq], qsl[w.seq + 1] - qsl[w.seq], shape,
                           partials.data(), scratch);
    }
#if defined(__AVX512F__)
    if (amx) amx_release();
#endif
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

}  // namespace

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

// key, value: this step's own K (after RoPE) and V, or none. Given, the attention reads the keys this step
// computed from them rather than from the cache (with a one-byte cache: unquantized, as the prompt path of vLLM's
// V0 attention backends attends a prompt's own keys; earlier steps' keys are read as stored). Both or neither.
void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, int64_t window,
                     const std::optional<at::Tensor>& kv_scales,
                     const std::optional<at::Tensor>& key,
                     const std::optional<at::Tensor>& value) {
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

std::string attention_prefill_path() {
#if defined(__AVX512F__)
  return kPrefillPathNames[static_cast<int>(prefill_path())];
#else
  return kPrefillPathNames[static_cast<int>(PrefillPath::kVector)];
#endif
}

// Forces the prefill tiles' path (for tests and benchmarks), or "auto"; returns the path in use before.
std::string attention_select_path(const std::string& path) {
  const std::string previous = attention_prefill_path();
  const auto* names = std::begin(kPrefillPathNames);
  const auto* named = std::find(names, std::end(kPrefillPathNames), path);
  TORCH_CHECK(path == "auto" || named != std::end(kPrefillPathNames), "attention_select_path: unknown path '",
              path, "' (auto, vector, amx_bf16, avx512_bf16)");
  const auto forced = static_cast<PrefillPath>(named - names);
#if defined(__AVX512F__)
  TORCH_CHECK(path == "auto" || forced != PrefillPath::kAmx || amx_attention_runs(),
              "attention_select_path: this CPU does not run amx_bf16");
  TORCH_CHECK(path == "auto" || forced != PrefillPath::kDot || dot_attention_runs(),
              "attention_select_path: this CPU does not run avx512_bf16");
  attention_path.store(path == "auto" ? -1 : static_cast<int>(forced), std::memory_order_relaxed);
#else
  TORCH_CHECK(path == "auto" || forced == PrefillPath::kVector, "attention_select_path: this build does not run ",
              path);
#endif
  return previous;
}

}  // namespace TM_NAMESPACE
