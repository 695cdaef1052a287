// Weight-only 4-bit products for decode: y (M, N) = x (M, K) @ W (N, K)^T (+ bias), W in groups of 32 columns,
// each group with its own float16 scale (Q4_0's scheme: q in [-8, 7], w ~= q * d).
//
// Storage (built by nexttoken/model/int4.py): K is padded with zero weights to Kp, a multiple of 64. Row n holds
// Kp/2 bytes; its 64-column chunk c is the 32 bytes [32c, 32c + 32): byte j keeps column 64c + j in its low
// nibble and column 64c + 32 + j in its high nibble, each as q + 8 (0..15). Scales: (N, Kp/32) float16.
// So one 256-bit load gives two whole groups: the low nibbles are group 2c in order, the high nibbles group 2c+1.
//
// The product: each activation row is quantized to int16 with one scale per row (relative error <= 2^-16, far
// below the weights' own), the nibbles are widened to int16 and multiplied with VNNI's vpdpwssd (32 products
// summed pairwise into 16 int32 lanes: one group per instruction), and each group's int32 sums are moved to
// float32 and scaled by the group's scale with an FMA. A weight costs half a byte of memory traffic plus
// 9/256 bytes of scale: 4.5 bits, the same as llama.cpp's Q4_0.
//
// Prefill dequantizes blocks of rows into float32/bfloat16 (nt_dequantize_i4) for torch's GEMM.

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define TARGET_I4 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))

namespace {

enum { OUT_F32 = 0, OUT_BF16 = 1 };

inline uint16_t to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// Two groups (64 columns) of one weight row as int16 q values: lo = group 2c, hi = group 2c + 1.
TARGET_I4 inline void unpack(const uint8_t* chunk, __m512i& lo, __m512i& hi) {
  const __m256i v = _mm256_loadu_si256((const __m256i*)chunk);
  const __m256i nib = _mm256_set1_epi8(0x0f);
  const __m512i eight = _mm512_set1_epi16(8);
  lo = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(v, nib)), eight);
  hi = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib)), eight);
}

// R weight rows x M activation rows: out[r * M + m] = sum over groups of scale * (q . xq), xq's scale not applied.
template <int M, int R>
TARGET_I4 void tile(const uint8_t* W, const uint16_t* S, const int16_t* xq, int64_t Kp, int64_t n0, float* out) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t row_bytes = Kp / 2, groups = Kp / 32;
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t c = 0; c < Kp; c += 64) {
    __m512i xa[M], xb[M];
    for (int m = 0; m < M; ++m) {
      xa[m] = _mm512_loadu_si512((const void*)(xq + (size_t)m * Kp + c));
      xb[m] = _mm512_loadu_si512((const void*)(xq + (size_t)m * Kp + c + 32));
    }
    const int64_t g = c / 32;
    for (int r = 0; r < R; ++r) {
      const size_t n = (size_t)(n0 + r);
      __m512i lo, hi;
      unpack(W + n * row_bytes + c / 2, lo, hi);
      const __m512 sa = _mm512_set1_ps(_cvtsh_ss(S[n * groups + g]));
      const __m512 sb = _mm512_set1_ps(_cvtsh_ss(S[n * groups + g + 1]));
      for (int m = 0; m < M; ++m) {
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpwssd_epi32(zero, lo, xa[m])), sa, acc[r][m]);
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpwssd_epi32(zero, hi, xb[m])), sb, acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) out[r * M + m] = _mm512_reduce_add_ps(acc[r][m]);
}

// Output rows in groups of R (the last few one by one), split over the OpenMP threads when large enough; each
// sum is scaled by its activation row's scale, biased, and stored as float32 or bfloat16.
template <int M, int R>
TARGET_I4 void run(const uint8_t* W, const uint16_t* S, const int16_t* xq, const float* xscale, const float* bias,
                   int64_t N, int64_t Kp, void* y, int out_kind) {
  const int64_t blocks = N / R;
  const bool parallel = (double)N * (double)Kp * (double)(M + 3) >= (double)(1 << 20);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t b = 0; b <= blocks; ++b) {
    float sums[R * M];
    const int64_t n0 = b * R;
    const int rows = b < blocks ? R : (int)(N - n0);
    if (rows == 0) continue;
    if (rows == R)
      tile<M, R>(W, S, xq, Kp, n0, sums);
    else
      for (int r = 0; r < rows; ++r) tile<M, 1>(W, S, xq, Kp, n0 + r, sums + r * M);
    for (int r = 0; r < rows; ++r)
      for (int m = 0; m < M; ++m) {
        const int64_t n = n0 + r;
        float v = sums[r * M + m] * xscale[m];
        if (bias) v += bias[n];
        if (out_kind == OUT_F32)
          ((float*)y)[(size_t)m * N + n] = v;
        else
          ((uint16_t*)y)[(size_t)m * N + n] = to_bf16(v);
      }
  }
}

typedef void (*kernel_fn)(const uint8_t*, const uint16_t*, const int16_t*, const float*, const float*, int64_t,
                          int64_t, void*, int);

kernel_fn pick(int M) {
  switch (M) {
    case 1: return run<1, 4>;
    case 2: return run<2, 4>;
    case 3: return run<3, 2>;
    case 4: return run<4, 2>;
    case 5: return run<5, 1>;
    case 6: return run<6, 1>;
    case 7: return run<7, 1>;
    case 8: return run<8, 1>;
    default: return 0;
  }
}

// x (M, K) float32 -> xq (M, Kp) int16, zero padded, with one scale per row (amax / 32767).
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, int16_t* xq, float* xscale) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + (size_t)m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = row[k] > amax ? row[k] : (-row[k] > amax ? -row[k] : amax);
    const float s = amax > 0.f ? amax / 32767.f : 1.f;
    const float inv = 1.f / s;
    xscale[m] = s;
    int16_t* q = xq + (size_t)m * Kp;
    for (int64_t k = 0; k < K; ++k) q[k] = (int16_t)__builtin_lrintf(row[k] * inv);
    for (int64_t k = K; k < Kp; ++k) q[k] = 0;
  }
}

TARGET_I4 void dequant_row(const uint8_t* W, const uint16_t* S, int64_t K, int64_t Kp, void* out, int out_kind) {
  for (int64_t c = 0; c < Kp; c += 64) {
    __m512i lo, hi;
    unpack(W + c / 2, lo, hi);
    const __m512i halves[2] = {lo, hi};
    for (int h = 0; h < 2; ++h) {
      const __m512 s = _mm512_set1_ps(_cvtsh_ss(S[c / 32 + h]));
      for (int q = 0; q < 2; ++q) {  // 16 columns at a time
        const int64_t k = c + 32 * h + 16 * q;
        if (k >= K) break;
        const __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1u);
        const __m256i part = q ? _mm512_extracti64x4_epi64(halves[h], 1) : _mm512_castsi512_si256(halves[h]);
        const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(part)), s);
        if (out_kind == OUT_F32) {
          _mm512_mask_storeu_ps((float*)out + k, m, v);
        } else {  // round to nearest even (finite values: a small integer times a finite scale)
          __m512i u = _mm512_castps_si512(v);
          const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
          u = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
          _mm256_mask_storeu_epi16((uint16_t*)out + k, m, _mm512_cvtepi32_epi16(u));
        }
      }
    }
  }
}

}  // namespace

extern "C" {

int nt_int4_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
}

// W: (N, Kp/2) packed nibbles, S: (N, Kp/32) float16 scales (layout above), x: (M, K) float32, bias (N,) or NULL,
// y: (M, N) float32 or bfloat16. Returns 0, or 1 when K is too long for the activation buffer or M > 16.
int nt_linear_i4(const uint8_t* W, const uint16_t* S, const float* x, const float* bias, int64_t M, int64_t N,
                 int64_t K, void* y, int out_kind) {
  const int64_t Kp = (K + 63) / 64 * 64;
  if (Kp > 32768 || M > 16) return 1;
  static thread_local int16_t xq[8 * 32768];  // (8, Kp) quantized activations
  float xscale[8];
  for (int64_t m0 = 0; m0 < M; m0 += 8) {  // up to 8 activation rows per pass over the weights
    const int64_t rows = M - m0 < 8 ? M - m0 : 8;
    quantize_rows(x + (size_t)m0 * K, rows, K, Kp, xq, xscale);
    char* yo = (char*)y + (size_t)m0 * N * (out_kind == OUT_F32 ? 4 : 2);
    pick((int)rows)(W, S, xq, xscale, bias, N, Kp, yo, out_kind);
  }
  return 0;
}

// Rows [0, N) dequantized to (N, K) float32 or bfloat16 (each value q * scale rounded once).
int nt_dequantize_i4(const uint8_t* W, const uint16_t* S, int64_t N, int64_t K, void* out, int out_kind) {
  const int64_t Kp = (K + 63) / 64 * 64;
  const size_t out_row = (size_t)K * (out_kind == OUT_F32 ? 4 : 2);
#pragma omp parallel for schedule(static) if (N * K >= (1 << 18))
  for (int64_t n = 0; n < N; ++n)
    dequant_row(W + (size_t)n * (Kp / 2), S + (size_t)n * (Kp / 32), K, Kp, (char*)out + n * out_row, out_kind);
  return 0;
}
}
