// How fast this machine reads a buffer in pieces taken in random order, against the same pieces in order: a
// decode step's attention reads each sequence's KV blocks (2 KB per head for SmolLM2's bf16 blocks of 16 tokens)
// scattered over the pool (benchmarks/results/attention.md, "Decode on a Zen 4 EPYC"). One thread sums float32
// vectors over 512 MB in pieces of PIECE bytes; AHEAD > 0 prefetches the piece AHEAD places later; WORK adds ~100
// dependent FMAs per piece, which a working prefetch would overlap.
//   g++ -O2 -mavx512f -o /tmp/scattered_reads benchmarks/scattered_reads.cpp
//   for p in 2048 8192; do PIECE=$p /tmp/scattered_reads; done
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

int main() {
  const size_t total = 512ul << 20, piece = getenv("PIECE") ? atol(getenv("PIECE")) : 2048, n = total / piece;
  char* buf = static_cast<char*>(aligned_alloc(4096, total));
  for (size_t i = 0; i < total; i += 64) buf[i] = static_cast<char>(i);
  for (bool random_order : {false, true}) {
    std::vector<size_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    if (random_order) std::shuffle(order.begin(), order.end(), std::mt19937(1));
    for (size_t ahead : {0, 1, 4}) {
      for (bool work : {false, true}) {
        const auto t = std::chrono::steady_clock::now();
        __m512 acc = _mm512_setzero_ps();
        for (size_t c = 0; c < n; ++c) {
          if (ahead) {
            const char* p = buf + order[std::min(n - 1, c + ahead)] * piece;
            for (size_t i = 0; i < piece; i += 64) __builtin_prefetch(p + i);
          }
          const float* f = reinterpret_cast<const float*>(buf + order[c] * piece);
          for (size_t i = 0; i < piece / 4; i += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(f + i));
          if (work) {
            __m512 x = acc;
            for (int k = 0; k < 100; ++k) x = _mm512_fmadd_ps(x, x, x);
            acc = _mm512_add_ps(acc, _mm512_mul_ps(x, _mm512_setzero_ps()));
          }
        }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
        volatile float sink = _mm512_reduce_add_ps(acc);
        (void)sink;
        printf("%6zu-byte pieces, %s, prefetch %zu ahead, %s: %5.1f GB/s (%4.0f ns a piece)\n", piece,
               random_order ? "random order" : "in order", ahead, work ? "with work" : "sum only",
               total / s / 1e9, s / n * 1e9);
      }
    }
  }
}
