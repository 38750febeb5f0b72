// What the AMX kernels share (linear_amx.cpp, attention_amx.cpp): FF_AMX where the compiler
// targets AMX-BF16 (with AVX512-BF16), Linux's permission for the tile state, and the one tile
// configuration they all use: eight tiles of 16 rows x 64 bytes.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#define FF_AMX 1

namespace ff::amx {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands a process AMX's tile state only on request (arch_prctl), once per process.
inline bool permitted() {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const bool ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return ok;
}

// Every tile 16 rows x 64 bytes: C 16 x 16 fp32, A 16 rows x 32 bf16, B 16 K pairs x 16
// columns (VNNI).
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace ff::amx
#endif
