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
// several input rows wait on memory (all of SmolLM2's bf16 weights against 8 rows, ad hoc: 16.9 -> 9.3 ms).
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
// (skinny.py's `tiles`) run on the tile unit: one tdpbf16ps multiplies up to 16 rows of x by 32 columns of 16 weight
// rows, and rows 17-32 take a second A tile against the same weight tiles, so the weights are read once for 32 rows
// (all products of SmolLM2-135M's layers over 32 rows, ad hoc: 16.1 ms as two products of 16, 11.5 ms as one).
// Tile A is x itself (up to 16 rows, stride K), tile B 16 weight rows' 32 columns as column pairs, 1 KB contiguous
// in the copy ([N/16][K/32][16 pairs][16 rows][2]), so the weights stream from memory in order and a few tiles
// ahead are asked for; tile C holds the M x 16 float32 sums, one x row's 16 outputs per C row, stored with vector
// instructions. Every output sums its 32-column chunks in order whatever M, so a row's result does not depend on
// the rows beside it (within 2-32 rows; one row rounds as vdpbf16ps sums). Measured on a 2-core Xeon with AMX (ad
// hoc, all products of SmolLM2-135M's layers, bf16, medians of 15, two runs each): 4 rows 7.2 ms, 8 rows 8.0 ms,
// 16 rows 8.0-8.6 ms, where tiles reading the weight rows in place took 11.5, 11.5 and 13.5 ms, and vdpbf16ps
// takes 7.1-7.5 ms for one row. Whole forwards (fused_layers.cpp with the LM head, after 300 cached tokens,
// vdpbf16ps and tiles interleaved, medians of 80, two runs): 2 tokens 12.4 -> 11.9-12.2 ms, but 1 token 10.6 ->
// 11.5 ms, so one row stays on vdpbf16ps.
#include "amx.h"

static const int64_t AMX_ROWS = 32;  // weight rows per block: two B tiles of 16
static const int64_t AHEAD = 4;  // tiles asked for ahead
static const int64_t AMX_MIN_ROWS = 2;  // one row stays on vdpbf16ps (see above)

static const int64_t AMX_MAX_ROWS = 32;  // rows of x per weight pass: two A tiles of 16

// Tiles 0-1: sums C of x rows 0-15 (16 floats each, for weight tiles 4 and 5), 2-3: of x rows 16-31; 4-5: weights B
// (16 column pairs x 16 rows); 6-7: x A (rows 0-15 and 16-31, 32 bf16 each). Tiles of absent rows stay empty.
static void configure_tiles(int64_t M) {
  const int64_t first = M < 16 ? M : 16, second = M - first;
  const int64_t rows[8] = {first, first, second, second, 16, 16, first, second};
  TileConfig c = {};
  c.palette = 1;
  for (int t = 0; t < 8; t++) {
    c.rows[t] = (uint8_t)rows[t];
    c.colsb[t] = rows[t] ? 64 : 0;
  }
  _tile_loadconfig(&c);
}

// y rows m0 .. m0 + rows - 1, weight rows n .. n+31, from their sums (two tiles' worth: [2][16][16]).
static void store_sums(float (*sums)[16][16], const bf16* b, bf16* y, int64_t rows, int64_t N, int64_t n, int64_t m0) {
  for (int64_t j = 0; j < rows; j++)
    for (int h = 0; h < 2; h++) {
      const int64_t at = n + 16 * h;
      const vec s = vload(sums[h][j]);
      vput(y + (m0 + j) * N + at, vround(b ? vadd(s, vload(b + at)) : s, y));
    }
}

// Weight rows n .. n+31 (wt: the packed copy) against all M rows of x (at most 32); K is a multiple of 32.
static void block_amx(const bf16* x, const bf16* wt, const bf16* b, bf16* y, int64_t M, int64_t N, int64_t K,
                      int64_t n) {
  const bool two = M > 16;  // a second A tile: x rows 16 ..
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t chunks = K / 32;
  const bf16* w0 = wt + (n / 16) * chunks * 512;
  const bf16* w1 = w0 + chunks * 512;
  for (int64_t c = 0; c < chunks; c++) {
    for (int64_t line = 0; line < 512; line += 32) {  // prefetching past the end is harmless
      _mm_prefetch((const char*)(w0 + (c + AHEAD) * 512 + line), _MM_HINT_T0);
      _mm_prefetch((const char*)(w1 + (c + AHEAD) * 512 + line), _MM_HINT_T0);
    }
    _tile_loadd(4, w0 + c * 512, 64);
    _tile_loadd(5, w1 + c * 512, 64);
    _tile_loadd(6, x + c * 32, K * 2);
    _tile_dpbf16ps(0, 6, 4);
    _tile_dpbf16ps(1, 6, 5);
    if (two) {
      _tile_loadd(7, x + 16 * K + c * 32, K * 2);
      _tile_dpbf16ps(2, 7, 4);
      _tile_dpbf16ps(3, 7, 5);
    }
  }
  float sums[2][16][16];
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  store_sums(sums, b, y, M < 16 ? M : 16, N, n, 0);
  if (two) {
    _tile_stored(2, sums[0], 64);
    _tile_stored(3, sums[1], 64);
    store_sums(sums, b, y, M - 16, N, n, 16);
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

// Whether whole blocks of bf16 weight rows take the AMX tiles: a packed copy given (wt), AMX_MIN_ROWS..32 rows,
// compiled in and granted by Linux; float32 products, and CPUs without AMX, never do.
struct Tiles {
  bool on = false;
  int64_t M = 0;
  const bf16* wt = nullptr;
  Tiles(const float*, const void*, int64_t) {}
  Tiles(const bf16*, const void* packed, int64_t rows) : M(rows), wt((const bf16*)packed) {
#ifdef SKINNY_AMX
    static_assert(BLOCK == AMX_ROWS, "a work item is one AMX block");
    on = wt && M >= AMX_MIN_ROWS && M <= AMX_MAX_ROWS && amx_permitted();
#endif
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
  void block(const float*, const W&, const float*, float*, int64_t, int64_t, int64_t) const {}
  void block(const bf16* x, const Dense<bf16>&, const bf16* b, bf16* y, int64_t N, int64_t K, int64_t n) const {
#ifdef SKINNY_AMX
    block_amx(x, wt, b, y, M, N, K, n);
#else
    (void)x, (void)b, (void)y, (void)N, (void)K, (void)n;
#endif
  }
};

template <typename T, typename W>
static void product(const T* x, const W& w, const void* wt, const T* b, T* y, int64_t M, int64_t N, int64_t K,
                    int threads) {
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
  const Tiles tiles(x, wt, M);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> buffer;
    const float* xf = as_float(x, M * K, buffer);
    tiles.begin();
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
      const int64_t end = blk * BLOCK + BLOCK < N ? blk * BLOCK + BLOCK : N;
      int64_t n = blk * BLOCK;
      if (tiles.on && end - n == BLOCK) {
        tiles.block(x, w, b, y, N, K, n);
        continue;
      }
      for (; n + WROWS <= end; n += WROWS) rows<WROWS>(x, xf, w, b, y, M, N, K, n);
      for (; n < end; n++) rows<1>(x, xf, w, b, y, M, N, K, n);
    }
    tiles.end();
  }
}

extern "C" {
// wt: w packed tile by tile (block_amx), read by bf16 products on AMX; may be null (float32: always null).
void skinny_bf16(const bf16* x, const bf16* w, const bf16* wt, const bf16* b, bf16* y, int64_t M, int64_t N,
                 int64_t K, int threads) {
  product(x, Dense<bf16>{w, K}, wt, b, y, M, N, K, threads);
}
void skinny_f32(const float* x, const float* w, const float*, const float* b, float* y, int64_t M, int64_t N,
                int64_t K, int threads) {
  product(x, Dense<float>{w, K}, nullptr, b, y, M, N, K, threads);
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
  product(x, Q4_1{q, d, m, K}, nullptr, b, y, M, N, K, threads);
}
void skinny_q8_0_f32(const float* x, const int8_t* q, const float* d, const float* b, float* y, int64_t M, int64_t N,
                     int64_t K, int threads) {
  product(x, Q8_0{q, d, K}, nullptr, b, y, M, N, K, threads);
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
