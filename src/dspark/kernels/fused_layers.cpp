// A decode or verify forward through every decoder layer in one call (fused_layers.py).
//
// On a small model, model.py's layer loop spends about as long between its products as in them: some twenty
// PyTorch operations a layer, each a dispatch and a pass over a few rows. Here the products are skinny.cpp's and
// the work between them runs in vector loops: RMSNorm, rotary, the KV cache's writes, attention, SiLU and the
// residuals. Every elementwise step rounds to the model dtype where model.py's operations do (bf16: after each
// one), norms and attention compute in float32 as there; only the order of float32 sums (and e^x, within 2 ulp)
// differs, so results match model.py's within rounding. A token's results depend on its own row alone.
#include <math.h>
#include <stdlib.h>
#include <omp.h>

#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"

extern "C" {
void skinny_bf16(const bf16* x, const bf16* w, const bf16* wt, const bf16* b, bf16* y, int64_t M, int64_t N,
                 int64_t K, int threads, int flags);
void skinny_f32(const float* x, const float* w, const float* wt, const float* b, float* y, int64_t M, int64_t N,
                int64_t K, int threads, int flags);
}
enum { FLAG_ONE_ROW_TILES = 1, FLAG_TILE_ATTENTION = 2 };  // flags, as skinny.cpp's
// Products of at most 32 rows (skinny.cpp's tiles read the weights once for them); more rows are products of 32 at
// a time, each row rounded as in any other forward. wt: the weight packed for AMX's tiles (skinny.py's `tiles`), or
// null.
static const int64_t ROWS = 32;
static inline void product(const bf16* x, const void* w, const void* wt, const void* b, bf16* y, int64_t M, int64_t N,
                           int64_t K, int threads, int flags) {
  for (int64_t m = 0; m < M; m += ROWS)
    skinny_bf16(x + m * K, (const bf16*)w, (const bf16*)wt, (const bf16*)b, y + m * N, M - m < ROWS ? M - m : ROWS,
                N, K, threads, flags);
}
static inline void product(const float* x, const void* w, const void*, const void* b, float* y, int64_t M, int64_t N,
                           int64_t K, int threads, int flags) {
  for (int64_t m = 0; m < M; m += ROWS)
    skinny_f32(x + m * K, (const float*)w, nullptr, (const float*)b, y + m * N, M - m < ROWS ? M - m : ROWS, N, K,
               threads, flags);
}

template <typename T>
static inline vec R(vec v) {
  return vround(v, (const T*)nullptr);
}

// e^x (Cephes' expf: x = n ln2 + r, a degree-7 polynomial in r, times 2^n); below about -87.3 it gives 0, above
// about 88.4 infinity, as e^x rounds in float32.
static inline vec vexp(vec x) {
  x = vmin(vmax(x, vset(-88.3762626647949f)), vset(88.3762626647949f));
  const vec n = vfloor(vadd(vmul(x, vset(1.44269504088896341f)), vset(0.5f)));
  const vec r = vsub(vsub(x, vmul(n, vset(0.693359375f))), vmul(n, vset(-2.12194440e-4f)));
  vec p = vset(1.9875691500e-4f);
  p = vadd(vmul(p, r), vset(1.3981999507e-3f));
  p = vadd(vmul(p, r), vset(8.3334519073e-3f));
  p = vadd(vmul(p, r), vset(4.1665795894e-2f));
  p = vadd(vmul(p, r), vset(1.6666665459e-1f));
  p = vadd(vmul(p, r), vset(5.0000001201e-1f));
  p = vadd(vadd(vmul(vmul(p, r), r), r), vset(1.0f));
  return vmul(p, vexp2i(n));
}

// A layer's parameters (fused_layers.py fills them in this order; null where the layer has none).
struct Layer {
  const void *input_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *o_bias, *post_norm, *gate_up, *gate_up_bias, *down,
      *down_bias;
  const void *qkv_tiles, *o_tiles, *gate_up_tiles, *down_tiles;  // the products' packed weights, or null
};

struct Model {
  int64_t layers, d, heads, kv_heads, head_dim, inter;
  float eps;
  const Layer* layer;
};

// y = w * round(x * rsqrt(mean(x^2) + eps)) for each row of n values, as model.RMSNorm (x and y may coincide).
template <typename T>
static void rms_norm(const T* x, const void* weight, T* y, int64_t rows, int64_t n, float eps) {
  const T* w = (const T*)weight;
  for (int64_t r = 0; r < rows; r++, x += n, y += n) {
    vec ss = vzero();
    for (int64_t i = 0; i < n; i += LANES) ss = vfma(vload(x + i), vload(x + i), ss);
    const vec scale = vset(1.0f / sqrtf(vsum(ss) / (float)n + eps));
    for (int64_t i = 0; i < n; i += LANES) vput(y + i, R<T>(vmul(vload(w + i), R<T>(vmul(vload(x + i), scale)))));
  }
}

// x * cos + roll(x, hd / 2) * sin for each of `heads` heads of hd values (model.apply_rotary), in place.
template <typename T>
static void rotary(T* x, const T* cos, const T* sin, int64_t heads, int64_t hd) {
  const int64_t half = hd / 2;
  T rolled[512];
  for (int64_t h = 0; h < heads; h++, x += hd) {
    memcpy(rolled, x + half, half * sizeof(T));
    memcpy(rolled + half, x, half * sizeof(T));
    for (int64_t i = 0; i < hd; i += LANES)
      vput(x + i, R<T>(vadd(R<T>(vmul(vload(x + i), vload(cos + i))), R<T>(vmul(vload(rolled + i), vload(sin + i))))));
  }
}

// The keys (or values) a token reads, rows 0 .. n - 1 of hd values each: the first `split` in place in the cache, the
// rest gathered (a draft tree's visible nodes among the last keys its bits can hide).
template <typename T>
struct Rows {
  const T* head;
  int64_t split;
  const T* tail;
  int64_t hd;
  const T* operator()(int64_t j) const { return j < split ? head + j * hd : tail + (j - split) * hd; }
};

// Scores s[r][j] = q_r k_j * scale of NR query rows (q: hd floats each) over keys 0 .. L-1: each key is widened
// once for all rows, and four keys' sums reduce in one tree (vsum4); keys past the last whole four reduce alone.
template <int NR, typename T>
static void scores(const float* q, const Rows<T>& keys, int64_t L, int64_t hd, float scale, float* s, int64_t stride) {
  int64_t j = 0;
  for (; j + 4 <= L; j += 4) {
    vec acc[NR][4];
    for (int r = 0; r < NR; r++)
      for (int i = 0; i < 4; i++) acc[r][i] = vzero();
    for (int64_t d = 0; d < hd; d += LANES) {
      vec k[4];
      for (int i = 0; i < 4; i++) k[i] = vload(keys(j + i) + d);
      for (int r = 0; r < NR; r++) {
        const vec qv = vload(q + r * hd + d);
        for (int i = 0; i < 4; i++) acc[r][i] = vfma(qv, k[i], acc[r][i]);
      }
    }
    for (int r = 0; r < NR; r++) {
      float four[4];
      vsum4(acc[r], 1, four);
      for (int i = 0; i < 4; i++) s[r * stride + j + i] = four[i] * scale;
    }
  }
  for (; j < L; j++)
    for (int r = 0; r < NR; r++) {
      vec acc = vzero();
      for (int64_t d = 0; d < hd; d += LANES) acc = vfma(vload(q + r * hd + d), vload(keys(j) + d), acc);
      s[r * stride + j] = vsum(acc) * scale;
    }
}

// out_r = sum_j p[r][j] v_j / sum[r] for NR rows, rounded once; each value vector is widened once for all rows.
template <int NR, typename T>
static void weigh(const float* p, const float* sum, const Rows<T>& values, int64_t L, int64_t hd, T* out, int64_t stride) {
  for (int64_t d = 0; d < hd; d += LANES) {
    vec acc[NR];
    for (int r = 0; r < NR; r++) acc[r] = vzero();
    for (int64_t j = 0; j < L; j++) {
      const vec v = vload(values(j) + d);
      for (int r = 0; r < NR; r++) acc[r] = vfma(vset(p[r * stride + j]), v, acc[r]);
    }
    for (int r = 0; r < NR; r++) vput(out + r * hd + d, R<T>(vdiv(acc[r], vset(sum[r]))));
  }
}

// Scores of the keys a draft tree hides from a token: bit j of `hidden` hides key L - 1 - j (the nodes before the
// token that are not its ancestors; 0 for a chain), which then weigh exactly 0, as keys past L do.
static inline void hide_keys(float* s, int64_t L, uint64_t hidden) {
  for (; hidden; hidden &= hidden - 1) s[L - 1 - __builtin_ctzll(hidden)] = -INFINITY;
}

// NR query rows (q: their hd values each) over the L keys and values of their KV head, into out (NR rows of hd):
// softmax(q k / sqrt(hd)) v in float32, rounded once, without the keys `hidden` hides (hide_keys). s: scratch of NR
// rows of L rounded up to LANES floats.
template <int NR, typename T>
static void attend_rows(const T* q, const Rows<T>& keys, const Rows<T>& values, int64_t L, uint64_t hidden, int64_t hd, T* out,
                        float* s) {
  const int64_t padded = (L + LANES - 1) / LANES * LANES;
  float qf[NR * 512], sum[NR];
  for (int64_t i = 0; i < NR * hd; i++) qf[i] = widen(q[i]);
  scores<NR>(qf, keys, L, hd, 1.0f / sqrtf((float)hd), s, padded);
  for (int r = 0; r < NR; r++) {
    float* sr = s + r * padded;
    for (int64_t j = L; j < padded; j++) sr[j] = -INFINITY;  // e^-inf: 0
    hide_keys(sr, L, hidden);
    vec top = vset(-INFINITY);
    for (int64_t j = 0; j < padded; j += LANES) top = vmax(top, vload(sr + j));
    float most = -INFINITY;
    float lanes[LANES];
    vstore(lanes, top);
    for (int i = 0; i < LANES; i++) most = lanes[i] > most ? lanes[i] : most;
    vec total = vzero();
    for (int64_t j = 0; j < padded; j += LANES) {
      const vec e = vexp(vsub(vload(sr + j), vset(most)));
      vstore(sr + j, e);
      total = vadd(total, e);
    }
    sum[r] = vsum(total);
  }
  weigh<NR>(s, sum, values, L, hd, out, padded);
}

// Query heads g0 .. g0 + G - 1 of one token (q: its H heads, out: its H * hd outputs), four at a time. A token of a
// draft tree (hidden: the earlier nodes that are not its ancestors) reads its visible keys gathered in order, so
// they sit where the same token decoded alone finds them (its ancestors right after the prefix) and every sum runs
// as there: hiding keys in place would move them to other lanes of the sums.
template <typename T>
static void attend(const T* q, const T* keys, const T* values, int64_t L, uint64_t hidden, int64_t g0, int64_t G,
                   int64_t hd, T* out, float* s) {
  Rows<T> k{keys, L, nullptr, hd}, v{values, L, nullptr, hd};
  std::vector<T> seen;  // the visible keys and values after `split`, gathered
  if (hidden) {
    const int64_t split = L > 63 ? L - 63 : 0;  // keys before it are never hidden (bits 1..62)
    seen.reserve(2 * (L - split) * hd);
    for (int64_t pass = 0; pass < 2; pass++)
      for (int64_t j = split; j < L; j++)
        if (!(hidden >> (L - 1 - j) & 1)) {  // hide_keys' numbering
          const T* row = (pass ? values : keys) + j * hd;
          seen.insert(seen.end(), row, row + hd);
        }
    const int64_t kept = (int64_t)seen.size() / (2 * hd);
    k = {keys, split, seen.data(), hd}, v = {values, split, seen.data() + kept * hd, hd};
    L = split + kept, hidden = 0;
  }
  for (int64_t g = g0; g < g0 + G; g += 4) {
    const T* qg = q + g * hd;
    T* og = out + g * hd;
    switch (g0 + G - g < 4 ? g0 + G - g : 4) {
      case 1: attend_rows<1>(qg, k, v, L, hidden, hd, og, s); break;
      case 2: attend_rows<2>(qg, k, v, L, hidden, hd, og, s); break;
      case 3: attend_rows<3>(qg, k, v, L, hidden, hd, og, s); break;
      default: attend_rows<4>(qg, k, v, L, hidden, hd, og, s); break;
    }
  }
}

#include "tile_attention.h"

// y = round(x + a), elementwise over n values.
template <typename T>
static void residual(T* x, const T* a, int64_t n) {
  for (int64_t i = 0; i < n; i += LANES) vput(x + i, R<T>(vadd(vload(x + i), vload(a + i))));
}

// act = silu(gate) * up for each row of gate_up = [gate | up] (F values each), rounded as F.silu(gate) * up.
template <typename T>
static void silu_mul(const T* gate_up, T* act, int64_t rows, int64_t F, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
  for (int64_t r = 0; r < rows; r++)
    for (int64_t i = 0; i < F; i += LANES) {
      const vec g = vload(gate_up + r * 2 * F + i);
      const vec silu = R<T>(vdiv(g, vadd(vset(1.0f), vexp(vsub(vzero(), g)))));
      vput(act + r * F + i, R<T>(vmul(silu, vload(gate_up + r * 2 * F + F + i))));
    }
}

// x [T, d]: the tokens' embeddings in, their last layer's outputs out. Token t sits at position pos[t] of cache
// slot slot[t] and reads that slot's keys 0 .. visible[t] but those hidden[t] hides (hide_keys; hidden may be null:
// none); cos and sin [T, hd] are its rotary tables. The keys
// and values [layers, slots, kv_heads, capacity, hd] are written before attention reads them. Layer l's outputs
// are copied to features[:, capture[l] * d ...] (row width `width`) where capture[l] >= 0.
template <typename T>
static void forward(const Model& m, int64_t n, const int64_t* slot, const int64_t* pos, const int64_t* visible,
                    const int64_t* hidden, T* kc, T* vc, int64_t slots, int64_t capacity, T* x, const T* cos, const T* sin, T* features,
                    const int64_t* capture, int64_t width, int threads, int flags) {
  const int64_t d = m.d, H = m.heads, KVH = m.kv_heads, hd = m.head_dim, F = m.inter, G = H / KVH;
  const int64_t QKV = (H + 2 * KVH) * hd;
  int64_t keys = 0;
  for (int64_t t = 0; t < n; t++) keys = visible[t] + 1 > keys ? visible[t] + 1 : keys;
  keys = (keys + LANES - 1) / LANES * LANES;
  std::vector<T> h(n * d), qkv(n * QKV), att(n * H * hd), gate_up(n * 2 * F), act(n * F), out(n * d);
  std::vector<float> scratch(threads * 4 * keys);
  std::vector<std::pair<int64_t, int64_t>> runs;  // tile attention's items: (first token, tokens) of one slot
#ifdef TILE_ATTENTION
  // only where the layers' products have packed copies (tiles on) and the flag asks for it
  if (std::is_same<T, bf16>::value && tile_attention::fits(hd, G) && (flags & FLAG_TILE_ATTENTION) &&
      m.layer[0].qkv_tiles)
    for (int64_t t = 0; t < n; t++)
      if (runs.empty() || slot[t] != slot[runs.back().first] || (runs.back().second + 1) * G > tile_attention::ROWS)
        runs.push_back({t, 1});
      else
        runs.back().second++;
#endif
  for (int64_t l = 0; l < m.layers; l++) {
    const Layer& w = m.layer[l];
    rms_norm(x, w.input_norm, h.data(), n, d, m.eps);
    product(h.data(), w.qkv, w.qkv_tiles, w.qkv_bias, qkv.data(), n, QKV, d, threads, flags);
#pragma omp parallel num_threads(threads)
    {
      // work item (t, kh): token t's query heads of KV head kh, normed and rotated, and that head's key (normed,
      // rotated) and value written to the cache; then, once every item's are (the barrier after the first
      // loop), the same query heads' attention
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n * KVH; i++) {
        const int64_t t = i / KVH, kh = i % KVH;
        T *q = qkv.data() + t * QKV + kh * G * hd, *k = qkv.data() + t * QKV + (H + kh) * hd;
        if (w.q_norm) {
          rms_norm(q, w.q_norm, q, G, hd, m.eps);
          rms_norm(k, w.k_norm, k, 1, hd, m.eps);
        }
        rotary(q, cos + t * hd, sin + t * hd, G, hd);
        rotary(k, cos + t * hd, sin + t * hd, 1, hd);
        const int64_t at = (((l * slots + slot[t]) * KVH + kh) * capacity + pos[t]) * hd;
        memcpy(kc + at, k, hd * sizeof(T));
        memcpy(vc + at, qkv.data() + t * QKV + (H + KVH + kh) * hd, hd * sizeof(T));
      }
#ifdef TILE_ATTENTION
      if (runs.size()) {  // bf16 on AMX: the G heads of up to 16 / G tokens of a request at a time
        tile_attention::configure();
#pragma omp for schedule(static)
        for (int64_t i = 0; i < (int64_t)runs.size() * KVH; i++) {  // head by head: a thread reads fewer heads
          const int64_t kh = i / runs.size(), t = runs[i % runs.size()].first, tokens = runs[i % runs.size()].second;
          const int64_t at = ((l * slots + slot[t]) * KVH + kh) * capacity * hd;
          int64_t limit[tile_attention::ROWS];
          uint64_t hides[tile_attention::ROWS];
          for (int64_t k = 0; k < tokens; k++) limit[k] = visible[t + k] + 1, hides[k] = hidden ? hidden[t + k] : 0;
          if (tokens == 1)  // G rows alone: the vector loops are as fast
            attend(qkv.data() + t * QKV, kc + at, vc + at, limit[0], hides[0], kh * G, G, hd, att.data() + t * H * hd,
                   scratch.data() + omp_get_thread_num() * 4 * keys);
          else
            tile_attention::attend((const bf16*)qkv.data() + t * QKV, QKV, (const bf16*)kc + at, (const bf16*)vc + at,
                                   limit, hides, tokens, G, kh * G, hd, (bf16*)att.data() + t * H * hd, H * hd);
        }
        _tile_release();
      } else
#endif
      {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n * KVH; i++) {
          const int64_t t = i / KVH, kh = i % KVH, at = ((l * slots + slot[t]) * KVH + kh) * capacity * hd;
          attend(qkv.data() + t * QKV, kc + at, vc + at, visible[t] + 1, hidden ? hidden[t] : 0, kh * G, G, hd,
                 att.data() + t * H * hd, scratch.data() + omp_get_thread_num() * 4 * keys);
        }
      }
    }
    product(att.data(), w.o, w.o_tiles, w.o_bias, out.data(), n, d, H * hd, threads, flags);
    residual(x, out.data(), n * d);
    rms_norm(x, w.post_norm, h.data(), n, d, m.eps);
    product(h.data(), w.gate_up, w.gate_up_tiles, w.gate_up_bias, gate_up.data(), n, 2 * F, d, threads, flags);
    silu_mul(gate_up.data(), act.data(), n, F, threads);
    product(act.data(), w.down, w.down_tiles, w.down_bias, out.data(), n, d, F, threads, flags);
    residual(x, out.data(), n * d);
    if (capture[l] >= 0)
      for (int64_t t = 0; t < n; t++) memcpy(features + t * width + capture[l] * d, x + t * d, d * sizeof(T));
  }
}

template <typename T>
static void attend_tokens(const T* q, const T* kc, const T* vc, int64_t l, int64_t slots, int64_t capacity,
                          const int64_t* slot, const int64_t* visible, const int64_t* hidden, int64_t n, int64_t H,
                          int64_t KVH, int64_t hd, T* out, int threads) {
  const int64_t G = H / KVH;
  int64_t keys = 0;
  for (int64_t t = 0; t < n; t++) keys = visible[t] + 1 > keys ? visible[t] + 1 : keys;
  keys = (keys + LANES - 1) / LANES * LANES;
  std::vector<float> scratch(threads * 4 * keys);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n * KVH; i++) {
    const int64_t t = i / KVH, kh = i % KVH, at = ((l * slots + slot[t]) * KVH + kh) * capacity * hd;
    attend(q + t * H * hd, kc + at, vc + at, visible[t] + 1, hidden ? hidden[t] : 0, kh * G, G, hd, out + t * H * hd,
           scratch.data() + omp_get_thread_num() * 4 * keys);
  }
}

extern "C" {
void fused_layers_bf16(const Model* m, int64_t n, const int64_t* slot, const int64_t* pos, const int64_t* visible,
                       const int64_t* hidden, bf16* kc, bf16* vc, int64_t slots, int64_t capacity, bf16* x, const bf16* cos, const bf16* sin,
                       bf16* features, const int64_t* capture, int64_t width, int threads, int flags) {
  forward(*m, n, slot, pos, visible, hidden, kc, vc, slots, capacity, x, cos, sin, features, capture, width, threads,
          flags);
}
void fused_layers_f32(const Model* m, int64_t n, const int64_t* slot, const int64_t* pos, const int64_t* visible,
                      const int64_t* hidden, float* kc, float* vc, int64_t slots, int64_t capacity, float* x, const float* cos,
                      const float* sin, float* features, const int64_t* capture, int64_t width, int threads,
                      int flags) {
  forward(*m, n, slot, pos, visible, hidden, kc, vc, slots, capacity, x, cos, sin, features, capture, width, threads,
          flags);
}

// Attention of model.py's layer loop where the contract of exactness holds (Options.exact): n tokens' queries q
// [n, H, hd] (already normed and rotated) over layer l's cached keys and values (written first), each token alone on
// the vector loops above, as fused forwards attend; out [n, H, hd].
void attend_tokens_bf16(const bf16* q, const bf16* kc, const bf16* vc, int64_t l, int64_t slots, int64_t capacity,
                        const int64_t* slot, const int64_t* visible, const int64_t* hidden, int64_t n, int64_t H,
                        int64_t KVH, int64_t hd, bf16* out, int threads) {
  attend_tokens(q, kc, vc, l, slots, capacity, slot, visible, hidden, n, H, KVH, hd, out, threads);
}
void attend_tokens_f32(const float* q, const float* kc, const float* vc, int64_t l, int64_t slots, int64_t capacity,
                       const int64_t* slot, const int64_t* visible, const int64_t* hidden, int64_t n, int64_t H,
                       int64_t KVH, int64_t hd, float* out, int threads) {
  attend_tokens(q, kc, vc, l, slots, capacity, slot, visible, hidden, n, H, KVH, hd, out, threads);
}
}
