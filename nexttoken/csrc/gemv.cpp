// Weight-streaming matrix products for decode: y (M, N) = x (M, K) @ W (N, K)^T (+ bias), M small (<= 16).
//
// At decode time a linear layer reads every weight once to multiply it with one to a few activation rows, so it
// is bound by memory bandwidth. torch's F.linear reaches ~18-20 GB/s on such shapes on a 2-core Zen 4; this file
// streams each weight row exactly once with AVX-512, keeping all M rows' partial sums in registers, and splits
// the output rows between the OpenMP threads (it links the libgomp that torch already loaded, so both share one
// thread pool).
//
// Weights: float32, bfloat16 (widened exactly to float32), or int8 with one float32 scale per output row
// (weight-only quantization). Activations are float32 (exact), products and sums are float32 FMAs. Output is
// float32 or bfloat16 (rounded to nearest even once, from the float32 sum, as torch does).
//
// Plain C ABI (called through ctypes): no torch headers, so it compiles in about a second.

#include <immintrin.h>
#include <stdint.h>
#include <math.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

#include "nt_abi.h"  // the weight kinds W_*
#include "rows.h"

// Software prefetch distance for products with 2+ activation rows: each weight byte then costs several FMAs, and
// the hardware prefetcher alone let an 8-row product over a 98 MB LM head stream at 14 GB/s (23 GB/s with it).
// At one row it changes nothing measurable, so it is not issued there.
static const size_t PF_BYTES = 4096;


template <int KIND>
TARGET static inline __m512 load_w(const void* w, int64_t k, __mmask16 m) {
  if (KIND == W_F32) return _mm512_maskz_loadu_ps(m, (const float*)w + k);
  if (KIND == W_BF16) {
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t*)w + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  __m128i b = _mm_maskz_loadu_epi8(m, (const int8_t*)w + k);
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

static inline size_t elem_size(int kind) { return kind == W_F32 ? 4 : kind == W_BF16 ? 2 : 1; }

// R weight rows x M activation rows of partial sums live in R*M zmm registers. The weight type is a template
// parameter: a runtime branch in the inner loop made the compiler spill the accumulators every iteration.
template <int KIND, int M, int R>
TARGET static void tile(const void* W, const float* x, int64_t K, int64_t n0, __m512* acc_out) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const size_t es = elem_size(KIND);
  const char* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = (const char*)W + (size_t)(n0 + r) * (size_t)K * es;
  // One loop, the last partial vector masked: a separate tail loop made GCC keep acc in memory (spills).
  const __mmask16 tail = (__mmask16)((1u << (K & 15)) - 1u);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = k + 16 <= K ? (__mmask16)0xffff : tail;
    __m512 w[R];
    for (int r = 0; r < R; ++r) {
      // Rows are contiguous, so prefetching PF_BYTES ahead runs on into the next rows (a prefetch never faults).
      if (M >= 2) _mm_prefetch(rows[r] + (size_t)k * es + PF_BYTES, _MM_HINT_T0);
      w[r] = load_w<KIND>(rows[r], k, mask);
    }
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + (size_t)m * K + k);  // from L1: x is a few KB
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(w[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc_out[r * M + m] = acc[r][m];
}

template <int KIND, int M, int R>
TARGET static void run(const void* W, const float* x, const float* bias, const float* scale, int64_t N,
                       int64_t K, void* y, int out_kind) {
  over_rows<M, R>([&](int64_t n0, __m512* v) { tile<KIND, M, R>(W, x, K, n0, v); },
                  [&](int64_t n, __m512* v) { tile<KIND, M, 1>(W, x, K, n, v); }, N, K, nullptr, scale, bias,
                  y, out_kind);
}

// int8 weights x int16 activations with VNNI (vpdpwssd: 32 int16 products summed pairwise into 16 int32 lanes):
// two instructions per 32 weights instead of six for widening to float32, so int8 streams at memory speed.
// Each activation row is quantized to int16 with its own scale (relative error <= 2^-16, far below the int8
// weights' own), and int32 partial sums are moved to float32 every 256 columns, before they could overflow
// (256 x 127 x 32767 < 2^31).
#define TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))

// One 32-column chunk at column k of R weight rows into their int32 sums (mask: the columns of the row to read).
template <int M, int R>
TARGET_VNNI static inline void chunk_i8(const int8_t* W, const int16_t* xq, int64_t Kp, int64_t K, int64_t n0,
                                        int64_t k, __mmask32 mask, __m512i (&acc)[R][M]) {
  __m512i xv[M];
  for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_si512((const void*)(xq + (size_t)m * Kp + k));
  for (int r = 0; r < R; ++r) {
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, W + (size_t)(n0 + r) * K + k));
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpwssd_epi32(acc[r][m], w, xv[m]);
  }
}

template <int M, int R>
TARGET_VNNI static void tile_i8(const int8_t* W, const int16_t* xq, int64_t Kp, int64_t K, int64_t n0, __m512* out) {
  __m512 accf[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) accf[r][m] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < Kp; k0 += 256) {  // int32 sums moved to float32 every 256 columns
    const int64_t k1 = k0 + 256 < Kp ? k0 + 256 : Kp;
    __m512i acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_si512();
    int64_t k = k0;
    for (; k + 32 <= k1 && k + 32 <= K; k += 32) chunk_i8<M, R>(W, xq, Kp, K, n0, k, 0xffffffffu, acc);  // whole
    if (k < k1) chunk_i8<M, R>(W, xq, Kp, K, n0, k, (__mmask32)((1ull << (K - k)) - 1u), acc);  // the row's tail
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) accf[r][m] = _mm512_add_ps(accf[r][m], _mm512_cvtepi32_ps(acc[r][m]));
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) out[r * M + m] = accf[r][m];
}

template <int M, int R>
TARGET_VNNI static void run_i8(const int8_t* W, const int16_t* xq, const float* xscale, const float* bias,
                               const float* scale, int64_t N, int64_t K, int64_t Kp, void* y, int out_kind) {
  over_rows<M, R>([&](int64_t n0, __m512* v) { tile_i8<M, R>(W, xq, Kp, K, n0, v); },
                  [&](int64_t n, __m512* v) { tile_i8<M, 1>(W, xq, Kp, K, n, v); }, N, K, xscale, scale, bias,
                  y, out_kind);
}

typedef void (*kernel_i8_fn)(const int8_t*, const int16_t*, const float*, const float*, const float*, int64_t,
                             int64_t, int64_t, void*, int);

static kernel_i8_fn pick_i8(int M) {
  switch (M) {
    case 1: return run_i8<1, 8>;
    case 2: return run_i8<2, 4>;
    case 3: return run_i8<3, 4>;
    case 4: return run_i8<4, 2>;
    case 5: return run_i8<5, 1>;
    case 6: return run_i8<6, 1>;
    case 7: return run_i8<7, 1>;
    case 8: return run_i8<8, 1>;
    default: return 0;
  }
}

static int has_vnni(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni");
}

// x (M, K) float32 -> xq (M, Kp) int16 (zero padded to Kp, a multiple of 32) with one scale per row.
static void quantize_rows_i16(const float* x, int64_t M, int64_t K, int64_t Kp, int16_t* xq, float* xscale) {
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

typedef void (*kernel_fn)(const void*, const float*, const float*, const float*, int64_t, int64_t, void*, int);

// More weight rows per tile when few activation rows: enough independent FMA chains, within 32 registers.
// Rows of <= 2048 columns (<= 1024 for 3+ activation rows) are read one after another, one sequential stream
// per thread: interleaving several short rows starves the hardware prefetcher, and a 2-D array of R x M sums
// made GCC spill them every iteration (2x slower at 8 rows). Long rows are better interleaved.
template <int KIND>
static kernel_fn pick_kind(int M, int64_t K) {
  const bool one = M <= 2 ? K <= 2048 : K <= 1024;
  switch (M) {
    case 1: return one ? run<KIND, 1, 1> : run<KIND, 1, 8>;
    case 2: return one ? run<KIND, 2, 1> : run<KIND, 2, 8>;
    case 3: return one ? run<KIND, 3, 1> : run<KIND, 3, 4>;
    case 4: return one ? run<KIND, 4, 1> : run<KIND, 4, 4>;
    case 5: return one ? run<KIND, 5, 1> : run<KIND, 5, 2>;
    case 6: return one ? run<KIND, 6, 1> : run<KIND, 6, 2>;
    case 7: return one ? run<KIND, 7, 1> : run<KIND, 7, 2>;
    case 8: return one ? run<KIND, 8, 1> : run<KIND, 8, 2>;
    default: return 0;
  }
}

static kernel_fn pick(int kind, int M, int64_t K) {
  if (kind == W_F32) return pick_kind<W_F32>(M, K);
  if (kind == W_BF16) return pick_kind<W_BF16>(M, K);
  return pick_kind<W_I8>(M, K);
}

extern "C" {

int nt_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
}

int nt_max_rows(void) { return 16; }

// Rows [0, N) of int8 weights q (N, K) times their float32 scales, written as float32 or bfloat16 (each value
// rounded once, to nearest even, from the float32 product: what (q.float() * scale[:, None]).to(dtype) gives).
// Prefill dequantizes a block of rows at a time into a buffer that stays in cache, then runs the GEMM on it.
TARGET static void dequant_row(const int8_t* q, float s, int64_t K, void* out, int out_kind) {
  const __m512 sv = _mm512_set1_ps(s);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1u);
    const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q + k))), sv);
    if (out_kind == OUT_F32) {
      _mm512_mask_storeu_ps((float*)out + k, m, v);
    } else {
      _mm256_mask_storeu_epi16((uint16_t*)out + k, m, to_bf16x16(v));
    }
  }
}

// Row-wise argmax of x (M, N) float32 with torch.argmax's answer: the first index of the largest value, or of the
// first NaN when there is one. Two vector passes (the maximum, then where it first occurs): greedy decoding's
// argmax over a 32k-128k vocabulary is otherwise ~30 us a step in ATen.
TARGET static int64_t argmax_row(const float* x, int64_t N) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t k = 0; k < N; k += 16) {
    const __mmask16 m = N - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - k)) - 1u);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, x + k);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  if (nan) {
    for (int64_t k = 0; k < N; ++k)
      if (x[k] != x[k]) return k;
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  for (int64_t k = 0; k < N; k += 16) {
    const __mmask16 m = N - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - k)) - 1u);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, x + k), top, _CMP_EQ_OQ);
    if (hit) return k + __builtin_ctz((unsigned)hit);
  }
  return 0;  // unreachable: the maximum occurs somewhere
}

int nt_argmax_f32(const float* x, int64_t M, int64_t N, int64_t* out) {
  for (int64_t m = 0; m < M; ++m) out[m] = argmax_row(x + (size_t)m * N, N);
  return 0;
}

int nt_dequantize_i8(const int8_t* q, const float* scale, int64_t N, int64_t K, void* out, int out_kind) {
  const size_t row_bytes = (size_t)K * (out_kind == OUT_F32 ? 4 : 2);
#pragma omp parallel for schedule(static) if (N * K >= (1 << 18))
  for (int64_t n = 0; n < N; ++n) dequant_row(q + (size_t)n * K, scale[n], K, (char*)out + n * row_bytes, out_kind);
  return 0;
}

int nt_linear_i4(const uint8_t* W, const uint16_t* S, const float* x, const float* bias, int64_t M, int64_t N,
                 int64_t K, void* y, int out_kind);  // int4.cpp
int nt_linear_i4f(const uint8_t* W, const uint16_t* S, const float* x, const float* bias, int64_t M, int64_t N,
                  int64_t K, void* y, int out_kind);  // int4.cpp, float32 activations
int nt_linear_ggml(int type, const uint8_t* W, const float* x, const float* bias, int64_t M, int64_t N, int64_t K,
                   void* y, int out_kind);  // ggml.cpp

// x: (M, K) float32 contiguous; W: (N, K) contiguous of `kind`; bias/scale: (N,) float32 or NULL;
// y: (M, N) contiguous of `out_kind`. Returns 0 on success. W_I4: W and scale as int4.cpp lays them out.
// kind >= W_GGML: W is GGUF's packed blocks of ggml type kind - W_GGML (ggml.cpp; scale unused).
int nt_linear(const void* W, int kind, const float* x, const float* bias, const float* scale, int64_t M, int64_t N,
              int64_t K, void* y, int out_kind) {
  if (kind >= W_GGML) return nt_linear_ggml(kind - W_GGML, (const uint8_t*)W, x, bias, M, N, K, y, out_kind);
  if (kind == W_I4) return nt_linear_i4((const uint8_t*)W, (const uint16_t*)scale, x, bias, M, N, K, y, out_kind);
  if (kind == W_I4_F32) return nt_linear_i4f((const uint8_t*)W, (const uint16_t*)scale, x, bias, M, N, K, y, out_kind);
  const bool exact = kind == W_I8_F32;  // int8 rows times float32 activations: the float kernel below
  if (exact) kind = W_I8;
  if (kind == W_I8 && !exact && scale && K <= 16384 && has_vnni()) {
    const int64_t Kp = (K + 31) / 32 * 32;
    static thread_local int16_t xq[8 * 16384];  // (8, Kp) quantized activations
    float xscale[8];
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int64_t rows = M - m0 < 8 ? M - m0 : 8;
      quantize_rows_i16(x + (size_t)m0 * K, rows, K, Kp, xq, xscale);
      char* yo = (char*)y + (size_t)m0 * N * (out_kind == OUT_F32 ? 4 : 2);
      kernel_i8_fn f = pick_i8((int)rows);
      if (rows <= 2 && K <= 2048) f = rows == 1 ? run_i8<1, 1> : run_i8<2, 1>;  // short rows: see pick_kind
      f((const int8_t*)W, xq, xscale, bias, scale, N, K, Kp, yo, out_kind);
    }
    return 0;
  }
  // M > 8: two passes of up to 8 rows each (still one weight read per pass).
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const int64_t rows = M - m0 < 8 ? M - m0 : 8;
    kernel_fn f = pick(kind, (int)rows, K);
    if (!f) return 1;
    char* yo = (char*)y + (size_t)m0 * N * (out_kind == OUT_F32 ? 4 : 2);
    f(W, x + (size_t)m0 * K, bias, scale, N, K, yo, out_kind);
  }
  return 0;
}
}
