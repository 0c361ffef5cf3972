// Few-row products y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for decode and verify forwards (skinny.py).
//
// Each thread streams its share of the weight rows once for all rows of x: a tile is two weight rows (AVX2) or
// four (AVX-512) against up to four rows of x, in float32 with fused multiply-adds, or with vdpbf16ps on bf16
// pairs where the CPU has AVX-512 BF16. Every output's sum runs in one order whatever the number of rows (one
// vector accumulator over k, then the same lane-sum tree, scalar tail and bias), so a row's result never depends
// on the other rows of the product. bf16 values are widened exactly and results rounded to nearest-even, as
// PyTorch rounds.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "skinny.cpp needs AVX2 and FMA"
#endif

typedef uint16_t bf16;

#if defined(__AVX512F__)
typedef __m512 vec;  // float32 lanes
static const int LANES = 16;
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vload(const bf16* p) {
  __m256i h = _mm256_loadu_si256((const __m256i*)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
// The lane sums of four vectors at once (one tree for all four, the same whichever four they are).
static inline void vsum4(const vec* v, int stride, float* out) {
  vec ab = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[stride]), _mm512_unpackhi_ps(v[0], v[stride]));
  vec cd = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * stride], v[3 * stride]),
                         _mm512_unpackhi_ps(v[2 * stride], v[3 * stride]));
  vec abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  __m256 s = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}
#else
typedef __m256 vec;
static const int LANES = 8;
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vload(const bf16* p) {
  __m128i h = _mm_loadu_si128((const __m128i*)p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

static inline float widen(float v) { return v; }
static inline float widen(bf16 v) {
  uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline void narrow(float v, float* p) { *p = v; }
static inline void narrow(float v, bf16* p) {
  uint32_t u;
  memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *p = (bf16)((u >> 16) | 0x40);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = (bf16)(u >> 16);
}

// Asks for the same columns of the next tile's weight rows while this tile multiplies: without it, tiles of
// several input rows wait on memory (all of SmolLM2's bf16 weights against 8 rows, ad hoc: 16.9 -> 9.3 ms).
template <int NR, typename T>
static inline void prefetch_next(const T* w, int64_t K, int64_t n, int64_t k) {
  for (int i = 0; i < NR; i++) _mm_prefetch((const char*)(w + (n + NR + i) * K + k), _MM_HINT_T0);
}

// A tile's outputs: the lane sums of its accumulators, then the scalar tail k .. K-1 and the bias, rounded into y.
template <int NR, int MR, typename X, typename T>
static inline void finish(vec (&acc)[NR][MR], const X* x, const T* w, const T* b, T* y, int64_t N, int64_t K,
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
    for (int j = 0; j < MR; j++) {
      float s = sums[i][j];
      for (int64_t t = k; t < K; t++) s += widen(w[(n + i) * K + t]) * widen(x[(m + j) * K + t]);
      if (b) s += widen(b[n + i]);
      narrow(s, y + (m + j) * N + n + i);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// With AVX-512 BF16, bf16 products take 32 products per instruction (vdpbf16ps sums each adjacent pair with the
// accumulator lane), on the bf16 rows themselves; x is the bf16 input here, not its float32 copy.
template <int NR, int MR>
static inline void tile_bf16(const bf16* x, const bf16* w, const bf16* b, bf16* y, int64_t N, int64_t K, int64_t n,
                             int64_t m) {
  __m512 acc[NR][MR];
  for (int i = 0; i < NR; i++)
    for (int j = 0; j < MR; j++) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512i wv[NR];
    for (int i = 0; i < NR; i++) wv[i] = _mm512_loadu_si512(w + (n + i) * K + k);
    prefetch_next<NR>(w, K, n, k);
    for (int j = 0; j < MR; j++) {
      __m512i xv = _mm512_loadu_si512(x + (m + j) * K + k);
      for (int i = 0; i < NR; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[i]);
    }
  }
  finish<NR, MR>(acc, x, w, b, y, N, K, k, n, m);
}
#endif

// Weight rows n .. n+NR-1 against float32 rows m .. m+MR-1 of xf [M, K]; writes y[m + j, n + i].
template <int NR, int MR, typename T>
static inline void tile(const float* xf, const T* w, const T* b, T* y, int64_t N, int64_t K, int64_t n, int64_t m) {
  vec acc[NR][MR];
  for (int i = 0; i < NR; i++)
    for (int j = 0; j < MR; j++) acc[i][j] = vzero();
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    vec wv[NR];
    for (int i = 0; i < NR; i++) wv[i] = vload(w + (n + i) * K + k);
    prefetch_next<NR>(w, K, n, k);
    for (int j = 0; j < MR; j++) {
      vec xv = vload(xf + (m + j) * K + k);
      for (int i = 0; i < NR; i++) acc[i][j] = vfma(wv[i], xv, acc[i][j]);
    }
  }
  finish<NR, MR>(acc, xf, w, b, y, N, K, k, n, m);
}

// One tile: bf16 on AVX-512 BF16 multiplies the bf16 rows x; otherwise the float32 rows xf.
template <int NR, int MR>
static inline void block(const float*, const float* xf, const float* w, const float* b, float* y, int64_t N,
                         int64_t K, int64_t n, int64_t m) {
  tile<NR, MR>(xf, w, b, y, N, K, n, m);
}
template <int NR, int MR>
static inline void block(const bf16* x, const float* xf, const bf16* w, const bf16* b, bf16* y, int64_t N,
                         int64_t K, int64_t n, int64_t m) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  tile_bf16<NR, MR>(x, w, b, y, N, K, n, m);
#else
  tile<NR, MR>(xf, w, b, y, N, K, n, m);
#endif
}

template <int NR, typename T>
static inline void rows(const T* x, const float* xf, const T* w, const T* b, T* y, int64_t M, int64_t N, int64_t K,
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

template <typename T>
static void product(const T* x, const T* w, const T* b, T* y, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> buffer;
    const float* xf = as_float(x, M * K, buffer);
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
      const int64_t end = blk * BLOCK + BLOCK < N ? blk * BLOCK + BLOCK : N;
      int64_t n = blk * BLOCK;
      for (; n + WROWS <= end; n += WROWS) rows<WROWS>(x, xf, w, b, y, M, N, K, n);
      for (; n < end; n++) rows<1>(x, xf, w, b, y, M, N, K, n);
    }
  }
}

extern "C" {
void skinny_bf16(const bf16* x, const bf16* w, const bf16* b, bf16* y, int64_t M, int64_t N, int64_t K, int threads) {
  product(x, w, b, y, M, N, K, threads);
}
void skinny_f32(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t N, int64_t K,
                int threads) {
  product(x, w, b, y, M, N, K, threads);
}
}
