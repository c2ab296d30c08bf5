// Intel AMX (Sapphire Rapids and later), shared by the kernels that use it (w8a8.cpp: AMX-INT8; gemm_small_m.cpp,
// quant_linear.cpp and attention.cpp: AMX-BF16). Only the AVX-512 build has AMX paths.
//
// - amx_available(): the CPU has AMX-TILE and the data type's unit (CPUID.(7,0):EDX bit 24, and 25 for INT8 or 22
//   for BF16), and Linux gave this process the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE 18;
//   without it the first tile instruction faults). Asked once per process and unit: the kernels ask on every call,
//   and cpuid is a VM exit on a cloud VM.
// - amx_configure(): every tile 16 rows x 64 bytes (palette 1), on the calling thread. The tile configuration is
//   per thread and oneDNN (the dense path, on the same threads) loads its own, so a kernel configures the tiles at
//   the start of each parallel work item (or region) and releases them (amx_release) after.
#pragma once

#if defined(__AVX512F__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace TM_NAMESPACE {

enum class AmxUnit { kInt8 = 25, kBf16 = 22 };

inline bool amx_permitted() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

inline bool amx_has_unit(AmxUnit unit) {
  unsigned a, b, c, d;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << static_cast<int>(unit))) && amx_permitted();
}

inline bool amx_available(AmxUnit unit) {
  static const bool int8 = amx_has_unit(AmxUnit::kInt8), bf16 = amx_has_unit(AmxUnit::kBf16);
  return unit == AmxUnit::kInt8 ? int8 : bf16;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile"))) inline void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  // ldtilecfg as asm with the config as its memory operand: gcc 12's _tile_loadconfig builtin does not count as a
  // read of the struct, and the stores of colsb and rows were dropped as dead (every tile then faults)
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

__attribute__((target("amx-tile"))) inline void amx_release() { _tile_release(); }

// The bf16 GEMM on AMX of gemm_small_m.cpp (a packed dense weight) and quant_linear.cpp (weight groups
// dequantized per call into the same layout): per 16-output group, K/2 rows of [16 outputs x 2 bf16], 64 bytes
// apart, so that 16 such rows are one tdpbf16ps B tile and group g sits at w + g * K * 16.
constexpr int kAmxRows = 32;   // rows per register block: two activation tiles
constexpr int kAmxGroups = 2;  // 16-output groups per block: two weight tiles
constexpr int kAmxSpan = 8;    // groups per work item (rows outer): a row's outputs are written 256 bytes at a time

// One register block: y rows [0, rows) x G groups = x W^T (+ bias), all of K (a multiple of 32) accumulated in
// float32 sum tiles 4 + 2a + g (a: activation tile, g: weight tile), as oneDNN's AMX GEMM does, then bias and bf16
// (round to nearest even) into y. x: A * 16 rows readable, x_bytes apart.
template <int A, int G>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16,avx512vl"))) void amx_bf16_block(
    const uint16_t* x, int64_t x_bytes, const uint16_t* w, int64_t group_elems, int64_t K, const float* bias,
    uint16_t* y, int64_t y_stride, int rows) {
  _tile_zero(4);
  if constexpr (G > 1) _tile_zero(5);
  if constexpr (A > 1) _tile_zero(6);
  if constexpr (A > 1 && G > 1) _tile_zero(7);
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(0, x + k, x_bytes);
    if constexpr (A > 1) _tile_loadd(1, reinterpret_cast<const char*>(x + k) + 16 * x_bytes, x_bytes);
    _tile_loadd(2, w + k * 16, 64);
    if constexpr (G > 1) _tile_loadd(3, w + group_elems + k * 16, 64);
    _tile_dpbf16ps(4, 0, 2);
    if constexpr (G > 1) _tile_dpbf16ps(5, 0, 3);
    if constexpr (A > 1) _tile_dpbf16ps(6, 1, 2);
    if constexpr (A > 1 && G > 1) _tile_dpbf16ps(7, 1, 3);
  }
  alignas(64) float c[A][G][16][16];
  _tile_stored(4, c[0][0], 64);
  if constexpr (G > 1) _tile_stored(5, c[0][G - 1], 64);
  if constexpr (A > 1) _tile_stored(6, c[A - 1][0], 64);
  if constexpr (A > 1 && G > 1) _tile_stored(7, c[A - 1][G - 1], 64);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < G; ++g) {
      __m512 v = _mm512_load_ps(c[r / 16][g][r % 16]);
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + g * 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * y_stride + g * 16), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

// Rows [m_begin, m_end) of x ([M, K] bf16, rows x_stride apart) against `groups` groups of w, rows outer, in
// register blocks of kAmxRows x kAmxGroups; bias (or null) and y ([., y_stride] bf16) start at w's first output.
// The rows past the last whole 16 of x are read from `tail`, a zero-padded copy: a tile reads 16 rows. Runs on the
// calling thread, between amx_configure() and amx_release().
inline void amx_bf16_rows(const uint16_t* x, int64_t x_stride, int64_t m_begin, int64_t m_end, int64_t M,
                          const uint16_t* w, int64_t groups, int64_t K, const float* bias, uint16_t* y,
                          int64_t y_stride, std::vector<uint16_t>& tail) {
  using BlockFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, const float*, uint16_t*,
                           int64_t, int);
  static constexpr BlockFn fns[2][2] = {{&amx_bf16_block<1, 1>, &amx_bf16_block<1, 2>},
                                        {&amx_bf16_block<2, 1>, &amx_bf16_block<2, 2>}};
  const int64_t group_elems = K * 16;
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kAmxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kAmxRows, m_end - m0));
    const uint16_t* xb = x + m0 * x_stride;
    int64_t xb_bytes = x_stride * 2;
    if (rows % 16 && m0 + rows == M) {
      tail.assign(static_cast<size_t>(kAmxRows) * K, 0);
      for (int r = 0; r < rows; ++r) std::copy(xb + r * x_stride, xb + r * x_stride + K, tail.data() + r * K);
      xb = tail.data();
      xb_bytes = K * 2;
    }
    const int a = rows > 16 ? 2 : 1;
    for (int64_t g0 = 0; g0 < groups; g0 += kAmxGroups) {
      const int g = static_cast<int>(std::min<int64_t>(kAmxGroups, groups - g0));
      fns[a - 1][g - 1](xb, xb_bytes, w + g0 * group_elems, group_elems, K, bias ? bias + g0 * 16 : nullptr,
                        y + m0 * y_stride + g0 * 16, y_stride, rows);
    }
  }
}

}  // namespace TM_NAMESPACE
#endif
