// SIMD primitives shared by skinny.cpp and fused_layers.cpp: float32 vectors of LANES lanes (AVX-512 or AVX2),
// bf16 widened exactly and rounded to nearest-even as PyTorch rounds.
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

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
static inline vec vset(float v) { return _mm512_set1_ps(v); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vfloor(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline vec vexp2i(vec n) {  // 2^n for whole n in -126 .. 127
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
static inline uint32_t veq_mask(vec a, vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }  // lane i: bit i
static inline uint32_t vnan_mask(vec a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
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
static inline vec vset(float v) { return _mm256_set1_ps(v); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
static inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec vfloor(vec a) { return _mm256_floor_ps(a); }
static inline vec vexp2i(vec n) {  // 2^n for whole n in -126 .. 127
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline uint32_t veq_mask(vec a, vec b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
static inline uint32_t vnan_mask(vec a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
static inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline void vsum4(const vec* v, int stride, float* out) {
  for (int i = 0; i < 4; i++) out[i] = vsum(v[i * stride]);
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

// v rounded to the dtype T (bf16: to nearest-even), still as float32 lanes; vput stores rounded lanes as T.
static inline vec vround(vec v, const float*) { return v; }
static inline void vput(float* p, vec v) { vstore(p, v); }
#if defined(__AVX512F__)
static inline vec vround(vec v, const bf16*) {
  __m512i u = _mm512_castps_si512(v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline void vput(bf16* p, vec v) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
#else
static inline vec vround(vec v, const bf16*) {
  __m256i u = _mm256_castps_si256(v);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
}
static inline void vput(bf16* p, vec v) {
  __m256i s = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
}
#endif
