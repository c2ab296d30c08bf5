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
// expand (out += xa B^T) along B^T's rows, 32 output columns at a time. Only an adapter's own shards are
// computed, its expand only to its rank. Nothing calls a GEMM library: on the 2-core Zen 4, ATen's bf16 matmul
// pair for one shard cost ~0.2 ms at 16 rows, where these loops take ~25 us; at 256 rows they still win for qkv
// (0.5 vs 0.9 ms, rank 16) and are within 1.5x on gate_up.
#include "lora.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

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

// xa[m, 0..W) = x[m] @ A^T[:, 0..W) for M rows (x: M rows of `in` floats; A^T: `in` rows `width` apart, zeros
// past the rank; xa: rows `width` apart). W (the rank rounded up) and M known at compile time keep the M x W sums
// in registers.
template <typename T, int W, int M>
void shrink(const typename Raw<T>::type* at, int64_t width, const float* x, int64_t in, float* xa) {
  float acc[M][W] = {};
  for (int64_t k = 0; k < in; ++k) {
    float a[W];
#pragma omp simd
    for (int r = 0; r < W; ++r) a[r] = Raw<T>::load(at[k * width + r]);
    for (int m = 0; m < M; ++m) {
      const float xk = x[m * in + k];
#pragma omp simd
      for (int r = 0; r < W; ++r) acc[m][r] += xk * a[r];
    }
  }
  for (int m = 0; m < M; ++m) std::copy(acc[m], acc[m] + W, xa + m * width);
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
#pragma omp simd
      for (int64_t r = 0; r < rank; ++r) xm[r] += xk * Raw<T>::load(at[k * width + r]);
    }
  }
}

template <typename T, int W>
void shrink_rows(const typename Raw<T>::type* at, int64_t width, const float* x, int64_t in, int rows, float* xa) {
  if (rows == kRows) {
    shrink<T, W, kRows>(at, width, x, in, xa);
  } else {
    for (int m = 0; m < rows; ++m) shrink<T, W, 1>(at, width, x + m * in, in, xa + m * width);
  }
}

// out[m, 0..cols) += xa[m, 0..rank) @ B^T (B^T rows `stride` apart; out rows `out_stride` apart), for M rows.
template <typename T, int M>
void expand(const typename Raw<T>::type* bt, int64_t stride, const float* xa, int64_t xa_stride, int64_t rank,
            int64_t cols, typename Raw<T>::type* out, int64_t out_stride) {
  constexpr int64_t kCols = 32;
  int64_t c0 = 0;
  for (; c0 + kCols <= cols; c0 += kCols) {
    float acc[M][kCols] = {};
    for (int64_t r = 0; r < rank; ++r) {
      float b[kCols];
#pragma omp simd
      for (int64_t c = 0; c < kCols; ++c) b[c] = Raw<T>::load(bt[r * stride + c0 + c]);
      for (int m = 0; m < M; ++m) {
        const float w = xa[m * xa_stride + r];
#pragma omp simd
        for (int64_t c = 0; c < kCols; ++c) acc[m][c] += w * b[c];
      }
    }
    for (int m = 0; m < M; ++m) {
      typename Raw<T>::type* o = out + m * out_stride + c0;
#pragma omp simd
      for (int64_t c = 0; c < kCols; ++c) o[c] = Raw<T>::store(Raw<T>::load(o[c]) + acc[m][c]);
    }
  }
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

namespace {
void lora_delta_op(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
                   const at::Tensor& segments, const at::Tensor& ranks, at::IntArrayRef shard_out) {
  lora_delta(out, x, a, b_t, segments, ranks, shard_out);
}
}  // namespace

}  // namespace TM_NAMESPACE

TORCH_LIBRARY_FRAGMENT(TM_NAMESPACE, m) {
  m.def("lora_delta(Tensor(a!) out, Tensor x, Tensor a, Tensor b_t, Tensor segments, Tensor ranks, int[] shard_out) "
        "-> ()");
}

TORCH_LIBRARY_IMPL(TM_NAMESPACE, CPU, m) {
  m.impl("lora_delta", &TM_NAMESPACE::lora_delta_op);
}
