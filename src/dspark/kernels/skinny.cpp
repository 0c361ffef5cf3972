// Few-row products y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for decode and verify forwards (skinny.py).
//
// Each thread streams its share of the weight rows once for all rows of x: a tile is two weight rows (AVX2) or
// four (AVX-512) against up to four rows of x, in float32 with fused multiply-adds, or with vdpbf16ps on bf16
// pairs where the CPU has AVX-512 BF16, or on AMX's tiles for bf16 weights with a copy packed for them where the
// CPU has them. Every output's sum runs in one order whatever the number of rows (one vector accumulator over k,
// then the same lane-sum tree, scalar tail and bias; or the tiles' chunks in order), so a row's result never
// depends on the other rows of the product. bf16 values are widened exactly and results rounded to
// nearest-even, as PyTorch rounds.
#include <omp.h>
#include <math.h>

#include <vector>

#include "simd.h"

// Weight sources of the float32 tiles: dense rows of T, or GGUF groups of 32 weights along k decoded exactly to
// the float32 values the GGUF's own dequantization gives (gguf-py: Q4_1 w = d·q + m, the product and then the sum
// each rounded once; Q8_0 w = d·q), so a product over groups is bit-identical to the product over those values
// held dense. K is a multiple of 32 for groups.
template <typename T>
struct Dense {
  const T* w;
  int64_t K;
  vec load(int64_t n, int64_t k) const { return vload(w + n * K + k); }
  float at(int64_t n, int64_t k) const { return widen(w[n * K + k]); }
  const void* line(int64_t n, int64_t k) const { return w + n * K + k; }
};

#if defined(__AVX512F__)
static inline vec vbytes(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline vec vbytes(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline vec vnibbles(const uint8_t* p, bool high) {
  __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm512_cvtepi32_ps(high ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15)));
}
#else
static inline vec vbytes(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
static inline vec vbytes(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
static inline vec vnibbles(const uint8_t* p, bool high) {
  __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  return _mm256_cvtepi32_ps(high ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15)));
}
#endif

// Q4_1: row n's group g is 16 bytes q[n][g] (byte i: weight 32g + i in the low nibble, 32g + 16 + i in the high
// one, GGUF's order) with d[n][g] and m[n][g] (float16 values, held as float32).
struct Q4_1 {
  const uint8_t* q;
  const float *d, *m;
  int64_t K;
  vec load(int64_t n, int64_t k) const {
    const int64_t g = n * (K / 32) + k / 32;
    return vadd(vmul(vnibbles(q + g * 16 + k % 16, k & 16), vset(d[g])), vset(m[g]));
  }
  float at(int64_t n, int64_t k) const {
    const int64_t g = n * (K / 32) + k / 32;
    const uint8_t byte = q[g * 16 + k % 16];
    return (float)(k & 16 ? byte >> 4 : byte & 15) * d[g] + m[g];
  }
  const void* line(int64_t n, int64_t k) const { return q + (n * K + k) / 2; }
};

// Q8_0: row n's group g is 32 signed bytes q[n][32g ..] with d[n][g].
struct Q8_0 {
  const int8_t* q;
  const float* d;
  int64_t K;
  vec load(int64_t n, int64_t k) const { return vmul(vbytes(q + n * K + k), vset(d[n * (K / 32) + k / 32])); }
  float at(int64_t n, int64_t k) const { return (float)q[n * K + k] * d[n * (K / 32) + k / 32]; }
  const void* line(int64_t n, int64_t k) const { return q + n * K + k; }
};

// Asks for the same columns of the next tile's weight rows while this tile multiplies: without it, tiles of
// several input rows wait on memory.
template <int NR, typename W>
static inline void prefetch_next(const W& w, int64_t n, int64_t k) {
  for (int i = 0; i < NR; i++) _mm_prefetch((const char*)w.line(n + NR + i, k), _MM_HINT_T0);
}

// Output y[m, n] from the sum s of its first k products: the scalar tail k .. K-1, then the bias, rounded into y.
template <typename X, typename W, typename T>
static inline void store(float s, const X* x, const W& w, const T* b, T* y, int64_t N, int64_t K, int64_t k,
                         int64_t n, int64_t m) {
  for (int64_t t = k; t < K; t++) s += w.at(n, t) * widen(x[m * K + t]);
  if (b) s += widen(b[n]);
  narrow(s, y + m * N + n);
}

// A tile's outputs: the lane sums of its accumulators, then the scalar tail k .. K-1 and the bias, rounded into y.
template <int NR, int MR, typename X, typename W, typename T>
static inline void finish(vec (&acc)[NR][MR], const X* x, const W& w, const T* b, T* y, int64_t N, int64_t K,
                          int64_t k, int64_t n, int64_t m) {
  float sums[NR][MR];
#if defined(__AVX512F__)
  if (NR == 4) {
    for (int j = 0; j < MR; j++) {
      float four[4];
      vsum4(&acc[0][j], MR, four);
      for (int i = 0; i < NR; i++) sums[i][j] = four[i];
    }
  } else
#endif
    for (int i = 0; i < NR; i++)
      for (int j = 0; j < MR; j++) sums[i][j] = vsum(acc[i][j]);
  for (int i = 0; i < NR; i++)
    for (int j = 0; j < MR; j++) store(sums[i][j], x, w, b, y, N, K, k, n + i, m + j);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// With AVX-512 BF16, bf16 products take 32 products per instruction (vdpbf16ps sums each adjacent pair with the
// accumulator lane), on the bf16 rows themselves; x is the bf16 input here, not its float32 copy.
template <int NR, int MR>
static inline void tile_bf16(const bf16* x, const Dense<bf16>& w, const bf16* b, bf16* y, int64_t N, int64_t K, int64_t n,
                             int64_t m) {
  __m512 acc[NR][MR];
  for (int i = 0; i < NR; i++)
    for (int j = 0; j < MR; j++) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512i wv[NR];
    for (int i = 0; i < NR; i++) wv[i] = _mm512_loadu_si512(w.w + (n + i) * K + k);
    prefetch_next<NR>(w, n, k);
    for (int j = 0; j < MR; j++) {
      __m512i xv = _mm512_loadu_si512(x + (m + j) * K + k);
      for (int i = 0; i < NR; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[i]);
    }
  }
  finish<NR, MR>(acc, x, w, b, y, N, K, k, n, m);
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// With AMX (Intel Xeon since Sapphire Rapids), bf16 products of 2 to 32 rows over a weight that has a packed copy
// (skinny.py's `tiles`) run on the tile unit: one tdpbf16ps multiplies up to 16 rows of x (tile A: x itself, stride
// K) by 32 columns of 16 weight rows (tile B: the rows' 32 columns as column pairs, 1 KB contiguous in the copy,
// [N/16][K/32][16 pairs][16 rows][2]) into tile C, the M x 16 float32 sums (one x row's 16 outputs per C row,
// stored with vector instructions). Up to 16 rows of x, a block is three such weight tiles (48 weight rows: three
// streams of B tiles read in order, all three loaded before their products); 17-32 rows take a second A tile
// against the same weight tiles, so the weights are read once for 32 rows, two weight tiles a block (cheaper than
// two products of 16 rows, which read them twice). Every output sums its 32-column chunks in order into one C tile
// whatever M or the block, so a row's result does not depend on the rows beside it. One row on the tiles too (the
// ONE_ROW_TILES flag, which exactness sets) keeps that true for every width; without it one row runs on
// vdpbf16ps, which sums in another order and is about as fast for one row (benchmarks/results/tiles.md: products,
// size 1). Up to 16 rows, blocks of three weight tiles beat blocks of two or four (the fourth reusing a B tile)
// in whole bf16 forwards of SmolLM2-135M on a 2-core Xeon with AMX, and asking for tiles ahead (1-16 chunks, to L1
// or L2) gains nothing there, so B tiles are not prefetched.
#include "amx.h"

static const int64_t AMX_MAX_ROWS = 32;  // rows of x per weight pass: two A tiles of 16

// Weight rows per block: three tiles of 16 against one A tile, two against two.
static int64_t amx_block_rows(int64_t M) { return M <= 16 ? 48 : 32; }

// Up to 16 rows of x: tiles 0-2 hold the sums C of weight tiles 3-5 (B: 16 column pairs x 16 rows), tile 6 x (A,
// 32 bf16 a row). 17-32 rows: tiles 0-1 the sums of x rows 0-15 against weight tiles 4 and 5, 2-3 of rows 16-31;
// 6-7 x rows 0-15 and 16-31. Unused tiles stay empty.
static void configure_tiles(int64_t M) {
  const int64_t first = M < 16 ? M : 16, second = M - first;
  const int64_t one[8] = {M, M, M, 16, 16, 16, M, 0};
  const int64_t two[8] = {16, 16, second, second, 16, 16, 16, second};
  const int64_t* rows = M <= 16 ? one : two;
  TileConfig c = {};
  c.palette = 1;
  for (int t = 0; t < 8; t++) {
    c.rows[t] = (uint8_t)rows[t];
    c.colsb[t] = rows[t] ? 64 : 0;
  }
  load_tile_config(c);
}

// y rows m0 .. m0 + rows - 1, weight rows n .. n+15, from a C tile's sums.
static void store_tile(const float (*sums)[16], const bf16* b, bf16* y, int64_t rows, int64_t N, int64_t n,
                       int64_t m0) {
  for (int64_t j = 0; j < rows; j++) {
    const vec s = vload(sums[j]);
    vput(y + (m0 + j) * N + n, vround(b ? vadd(s, vload(b + n)) : s, y));
  }
}
// The tile's number is written into the instruction, so this is a macro.
#define STORE_SUMS(tile, b, y, rows, N, n, m0) \
  do {                                         \
    float sums[16][16];                        \
    _tile_stored(tile, sums, 64);              \
    store_tile(sums, b, y, rows, N, n, m0);    \
  } while (0)

// Weight rows n .. n + 16G - 1 (wt: the packed copy) against M <= 16 rows of x; K is a multiple of 32.
template <int G>
static void block_one(const bf16* x, const bf16* wt, const bf16* b, bf16* y, int64_t M, int64_t N, int64_t K,
                      int64_t n) {
  const int64_t chunks = K / 32;
  const bf16* w = wt + (n / 16) * chunks * 512;  // weight tile g of chunk c: w + (g * chunks + c) * 512
  _tile_zero(0);
  if (G > 1) _tile_zero(1);
  if (G > 2) _tile_zero(2);
  for (int64_t c = 0; c < chunks; c++) {
    _tile_loadd(6, x + c * 32, K * 2);
    _tile_loadd(3, w + c * 512, 64);
    if (G > 1) _tile_loadd(4, w + (chunks + c) * 512, 64);
    if (G > 2) _tile_loadd(5, w + (2 * chunks + c) * 512, 64);
    _tile_dpbf16ps(0, 6, 3);
    if (G > 1) _tile_dpbf16ps(1, 6, 4);
    if (G > 2) _tile_dpbf16ps(2, 6, 5);
  }
  STORE_SUMS(0, b, y, M, N, n, 0);
  if (G > 1) STORE_SUMS(1, b, y, M, N, n + 16, 0);
  if (G > 2) STORE_SUMS(2, b, y, M, N, n + 32, 0);
}

// Weight rows n .. n + 16G - 1 against 17-32 rows of x.
template <int G>
static void block_two(const bf16* x, const bf16* wt, const bf16* b, bf16* y, int64_t M, int64_t N, int64_t K,
                      int64_t n) {
  const int64_t chunks = K / 32;
  const bf16* w = wt + (n / 16) * chunks * 512;
  _tile_zero(0);
  _tile_zero(2);
  if (G > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t c = 0; c < chunks; c++) {
    _tile_loadd(4, w + c * 512, 64);
    if (G > 1) _tile_loadd(5, w + (chunks + c) * 512, 64);
    _tile_loadd(6, x + c * 32, K * 2);
    _tile_loadd(7, x + 16 * K + c * 32, K * 2);
    _tile_dpbf16ps(0, 6, 4);
    if (G > 1) _tile_dpbf16ps(1, 6, 5);
    _tile_dpbf16ps(2, 7, 4);
    if (G > 1) _tile_dpbf16ps(3, 7, 5);
  }
  STORE_SUMS(0, b, y, 16, N, n, 0);
  STORE_SUMS(2, b, y, M - 16, N, n, 16);
  if (G > 1) {
    STORE_SUMS(1, b, y, 16, N, n + 16, 0);
    STORE_SUMS(3, b, y, M - 16, N, n + 16, 16);
  }
}

// Weight rows n .. end - 1 (a multiple of 16, at most amx_block_rows(M)) against all M rows of x.
static void block_amx(const bf16* x, const bf16* wt, const bf16* b, bf16* y, int64_t M, int64_t N, int64_t K,
                      int64_t n, int64_t end) {
  const int64_t G = (end - n) / 16;  // weight tiles
  if (M > 16) {
    if (G == 1) block_two<1>(x, wt, b, y, M, N, K, n);
    else block_two<2>(x, wt, b, y, M, N, K, n);
  } else if (G == 1) {
    block_one<1>(x, wt, b, y, M, N, K, n);
  } else if (G == 2) {
    block_one<2>(x, wt, b, y, M, N, K, n);
  } else {
    block_one<3>(x, wt, b, y, M, N, K, n);
  }
}
#endif

// Weight rows n .. n+NR-1 against float32 rows m .. m+MR-1 of xf [M, K]; writes y[m + j, n + i].
template <int NR, int MR, typename W, typename T>
static inline void tile(const float* xf, const W& w, const T* b, T* y, int64_t N, int64_t K, int64_t n, int64_t m) {
  vec acc[NR][MR];
  for (int i = 0; i < NR; i++)
    for (int j = 0; j < MR; j++) acc[i][j] = vzero();
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    vec wv[NR];
    for (int i = 0; i < NR; i++) wv[i] = w.load(n + i, k);
    prefetch_next<NR>(w, n, k);
    for (int j = 0; j < MR; j++) {
      vec xv = vload(xf + (m + j) * K + k);
      for (int i = 0; i < NR; i++) acc[i][j] = vfma(wv[i], xv, acc[i][j]);
    }
  }
  finish<NR, MR>(acc, xf, w, b, y, N, K, k, n, m);
}

// One tile: bf16 on AVX-512 BF16 multiplies the bf16 rows x; otherwise the float32 rows xf.
template <int NR, int MR, typename W>
static inline void block(const float*, const float* xf, const W& w, const float* b, float* y, int64_t N,
                         int64_t K, int64_t n, int64_t m) {
  tile<NR, MR>(xf, w, b, y, N, K, n, m);
}
template <int NR, int MR>
static inline void block(const bf16* x, const float* xf, const Dense<bf16>& w, const bf16* b, bf16* y, int64_t N,
                         int64_t K, int64_t n, int64_t m) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  tile_bf16<NR, MR>(x, w, b, y, N, K, n, m);
#else
  tile<NR, MR>(xf, w, b, y, N, K, n, m);
#endif
}

template <int NR, typename T, typename W>
static inline void rows(const T* x, const float* xf, const W& w, const T* b, T* y, int64_t M, int64_t N, int64_t K,
                        int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) block<NR, 4>(x, xf, w, b, y, N, K, n, m);
  switch (M - m) {
    case 3: block<NR, 3>(x, xf, w, b, y, N, K, n, m); break;
    case 2: block<NR, 2>(x, xf, w, b, y, N, K, n, m); break;
    case 1: block<NR, 1>(x, xf, w, b, y, N, K, n, m); break;
  }
}

static const float* as_float(const float* x, int64_t, std::vector<float>&) { return x; }
static const float* as_float(const bf16* x, int64_t count, std::vector<float>& buffer) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return nullptr;  // not read: the bf16 tiles multiply x itself
#endif
  buffer.resize(count);
  for (int64_t i = 0; i < count; i++) buffer[i] = widen(x[i]);
  return buffer.data();
}

static const int64_t BLOCK = 32;  // weight rows per work item
static const int WROWS = LANES == 16 ? 4 : 2;  // weight rows per tile: 4 x 4 accumulators fit AVX-512's registers

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SKINNY_AMX 1
#endif

// The flags of a product (and of fused_layers.cpp's forwards): ONE_ROW_TILES puts products of one row on AMX's tiles
// too; TILE_ATTENTION lets fused_layers.cpp attend several tokens of a request on the tiles.
enum { FLAG_ONE_ROW_TILES = 1, FLAG_TILE_ATTENTION = 2 };

// Whether bf16 weight rows take the AMX tiles: a packed copy given (wt, whole tiles: N a multiple of 16, K of 32),
// 2 (1 with ONE_ROW_TILES) to AMX_MAX_ROWS rows, compiled in and granted by Linux; float32 products, and CPUs
// without AMX, never do.
struct Tiles {
  bool on = false;
  int64_t M = 0;
  const bf16* wt = nullptr;
  Tiles(const float*, const void*, int64_t, int64_t, int64_t, int) {}
  Tiles(const bf16*, const void* packed, int64_t rows, int64_t N, int64_t K, int flags)
      : M(rows), wt((const bf16*)packed) {
#ifdef SKINNY_AMX
    on = wt && M >= (flags & FLAG_ONE_ROW_TILES ? 1 : 2) && M <= AMX_MAX_ROWS && N % 16 == 0 && K % 32 == 0 &&
         amx_permitted();
#else
    (void)N, (void)K, (void)flags;
#endif
  }
  // weight rows per work item
  int64_t block_rows() const {
#ifdef SKINNY_AMX
    if (on) return amx_block_rows(M);
#endif
    return BLOCK;
  }
  void begin() const {
#ifdef SKINNY_AMX
    if (on) configure_tiles(M);
#endif
  }
  void end() const {
#ifdef SKINNY_AMX
    if (on) _tile_release();
#endif
  }
  template <typename W>
  void block(const float*, const W&, const float*, float*, int64_t, int64_t, int64_t, int64_t) const {}
  void block(const bf16* x, const Dense<bf16>&, const bf16* b, bf16* y, int64_t N, int64_t K, int64_t n,
             int64_t end) const {
#ifdef SKINNY_AMX
    block_amx(x, wt, b, y, M, N, K, n, end);
#else
    (void)x, (void)b, (void)y, (void)N, (void)K, (void)n, (void)end;
#endif
  }
};

template <typename T, typename W>
static void product(const T* x, const W& w, const void* wt, const T* b, T* y, int64_t M, int64_t N, int64_t K,
                    int threads, int flags = 0) {
  const Tiles tiles(x, wt, M, N, K, flags);
  const int64_t step = tiles.block_rows(), blocks = (N + step - 1) / step;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> buffer;
    const float* xf = as_float(x, M * K, buffer);
    tiles.begin();
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
      const int64_t end = blk * step + step < N ? blk * step + step : N;
      int64_t n = blk * step;
      if (tiles.on) {
        tiles.block(x, w, b, y, N, K, n, end);
        continue;
      }
      for (; n + WROWS <= end; n += WROWS) rows<WROWS>(x, xf, w, b, y, M, N, K, n);
      for (; n < end; n++) rows<1>(x, xf, w, b, y, M, N, K, n);
    }
    tiles.end();
  }
}

// Rows of x are taken BLOCK_ROWS at a time: a block's rows stay in cache while every weight row streams past them
// once (all of a wide product's rows at once would stream from memory for every weight row), and with a packed copy
// each block takes the AMX tiles as any narrower product does (AMX_MAX_ROWS rows at most). A row's result does not
// depend on its block. flags: FLAG_ONE_ROW_TILES (above).
static const int64_t BLOCK_ROWS = 32;
template <typename T, typename W>
static void product_in_blocks(const T* x, const W& w, const void* wt, const T* b, T* y, int64_t M, int64_t N, int64_t K,
                              int threads, int flags) {
  for (int64_t m = 0; m < M; m += BLOCK_ROWS)
    product(x + m * K, w, wt, b, y + m * N, M - m < BLOCK_ROWS ? M - m : BLOCK_ROWS, N, K, threads, flags);
}

extern "C" {
// wt: w packed tile by tile (block_amx), read by bf16 products on AMX; may be null (float32: always null).
void skinny_bf16(const bf16* x, const bf16* w, const bf16* wt, const bf16* b, bf16* y, int64_t M, int64_t N,
                 int64_t K, int threads, int flags) {
  product_in_blocks(x, Dense<bf16>{w, K}, wt, b, y, M, N, K, threads, flags);
}
void skinny_f32(const float* x, const float* w, const float*, const float* b, float* y, int64_t M, int64_t N,
                int64_t K, int threads, int) {
  product_in_blocks(x, Dense<float>{w, K}, nullptr, b, y, M, N, K, threads, 0);
}
// Whether bf16 products run on AMX's tiles here (compiled in and granted by Linux): only then are packed copies
// worth making.
int skinny_tiles(void) {
#ifdef SKINNY_AMX
  return amx_permitted();
#else
  return 0;
#endif
}
// float32 products over weights held as GGUF groups (see Q4_1, Q8_0): bit-identical to skinny_f32 on their values.
void skinny_q4_1_f32(const float* x, const uint8_t* q, const float* d, const float* m, const float* b, float* y,
                     int64_t M, int64_t N, int64_t K, int threads) {
  product_in_blocks(x, Q4_1{q, d, m, K}, nullptr, b, y, M, N, K, threads, 0);
}
void skinny_q8_0_f32(const float* x, const int8_t* q, const float* d, const float* b, float* y, int64_t M, int64_t N,
                     int64_t K, int threads) {
  product_in_blocks(x, Q8_0{q, d, K}, nullptr, b, y, M, N, K, threads, 0);
}
}

// Packing for groups.py: the groups of a float32 weight [N, K] by llama.cpp's reference rules (Q4_1: d = (max -
// min) / 15, m = min; Q8_0: d = max|w| / 127; d and m rounded to float16 and held as float32), into q, d (and m)
// laid out as Q4_1 and Q8_0 above. Returns 1 if every group decodes to its weights bit for bit, else 0 (the
// outputs are then partial). One pass over the weight on all threads: checking SmolLM2's 135M weights this way
// takes a fraction of a second, PyTorch's elementwise passes took seconds.
static inline float half_round(float v) { return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT)); }

extern "C" {
int group_q4_1(const float* w, uint8_t* q, float* d, float* m, int64_t N, int64_t K, int threads) {
  const int64_t groups = N * (K / 32);
  int exact = 1;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(&& : exact)
  for (int64_t g = 0; g < groups; g++) {
    const float* v = w + g * 32;
    float lo = v[0], hi = v[0];
    for (int i = 1; i < 32; i++) lo = v[i] < lo ? v[i] : lo, hi = v[i] > hi ? v[i] : hi;
    const float dg = half_round((hi - lo) / 15), mg = half_round(lo), inv = dg > 0 ? 1 / dg : 0;
    uint8_t nib[32];
    for (int i = 0; i < 32; i++) {
      float r = nearbyintf((v[i] - mg) * inv);
      nib[i] = (uint8_t)(r < 0 ? 0 : r > 15 ? 15 : r);
      exact = exact && (float)nib[i] * dg + mg == v[i];
    }
    for (int i = 0; i < 16; i++) q[g * 16 + i] = nib[i] | (nib[16 + i] << 4);
    d[g] = dg, m[g] = mg;
  }
  return exact;
}
int group_q8_0(const float* w, int8_t* q, float* d, int64_t N, int64_t K, int threads) {
  const int64_t groups = N * (K / 32);
  int exact = 1;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(&& : exact)
  for (int64_t g = 0; g < groups; g++) {
    const float* v = w + g * 32;
    float amax = 0;
    for (int i = 0; i < 32; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
    const float dg = half_round(amax / 127), inv = dg > 0 ? 1 / dg : 0;
    for (int i = 0; i < 32; i++) {
      float r = nearbyintf(v[i] * inv);
      q[g * 32 + i] = (int8_t)(r < -127 ? -127 : r > 127 ? 127 : r);
      exact = exact && (float)q[g * 32 + i] * dg == v[i];
    }
    d[g] = dg;
  }
  return exact;
}
}
