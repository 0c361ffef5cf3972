// Each row's argmax for greedy decoding (argmax.py): the first index of the row's largest value, a NaN counting as
// larger than any number, as torch.argmax picks. Two passes over the row: its largest value (or its first NaN),
// then the first index holding it.
#include <math.h>
#include <omp.h>

#include "simd.h"

template <typename T>
static int64_t row_argmax(const T* x, int64_t n) {
  vec top = vset(-INFINITY);
  int64_t i = 0;
  bool nan = false;
  for (; i + LANES <= n; i += LANES) {
    const vec v = vload(x + i);
    nan = nan || vnan_mask(v);
    top = vmax(top, v);
  }
  float lanes[LANES], best;
  vstore(lanes, top);
  best = lanes[0];
  for (int l = 1; l < LANES; l++) best = lanes[l] > best ? lanes[l] : best;
  for (; i < n; i++) {
    const float v = widen(x[i]);
    nan = nan || v != v;
    best = v > best ? v : best;
  }
  if (nan) {
    for (i = 0; i < n; i++)
      if (widen(x[i]) != widen(x[i])) return i;
  }
  const vec target = vset(best);
  for (i = 0; i + LANES <= n; i += LANES)
    if (const uint32_t hit = veq_mask(vload(x + i), target)) return i + __builtin_ctz(hit);
  for (; i < n; i++)
    if (widen(x[i]) == best) return i;
  return 0;  // a row of -inf only: its first index
}

template <typename T>
static void argmax(const T* x, int64_t rows, int64_t n, int64_t* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
  for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * n, n);
}

extern "C" {
void argmax_bf16(const bf16* x, int64_t rows, int64_t n, int64_t* out, int threads) { argmax(x, rows, n, out, threads); }
void argmax_f32(const float* x, int64_t rows, int64_t n, int64_t* out, int threads) { argmax(x, rows, n, out, threads); }
}
