// The batched LoRA delta: each token's own adapter, in one call per linear layer (tokenmill/lora/).
//
// Layouts (tokenmill/lora/layers.py): a [shards, slots, in, R] holds A^T of every slot and shard (q/k/v of a fused
// qkv_proj, gate/up of gate_up_proj), padded with zero columns to the slots' width R; b_t [slots, R, out] holds
// B^T, shard j's in its own output columns; ranks [slots, shards] int32 is each slot's rank on each shard (0: the
// adapter leaves it alone); segments [K, 3] int64 lists (first row, rows, slot) of each request with an adapter.
//
// Punica's two kernels in one: the rows of a segment (a prefill chunk: many rows of one adapter; SGMV) are taken
// four at a time, so that each row of A^T and B^T is loaded once for four rows of x; a decode row (one token per
// request, each with its own adapter; BGMV) is a block of one. Blocks run in parallel. The shrink (xa = x A^T)
// runs along A^T's rows with the rank (rounded up to 8, 16, 32 or 64) as the vector, its sums in registers; the
// expand (out += xa B^T) along B^T's rows, 8 vectors of sums at a time. Only an adapter's own shards are computed,
// its expand only to its rank. Nothing calls a GEMM library. Measured (2-core Zen 5, one thread, bf16, rank 16 on
// every shard, 4 slots; us): 8 decode rows of 8 requests qkv 15.7, o 6.8, gate_up 17.9, down 8.6, against 80,
// 55, 170, 104 for the bf16 base projection; 256 prefill rows of one adapter 174, 67, 249, 157. Before the loops
// were written with intrinsics (below), the same took 146, 38, 141, 94 and 1601, 412, 1076, 1227, and 4 adapters
// at c=8 gave 0.75x the base model's output tok/s (benchmarks/lora.sh; now 0.88x).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"

namespace TM_NAMESPACE {
namespace {

constexpr int kRows = 4;  // rows of one segment computed together

// bf16 by its bits, so that the loops vectorize (c10::BFloat16's conversions go through memcpy per element)
template <typename T> struct Raw {
  using type = float;
  static inline float load(float x) { return x; }
  static inline float store(float x) { return x; }
};
template <> struct Raw<c10::BFloat16> {
  using type = uint16_t;
  static inline float load(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static inline uint16_t store(float f) {  // round to nearest even, as torch does
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
};

// Vectors of weights as floats, written out rather than left to the vectorizer: its bf16 loop staged the converted
// row through the stack in two halves and read it back whole, a store-forwarding stall on every K that made the
// delta 5 to 10x slower than its arithmetic. 8 lanes (AVX2, both builds); 16 where the build has AVX-512.
struct Lanes8 {
  using vec = __m256;
  static constexpr int kLanes = 8;
  static vec zero() { return _mm256_setzero_ps(); }
  static vec set1(float x) { return _mm256_set1_ps(x); }
  static vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
  static vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
  static void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
  static vec load(const float* p) { return _mm256_loadu_ps(p); }
  static vec load(const uint16_t* p) {  // bf16: the high half of a float
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
};
#if defined(__AVX512F__)
struct Lanes16 {
  using vec = __m512;
  static constexpr int kLanes = 16;
  static vec zero() { return _mm512_setzero_ps(); }
  static vec set1(float x) { return _mm512_set1_ps(x); }
  static vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
  static vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
  static void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
  static vec load(const float* p) { return _mm512_loadu_ps(p); }
  static vec load(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
};
using Widest = Lanes16;
#else
using Widest = Lanes8;
#endif

// xa[m, 0..W) = x[m] @ A^T[:, 0..W) for M rows (x: M rows of `in` floats; A^T: `in` rows `width` apart, zeros past
// the rank; xa: rows `width` apart). The M x W sums stay in registers, U of each along K: 8 chains of FMAs in all,
// so that they do not wait on each other (a decode token is one row: 8 / V chains).
template <typename L, typename W8, int W, int M>
void shrink(const W8* at, int64_t width, const float* x, int64_t in, float* xa) {
  using vec = typename L::vec;
  constexpr int V = W / L::kLanes, U = M * V < 8 ? 8 / (M * V) : 1;
  vec acc[U][M][V];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < V; ++v) acc[u][m][v] = L::zero();
  auto step = [&](int64_t k, int u) {
    vec a[V];
    for (int v = 0; v < V; ++v) a[v] = L::load(at + k * width + L::kLanes * v);
    for (int m = 0; m < M; ++m) {
      const vec xk = L::set1(x[m * in + k]);
      for (int v = 0; v < V; ++v) acc[u][m][v] = L::fma(xk, a[v], acc[u][m][v]);
    }
  };
  int64_t k = 0;
  for (; k + U <= in; k += U)
    for (int u = 0; u < U; ++u) step(k + u, u);
  for (; k < in; ++k) step(k, 0);
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) {
      vec sum = acc[0][m][v];
      for (int u = 1; u < U; ++u) sum = L::add(sum, acc[u][m][v]);
      L::store(xa + m * width + L::kLanes * v, sum);
    }
}

// Any other width, one row at a time: its first `rank` columns (xa rows `width` apart).
template <typename T>
void shrink_any(const typename Raw<T>::type* at, const float* x, int64_t in, int64_t width, int64_t rank, int rows,
                float* xa) {
  for (int m = 0; m < rows; ++m) {
    float* xm = xa + m * width;
    std::fill(xm, xm + rank, 0.f);
    for (int64_t k = 0; k < in; ++k) {
      const float xk = x[m * in + k];
      for (int64_t r = 0; r < rank; ++r) xm[r] += xk * Raw<T>::load(at[k * width + r]);
    }
  }
}

template <typename T, int W>
void shrink_rows(const typename Raw<T>::type* at, int64_t width, const float* x, int64_t in, int rows, float* xa) {
  using L = std::conditional_t<W % Widest::kLanes == 0, Widest, Lanes8>;
  using W8 = typename Raw<T>::type;
  if (rows == kRows) {
    shrink<L, W8, W, kRows>(at, width, x, in, xa);
  } else {
    for (int m = 0; m < rows; ++m) shrink<L, W8, W, 1>(at, width, x + m * in, in, xa + m * width);
  }
}

// out[m, 0..C) += xa[m, 0..rank) @ B^T[:, 0..C) for M rows (bt and out at the first column): M x C sums in
// registers, added to out once.
template <typename L, typename T, int M, int C>
void expand_columns(const typename Raw<T>::type* bt, int64_t stride, const float* xa, int64_t xa_stride,
                    int64_t rank, typename Raw<T>::type* out, int64_t out_stride) {
  using vec = typename L::vec;
  constexpr int V = C / L::kLanes;
  vec acc[M][V];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) acc[m][v] = L::zero();
  for (int64_t r = 0; r < rank; ++r) {
    vec b[V];
    for (int v = 0; v < V; ++v) b[v] = L::load(bt + r * stride + L::kLanes * v);
    for (int m = 0; m < M; ++m) {
      const vec w = L::set1(xa[m * xa_stride + r]);
      for (int v = 0; v < V; ++v) acc[m][v] = L::fma(w, b[v], acc[m][v]);
    }
  }
  alignas(64) float sums[C];
  for (int m = 0; m < M; ++m) {
    for (int v = 0; v < V; ++v) L::store(sums + L::kLanes * v, acc[m][v]);
    typename Raw<T>::type* o = out + m * out_stride;
#pragma omp simd
    for (int c = 0; c < C; ++c) o[c] = Raw<T>::store(Raw<T>::load(o[c]) + sums[c]);
  }
}

// out[m, 0..cols) += xa[m, 0..rank) @ B^T (B^T rows `stride` apart; out rows `out_stride` apart), for M rows:
// 8 vectors of sums at a time (8 / M vectors of columns), then one vector, then one column.
template <typename T, int M>
void expand(const typename Raw<T>::type* bt, int64_t stride, const float* xa, int64_t xa_stride, int64_t rank,
            int64_t cols, typename Raw<T>::type* out, int64_t out_stride) {
  using L = Widest;
  constexpr int kWide = 8 / M * L::kLanes;
  int64_t c0 = 0;
  for (; c0 + kWide <= cols; c0 += kWide)
    expand_columns<L, T, M, kWide>(bt + c0, stride, xa, xa_stride, rank, out + c0, out_stride);
  for (; c0 + 8 <= cols; c0 += 8)
    expand_columns<Lanes8, T, M, 8>(bt + c0, stride, xa, xa_stride, rank, out + c0, out_stride);
  for (int m = 0; m < M; ++m) {
    for (int64_t c = c0; c < cols; ++c) {
      float sum = 0.f;
      for (int64_t r = 0; r < rank; ++r) sum += xa[m * xa_stride + r] * Raw<T>::load(bt[r * stride + c]);
      out[m * out_stride + c] = Raw<T>::store(Raw<T>::load(out[m * out_stride + c]) + sum);
    }
  }
}

struct Block {
  int64_t first;  // its first row of x and out
  int rows;  // 1..kRows, of one slot
  int64_t slot;
};

template <typename T>
void delta_blocks(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
                  const std::vector<Block>& blocks, const int32_t* ranks, at::IntArrayRef shard_out) {
  using raw = typename Raw<T>::type;
  const int64_t shards = a.size(0), slots = a.size(1), in = a.size(2), width = a.size(3);
  const int64_t out_total = b_t.size(2), x_stride = x.stride(0), out_stride = out.stride(0);
  const raw* xp = reinterpret_cast<const raw*>(x.data_ptr());
  const raw* ap = reinterpret_cast<const raw*>(a.data_ptr());
  const raw* bp = reinterpret_cast<const raw*>(b_t.data_ptr());
  raw* op = reinterpret_cast<raw*>(out.data_ptr());
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xs(kRows * in), xa(kRows * width);
    for (int64_t i = begin; i < end; ++i) {
      const Block& blk = blocks[i];
      const int64_t s = blk.slot;
      for (int m = 0; m < blk.rows; ++m) {
        const raw* xt = xp + (blk.first + m) * x_stride;
        float* xm = xs.data() + m * in;
#pragma omp simd
        for (int64_t k = 0; k < in; ++k) xm[k] = Raw<T>::load(xt[k]);
      }
      int64_t offset = 0;
      for (int64_t j = 0; j < shards; ++j) {
        const int64_t rank = ranks[s * shards + j], cols = shard_out[j];
        if (rank > 0) {
          const raw* at_ = ap + (j * slots + s) * in * width;  // this slot's A^T of shard j: [in, width]
          // shrink: xa = x A^T, over the rank rounded up to a vector width the slots hold
          const int64_t w = rank <= 8 ? 8 : rank <= 16 ? 16 : rank <= 32 ? 32 : rank <= 64 ? 64 : width + 1;
          if (w > width) {
            shrink_any<T>(at_, xs.data(), in, width, rank, blk.rows, xa.data());
          } else if (w == 8) {
            shrink_rows<T, 8>(at_, width, xs.data(), in, blk.rows, xa.data());
          } else if (w == 16) {
            shrink_rows<T, 16>(at_, width, xs.data(), in, blk.rows, xa.data());
          } else if (w == 32) {
            shrink_rows<T, 32>(at_, width, xs.data(), in, blk.rows, xa.data());
          } else {
            shrink_rows<T, 64>(at_, width, xs.data(), in, blk.rows, xa.data());
          }
          const raw* bt = bp + s * width * out_total + offset;  // its B^T rows, from shard j's first column
          raw* o = op + blk.first * out_stride + offset;
          if (blk.rows == kRows) {  // expand: out += xa B^T
            expand<T, kRows>(bt, out_total, xa.data(), width, rank, cols, o, out_stride);
          } else {
            for (int m = 0; m < blk.rows; ++m)
              expand<T, 1>(bt, out_total, xa.data() + m * width, width, rank, cols, o + m * out_stride, out_stride);
          }
        }
        offset += cols;
      }
    }
  });
}

}  // namespace

void lora_delta(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
                const at::Tensor& segments, const at::Tensor& ranks, at::IntArrayRef shard_out) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) && x.stride(1) == 1 && out.stride(1) == 1,
              "lora_delta: x and out are [tokens, features] with contiguous rows");
  TORCH_CHECK(a.dim() == 4 && a.is_contiguous() && b_t.dim() == 3 && b_t.is_contiguous() && a.size(2) == x.size(1) &&
                  a.size(3) == b_t.size(1), "lora_delta: a is [shards, slots, in, R], b_t [slots, R, out], contiguous");
  TORCH_CHECK(a.scalar_type() == x.scalar_type() && b_t.scalar_type() == x.scalar_type() &&
                  out.scalar_type() == x.scalar_type(), "lora_delta: one dtype for x, out, a and b_t");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.is_contiguous() && ranks.scalar_type() == at::kInt &&
                  ranks.is_contiguous() && ranks.size(0) == a.size(1) && ranks.size(1) == a.size(0) &&
                  static_cast<int64_t>(shard_out.size()) == a.size(0), "lora_delta: bad segments or ranks");
  int64_t total = 0;
  for (int64_t cols : shard_out) total += cols;
  TORCH_CHECK(total == out.size(1) && b_t.size(2) == total, "lora_delta: shard widths do not add up to out");
  const int64_t* seg = segments.data_ptr<int64_t>();
  std::vector<Block> blocks;
  for (int64_t i = 0; i < segments.size(0); ++i) {
    const int64_t first = seg[3 * i], count = seg[3 * i + 1], slot = seg[3 * i + 2];
    TORCH_CHECK(first >= 0 && count >= 0 && first + count <= x.size(0) && slot >= 0 && slot < a.size(1),
                "lora_delta: segment out of range");
    for (int64_t row = first; row < first + count; row += kRows)
      blocks.push_back({row, static_cast<int>(std::min<int64_t>(kRows, first + count - row)), slot});
  }
  if (blocks.empty()) return;
  if (x.scalar_type() == at::kFloat) {
    delta_blocks<float>(out, x, a, b_t, blocks, ranks.data_ptr<int32_t>(), shard_out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "lora_delta: float32 or bfloat16 only");
    delta_blocks<c10::BFloat16>(out, x, a, b_t, blocks, ranks.data_ptr<int32_t>(), shard_out);
  }
}

}  // namespace TM_NAMESPACE
