// Attention on AMX's tiles (bf16, Intel Xeon since Sapphire Rapids), for fused_layers.cpp.
//
// The query rows of up to 16 / G tokens of one request that share a KV head (G query heads each: up to 16 rows)
// attend together: each key and value is read once for all of them, and both products run on the tile unit. Scores
// S = Q K^T (tile A: the queries, B: 16 keys' 32 columns as column pairs, a transpose of 16 x 16 words of the
// cache), then per row e_j = exp(s_j / sqrt(hd) - max) in float32 for the keys the row's token sees (0 after),
// rounded to bf16 as model.py's batched attention rounds its probabilities, and out = (e V) / sum(e), the sum in
// float32 (tile A: 32 keys' rounded e, B: 32 values' 16 columns as row pairs). A row's result depends on its own
// query and keys alone, not on the rows beside it. A request's single token keeps the vector loops (as fast for G
// rows). It runs only without Options.exact (the TILE_ATTENTION flag); Options.tile_attention=False turns it off.
// benchmarks/results/tiles.md (part attention: SmolLM2-135M's bf16 fused forwards after 200 cached tokens with the
// LM head, on a 2-core Xeon with AMX) has the vector loops -> here at 8 tokens 15.9 -> 14.5 ms, 16 tokens 17.0 ->
// 15.7, 32 tokens 25.5 -> 22.7.
#pragma once
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
#define TILE_ATTENTION 1
#include <vector>

#include "amx.h"

namespace tile_attention {

static const int64_t ROWS = 16;  // query rows of one call: one A tile

// Whether a head of hd values with G query heads per KV head runs here.
static inline bool fits(int64_t hd, int64_t G) {
  return hd % 32 == 0 && hd <= 256 && G <= ROWS && amx_permitted();
}

// Tiles 0-3: sums (scores: tile 0; weighed values: 16 columns of the head each), 4: queries or probabilities (A),
// 5: keys or values (B); all 16 rows of 64 bytes. Each thread configures before its calls and releases after.
static void configure() {
  TileConfig c = {};
  c.palette = 1;
  for (int t = 0; t < 6; t++) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  load_tile_config(c);
}

// dst (16 rows of 16 words, contiguous) = the transpose of the 16 x 16 words at src (rows `stride` bytes apart).
static inline void transpose(const void* src, int64_t stride, uint32_t* dst) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const char*)src + i * stride);
  for (int i = 0; i < 16; i += 2) {  // words of row pairs interleaved
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // then word pairs of pair pairs
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)  // then 128-bit lanes of rows i..i+7
    for (int k = 0; k < 4; k++) {
      t[i + k] = _mm512_shuffle_i32x4(r[i + k], r[i + k + 4], 0x88);
      t[i + k + 4] = _mm512_shuffle_i32x4(r[i + k], r[i + k + 4], 0xdd);
    }
  for (int k = 0; k < 8; k++) {  // and of rows k and k + 8
    r[k] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0x88);
    r[k + 8] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0xdd);
  }
  for (int i = 0; i < 16; i++) _mm512_storeu_si512(dst + 16 * i, r[i]);
}

// Tile numbers are immediates: one case per sum tile.
static inline void zero_sum(int t) {
  switch (t) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    default: _tile_zero(3); break;
  }
}
static inline void add_product(int t) {
  switch (t) {
    case 0: _tile_dpbf16ps(0, 4, 5); break;
    case 1: _tile_dpbf16ps(1, 4, 5); break;
    case 2: _tile_dpbf16ps(2, 4, 5); break;
    default: _tile_dpbf16ps(3, 4, 5); break;
  }
}
static inline void store_sum(int t, float* dst, int64_t stride) {
  switch (t) {
    case 0: _tile_stored(0, dst, stride); break;
    case 1: _tile_stored(1, dst, stride); break;
    case 2: _tile_stored(2, dst, stride); break;
    default: _tile_stored(3, dst, stride); break;
  }
}

// rows [from, to) of hd values at src, then zero rows up to `rows`, into dst: a block that would read past the
// visible keys reads this copy instead (the cache may end there).
static inline const bf16* padded(const bf16* src, int64_t from, int64_t to, int64_t rows, int64_t hd, bf16* dst) {
  memcpy(dst, src + from * hd, (to - from) * hd * sizeof(bf16));
  memset(dst + (to - from) * hd, 0, (rows - (to - from)) * hd * sizeof(bf16));
  return dst;
}

// The G query heads g0 .. g0 + G - 1 of `tokens` tokens (token i's at q + i * qstride + g0 * hd, G * tokens <= 16)
// over the keys and values of their KV head; token i sees keys 0 .. limit[i] - 1 but those hidden[i] hides
// (fused_layers.cpp's hide_keys). Row r = (token r / G, head
// g0 + r % G) goes to out + (r / G) * ostride + (g0 + r % G) * hd.
static void attend(const bf16* q, int64_t qstride, const bf16* keys, const bf16* values, const int64_t* limit,
                   const uint64_t* hidden, int64_t tokens, int64_t G, int64_t g0, int64_t hd, bf16* out, int64_t ostride) {
  const int64_t nr = tokens * G;
  int64_t L = 0;
  for (int64_t i = 0; i < tokens; i++) L = limit[i] > L ? limit[i] : L;
  const int64_t L16 = (L + 15) / 16 * 16, L32 = (L + 31) / 32 * 32;
  static thread_local std::vector<float> buffer;
  const size_t need = 16 * L16 + 8 * L32 + 8 * hd + 32 * hd / 2 + 256 + 256 + 16 * 64 + 64;
  if (buffer.size() < need) buffer.resize(need);
  float* S = (float*)(((uintptr_t)buffer.data() + 63) & ~(uintptr_t)63);  // scores [16][L16]
  bf16* P = (bf16*)(S + 16 * L16);                                        // probabilities [16][L32]
  bf16* Q = P + 16 * L32;                                                  // queries [16][hd]
  bf16* tail = Q + 16 * hd;                                                // a padded block [32][hd]
  uint32_t* B = (uint32_t*)(tail + 32 * hd);                               // one B tile
  float* W = (float*)(B + 256);                                            // weighed values [16][64]
  for (int64_t r = 0; r < ROWS; r++) {
    if (r < nr)
      memcpy(Q + r * hd, q + (r / G) * qstride + (g0 + r % G) * hd, hd * sizeof(bf16));
    else
      memset(Q + r * hd, 0, hd * sizeof(bf16));
  }
  for (int64_t j0 = 0; j0 < L; j0 += 16) {
    const bf16* k = j0 + 16 <= L ? keys + j0 * hd : padded(keys, j0, L, 16, hd, tail);
    _tile_zero(0);
    for (int64_t c = 0; c < hd / 32; c++) {
      transpose(k + c * 32, hd * sizeof(bf16), B);
      _tile_loadd(4, Q + c * 32, hd * sizeof(bf16));
      _tile_loadd(5, B, 64);
      _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, S + j0, L16 * sizeof(float));
  }
  const vec scale = vset(1.0f / sqrtf((float)hd));
  float sum[ROWS];
  for (int64_t r = 0; r < ROWS; r++) {
    bf16* p = P + r * L32;
    if (r >= nr) {
      memset(p, 0, L32 * sizeof(bf16));
      continue;
    }
    float* s = S + r * L16;
    const int64_t seen = limit[r / G];
    for (int64_t j = seen; j < L16; j++) s[j] = -INFINITY;  // e^-inf: 0
    hide_keys(s, seen, hidden[r / G]);
    vec top = vset(-INFINITY);
    for (int64_t j = 0; j < L16; j += LANES) top = vmax(top, vmul(vload(s + j), scale));
    float lanes[LANES], most = -INFINITY;
    vstore(lanes, top);
    for (int i = 0; i < LANES; i++) most = lanes[i] > most ? lanes[i] : most;
    vec total = vzero();
    for (int64_t j = 0; j < L16; j += LANES) {
      const vec e = vexp(vsub(vmul(vload(s + j), scale), vset(most)));
      total = vadd(total, e);
      vput(p + j, vround(e, p));
    }
    memset(p + L16, 0, (L32 - L16) * sizeof(bf16));
    sum[r] = vsum(total);
  }
  static const __m512i pairs = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                                38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  for (int64_t d0 = 0; d0 < hd; d0 += 64) {
    const int nt = hd - d0 >= 64 ? 4 : (int)((hd - d0) / 16);
    for (int t = 0; t < nt; t++) zero_sum(t);
    for (int64_t j0 = 0; j0 < L; j0 += 32) {
      const bf16* v = j0 + 32 <= L ? values + j0 * hd : padded(values, j0, L, 32, hd, tail);
      _tile_loadd(4, P + j0, L32 * sizeof(bf16));
      for (int t = 0; t < nt; t++) {
        for (int64_t i = 0; i < 16; i++) {  // B row i: values j0 + 2i and j0 + 2i + 1, column by column
          const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(v + 2 * i * hd + d0 + 16 * t)));
          const __m512i b =
              _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(v + (2 * i + 1) * hd + d0 + 16 * t)));
          _mm512_storeu_si512(B + 16 * i, _mm512_permutex2var_epi16(a, pairs, b));
        }
        _tile_loadd(5, B, 64);
        add_product(t);
      }
    }
    for (int t = 0; t < nt; t++) store_sum(t, W + 16 * t, 64 * sizeof(float));
    for (int64_t r = 0; r < nr; r++) {
      bf16* o = out + (r / G) * ostride + (g0 + r % G) * hd + d0;
      for (int t = 0; t < nt; t++) vput(o + 16 * t, vround(vdiv(vload(W + r * 64 + 16 * t), vset(sum[r])), o));
    }
  }
}

}  // namespace tile_attention
#endif
