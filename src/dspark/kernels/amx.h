// What skinny.cpp's products and tile_attention.h share on AMX (Intel Xeon since Sapphire Rapids): the tile
// configuration's layout and Linux's permission to use the tiles.
#pragma once
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Loads the configuration. GCC's _tile_loadconfig does not tell the compiler that it reads c, so the stores that
// filled c may be dropped (seen: a fault on ldtilecfg); this asm names c as its input.
static inline void load_tile_config(const TileConfig& c) { asm volatile("ldtilecfg %0" : : "m"(c)); }

// Linux hands out the tile registers' state only on request (once per process).
static bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}
#endif
