// MXFP4 (the OCP microscaling FP4 format gpt-oss's experts are stored in; GGUF type MXFP4) multiplied as stored:
// y (M, N) = x (M, K) @ W (N, K)^T (+ bias), and rows dequantized for prefill.
//
// ggml's block (ggml-common.h's block_mxfp4), one row of W = K / 32 blocks back to back, 17 bytes each:
//   e      uint8  E8M0 exponent: the block's scale is 2^(e - 127) (ggml_e8m0_to_fp32_half gives half of it, because
//                 the value table below holds the E2M1 values doubled)
//   qs[16] uint8  element j (0..15) in the low nibble of qs[j], element j + 16 in its high nibble
//   w = kvalues[nibble] * e8m0_half(e), kvalues = 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12
// (gguf-py's gguf/quants.py MXFP4 writes the same in numpy; tests/model/quant/test_mxfp4.py holds this file to it.)
//
// Every weight is a small integer times a power of two, so a block dequantizes exactly in float32. The product keeps
// the activations in float32 (no 8-bit quantization of x): each block's 32 weights are decoded into two vectors of
// 16 floats by a table lookup (vpermps on the nibbles), scaled (exact), and accumulated by float32 FMAs, so the
// result is the float product of the exact weights up to the order of the sums. Decode is bound by reading the
// weights (4.25 bits a weight): each row is read once per call for all (up to 16) activation rows, the rows split
// over the OpenMP threads.

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define MXFP4_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

namespace {

const int BLOCK = 32, BYTES = 17, MAX_M = 16;
const float KVALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// ggml_e8m0_to_fp32_half: 2^(e - 128) as float32 bits (subnormal for e < 2).
inline float e8m0_half(uint8_t e) {
  uint32_t bits = e < 2 ? (uint32_t)0x00200000 << e : (uint32_t)(e - 1) << 23;
  float d;
  memcpy(&d, &bits, 4);
  return d;
}

// One block's 32 weights as two vectors of 16 floats (elements 0..15, 16..31), exact.
MXFP4_TARGET inline void decode(const uint8_t* b, __m512 table, __m512* lo, __m512* hi) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + 1)));  // 16 bytes -> 16 int32
  const __m512 d = _mm512_set1_ps(e8m0_half(b[0]));
  *lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)), table), d);
  *hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table), d);
}

MXFP4_TARGET void rows_f32(const uint8_t* W, const float* x, const float* bias, int64_t M, int64_t N, int64_t K,
                           float* y) {
  const __m512 table = _mm512_loadu_ps(KVALUES);
  const int64_t blocks = K / BLOCK;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 16))
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* row = W + n * blocks * BYTES;
    __m512 acc[MAX_M], acc2[MAX_M];  // two chains per row: the first 16 and the last 16 elements of each block
    for (int64_t m = 0; m < M; ++m) acc[m] = acc2[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m512 lo, hi;
      decode(row + b * BYTES, table, &lo, &hi);
      for (int64_t m = 0; m < M; ++m) {
        const float* xb = x + m * K + b * BLOCK;
        acc[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), acc[m]);
        acc2[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), acc2[m]);
      }
    }
    for (int64_t m = 0; m < M; ++m)
      y[m * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], acc2[m])) + (bias ? bias[n] : 0.0f);
  }
}

MXFP4_TARGET void dequantize_rows(const uint8_t* W, int64_t N, int64_t K, float* out) {
  const __m512 table = _mm512_loadu_ps(KVALUES);
  const int64_t blocks = K / BLOCK;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 18))
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t b = 0; b < blocks; ++b) {
      __m512 lo, hi;
      decode(W + (n * blocks + b) * BYTES, table, &lo, &hi);
      _mm512_storeu_ps(out + n * K + b * BLOCK, lo);
      _mm512_storeu_ps(out + n * K + b * BLOCK + 16, hi);
    }
  }
}

}  // namespace

extern "C" {

int nt_mxfp4_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
}

// y (M, N) float32 = x (M, K) float32 @ W^T (+ bias (N,) float32 or null); W (N, K / 32 * 17) MXFP4 blocks.
// Returns 1 (nothing written) for K not a multiple of 32 or M outside 1..16.
int nt_linear_mxfp4(const uint8_t* W, const float* x, const float* bias, int64_t M, int64_t N, int64_t K, float* y) {
  if (K % BLOCK || M < 1 || M > MAX_M) return 1;
  rows_f32(W, x, bias, M, N, K, y);
  return 0;
}

// out (N, K) float32 = the blocks' values, exactly gguf's dequantizer's. Returns 1 for K not a multiple of 32.
int nt_dequantize_mxfp4(const uint8_t* W, int64_t N, int64_t K, float* out) {
  if (K % BLOCK) return 1;
  dequantize_rows(W, N, K, out);
  return 0;
}

}  // extern "C"
