// Intel AMX (Sapphire Rapids and later), shared by the kernels that use it (w8a8.cpp: AMX-INT8; gemm_small_m.cpp
// and attention.cpp: AMX-BF16). Only the AVX-512 build has AMX paths.
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

#include <cstdint>

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

}  // namespace TM_NAMESPACE
#endif
