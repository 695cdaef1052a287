// The output side of the decode kernels (gemv.cpp, int4.cpp): rows of partial-sum vectors reduced 16 at a time,
// scaled, biased and stored, with the rows split over the OpenMP threads. Included by both; TARGET is theirs.

#pragma once

#include <immintrin.h>
#include <stdint.h>

#include "nt_abi.h"  // the output kinds OUT_F32, OUT_BF16

// 16 vectors -> one: lane r = the sum of a[r]'s lanes (a transpose tree: 30 shuffles and adds for 16 rows
// instead of 16 separate horizontal sums).
TARGET static inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4], e[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit block: rows 2i, 2i+1, lanes {0,2} and {1,3} summed
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per block: rows 4i..4i+3, that block's four lanes summed
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // blocks {0,1} and {2,3} of c[2i] and c[2i+1] summed
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88), _mm512_shuffle_f32x4(e[0], e[1], 0xdd));
}

// Rounded to bfloat16 (nearest even; NaN stays NaN), 16 values.
TARGET static inline __m256i to_bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}

// Output rows in blocks of 16, split over the OpenMP threads when the product is large enough. tile(n0, v) fills
// the R x M partial-sum vectors of rows n0..n0+R-1 (R divides 16), one(n, v) the M of row n alone (the rows past
// the last whole block); each row's numbers are the same either way. Per block and activation row, the 16 rows'
// vectors are summed at once (sum16), then scaled (per activation row, then per output row, where given), biased
// and stored 16 at a time: at the small models' short rows these per-row steps cost as much as the products.
template <int M, int R, typename Tile, typename One>
TARGET static inline void over_rows(Tile tile, One one, int64_t N, int64_t K, const float* xscale, const float* scale,
                             const float* bias, void* y, int out_kind) {
  static_assert(16 % R == 0, "a block of 16 rows is whole tiles");
  const int64_t blocks = (N + 15) / 16;
  // Small products stay on one thread: waking the pool costs more than their few microseconds of work.
  const bool parallel = (double)N * (double)K * (double)(M + 3) >= (double)(1 << 17);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 v[M][16];
    __m512 t[R * M];
    const int64_t n0 = b * 16;
    const int rows = N - n0 >= 16 ? 16 : (int)(N - n0);
    if (rows == 16) {
      for (int r0 = 0; r0 < 16; r0 += R) {
        tile(n0 + r0, t);
        for (int r = 0; r < R; ++r)
          for (int m = 0; m < M; ++m) v[m][r0 + r] = t[r * M + m];
      }
    } else {
      for (int r = 0; r < 16; ++r) {
        if (r < rows) one(n0 + r, t);
        for (int m = 0; m < M; ++m) v[m][r] = r < rows ? t[m] : _mm512_setzero_ps();
      }
    }
    const __mmask16 mask = rows == 16 ? (__mmask16)0xffff : (__mmask16)((1u << rows) - 1u);
    for (int m = 0; m < M; ++m) {
      __m512 s = sum16(v[m]);
      if (xscale) s = _mm512_mul_ps(s, _mm512_set1_ps(xscale[m]));
      if (scale) s = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(mask, scale + n0));
      if (bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(mask, bias + n0));
      if (out_kind == OUT_F32)
        _mm512_mask_storeu_ps((float*)y + (size_t)m * N + n0, mask, s);
      else
        _mm256_mask_storeu_epi16((uint16_t*)y + (size_t)m * N + n0, mask, to_bf16x16(s));
    }
  }
}
