// Weight-only 4-bit products for decode: y (M, N) = x (M, K) @ W (N, K)^T (+ bias), W in groups of 32 columns,
// each group with its own float16 scale (Q4_0's scheme: q in [-8, 7], w ~= q * d).
//
// Storage (built by nexttoken/model/quant/int4.py): K is padded with zero weights to Kp, a multiple of 128. Row n holds
// Kp/2 bytes; its 128-column chunk c is the 64 bytes [64c, 64c + 64), each nibble one column of the chunk (which:
// column_of below) stored as q + 8 (0..15). Scales: (N, Kp/32) float16, group g = columns [32g, 32g + 32).
//
// The product: each activation row is quantized to int8 per group of 32 columns (scale = the group's largest
// magnitude / 127, values rounded half to even: llama.cpp's Q8_0 activations; top-1 agreement with float32 on real
// text is unchanged from int16 activations, see nexttoken/model/quant/int4.py) and written in the chunks' nibble order.
// A chunk is one 64-byte load; v & 0x0f and (v >> 4) & 0x0f are two vectors of 64 unsigned weights (q + 8), each
// multiplied with its 64 activations by VNNI's vpdpbusd (four byte products summed into each of 16 int32 lanes,
// 64 per instruction) into one vector of sums whose lane i belongs to group i % 4 of the chunk. That vector goes
// to float32 and is scaled by the weight and activation scales of its groups; the +8 of the storage is taken off
// once per group (-8 * scales * the group's activation sum).
// A weight costs half a byte of memory traffic plus 1/16 byte of scale: 4.5 bits, as llama.cpp's Q4_0.
//
// Prefill dequantizes blocks of rows into float32/bfloat16 (nt_dequantize_i4) for torch's GEMM.

#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#define TARGET_I4 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

#include "rows.h"

namespace {

const int64_t CHUNK = 128;  // columns per 64 packed bytes (four groups)

// The chunk column kept in nibble `h` (0 low, 1 high) of byte b (0..63). Word w = b / 2 of the chunk becomes
// element w of weight vector j = 2 * (b % 2) + h (its bits 4j..4j+3), summed into int32 lane i = w / 2; lane i
// belongs to group i % 4, whose columns are numbered 8 * (i / 4) + 2 * j + w % 2 (0..31) within it.
inline int64_t column_of(int64_t b, int64_t h) {
  const int64_t w = b / 2, i = w / 2, j = 2 * (b % 2) + h;
  return 32 * (i % 4) + 8 * (i / 4) + 2 * j + w % 2;
}

// R weight rows x M activation rows: out[r * M + m] = the vector of partial sums (lanes summed later). xq: (M, Kp)
// int8, chunk c's 128 values as the activations of its low nibbles then its high nibbles; xs: (M, Kp/8) float,
// chunk c's 16 lanes the activation scale of lane i's group (4c + i % 4); xneg: (M, Kp/32) -8 * scale * (sum of
// xq over the group), the correction for storing q + 8. A accumulators per pair, alternating chunks.
template <int M, int R, int A>
TARGET_I4 void tile(const uint8_t* W, const uint16_t* S, const int8_t* xq, const float* xs, const float* xneg,
                    int64_t Kp, int64_t n0, __m512* out) {
  __m512 acc[R][M][A];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m)
      for (int a = 0; a < A; ++a) acc[r][m][a] = _mm512_setzero_ps();
  const int64_t row_bytes = Kp / 2, groups = Kp / 32;
  const __m512i nib = _mm512_set1_epi8(0x0f);
  const __m512i zero = _mm512_setzero_si512();
  __m512i pick[4];  // chunk c of a 16-group block: lane i -> group 4c + i % 4
  for (int c = 0; c < 4; ++c) {
    const int b = 4 * c;
    pick[c] = _mm512_set_epi32(b + 3, b + 2, b + 1, b, b + 3, b + 2, b + 1, b, b + 3, b + 2, b + 1, b, b + 3, b + 2,
                               b + 1, b);
  }
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {  // blocks of 16 groups (4 chunks, 512 columns)
    const int64_t left = groups - g0 < 16 ? groups - g0 : 16;
    const __mmask16 gm = left == 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
    __m512 sc[R];
    for (int r = 0; r < R; ++r) {
      sc[r] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(gm, S + (size_t)(n0 + r) * groups + g0));
      for (int m = 0; m < M; ++m)
        acc[r][m][0] = _mm512_fmadd_ps(sc[r], _mm512_maskz_loadu_ps(gm, xneg + (size_t)m * groups + g0),
                                       acc[r][m][0]);
    }
    const int chunks = (int)(left / 4);
#pragma GCC unroll 4
    for (int c = 0; c < chunks; ++c) {
      const int64_t k = (g0 + 4 * c) * 32;
      for (int r = 0; r < R; ++r) {
        const __m512i v = _mm512_loadu_si512((const void*)(W + (size_t)(n0 + r) * row_bytes + k / 2));
        const __m512i lo = _mm512_and_si512(v, nib);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        const __m512 s = _mm512_permutexvar_ps(pick[c], sc[r]);
        for (int m = 0; m < M; ++m) {
          const int8_t* xm = xq + (size_t)m * Kp + k;
          __m512i d = _mm512_dpbusd_epi32(zero, lo, _mm512_loadu_si512((const void*)xm));
          d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512((const void*)(xm + 64)));
          const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(d), _mm512_loadu_ps(xs + (size_t)m * (Kp / 8) + k / 8));
          acc[r][m][c % A] = _mm512_fmadd_ps(t, s, acc[r][m][c % A]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      __m512 t = acc[r][m][0];
      for (int a = 1; a < A; ++a) t = _mm512_add_ps(t, acc[r][m][a]);
      out[r * M + m] = t;
    }
}

// Output rows in blocks of 16 (rows.h), each sum scaled by its activation row's scale, biased, stored as float32
// or bfloat16.
template <int M, int R>
TARGET_I4 void run(const uint8_t* W, const uint16_t* S, const int8_t* xq, const float* xs, const float* xneg,
                   const float* bias, int64_t N, int64_t Kp, void* y, int out_kind) {
  constexpr int A = 2;  // for every M: a row's sums are then the same whatever rows share the call
  over_rows<M, R>([&](int64_t n0, __m512* v) { tile<M, R, A>(W, S, xq, xs, xneg, Kp, n0, v); },
                  [&](int64_t n, __m512* v) { tile<M, 1, A>(W, S, xq, xs, xneg, Kp, n, v); }, N, Kp, nullptr,
                  nullptr, bias, y, out_kind);
}

typedef void (*kernel_fn)(const uint8_t*, const uint16_t*, const int8_t*, const float*, const float*,
                          const float*, int64_t, int64_t, void*, int);

// Short rows (<= 2 KB packed) are read one after another: interleaving several starves the hardware prefetcher
// (as in gemv.cpp): four at a time made the small shape's int4 decode 20% slower (131-139 against 169-179 tok/s,
// 1 thread) although a kernel-only loop over one matrix preferred it. Long rows are interleaved four at a time.
kernel_fn pick(int M, int64_t Kp) {
  const bool one = Kp <= 4096;
  switch (M) {
    case 1: return one ? run<1, 1> : run<1, 4>;
    case 2: return one ? run<2, 1> : run<2, 2>;
    case 3: return run<3, 1>;
    case 4: return run<4, 1>;
    case 5: return run<5, 1>;
    case 6: return run<6, 1>;
    case 7: return run<7, 1>;
    case 8: return run<8, 1>;
    default: return 0;
  }
}

// x (M, K) float32 -> xq (M, Kp) int8 in the chunks' order (zero padded), xs (M, Kp/8) the group scale of each
// chunk lane (lane i of chunk c: group 4c + i % 4), xneg (M, Kp/32) -8 * scale * each group's sum of xq. A group's
// scale is its largest magnitude / 127 (0 for an all-zero group, whose values are then 0), values x / scale
// rounded half to even: nexttoken/model/quant/int4.py's quantize_activations, the definition this is tested against.
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, int8_t* xq, float* xs, float* xneg) {
  int64_t col_of[CHUNK];  // position p of a chunk's 128 activations -> its column (p < 64: low nibble of byte p)
  for (int64_t b = 0; b < 64; ++b)
    for (int64_t h = 0; h < 2; ++h) col_of[64 * h + b] = column_of(b, h);
  const int64_t G = Kp / 32;
  float scale[1024];
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + (size_t)m * K;
    for (int64_t g = 0; g < G; ++g) {
      float amax = 0.f;
      for (int64_t k = 32 * g; k < 32 * g + 32 && k < K; ++k) amax = fabsf(row[k]) > amax ? fabsf(row[k]) : amax;
      scale[g] = amax / 127.f;
    }
    int8_t* q = xq + (size_t)m * Kp;
    float* neg = xneg + (size_t)m * G;
    for (int64_t g = 0; g < G; ++g) neg[g] = 0.f;
    for (int64_t c = 0; c < Kp; c += CHUNK)
      for (int64_t p = 0; p < CHUNK; ++p) {
        const int64_t col = c + col_of[p], g = col / 32;
        const int8_t v = col < K && scale[g] > 0.f ? (int8_t)__builtin_lrintf(row[col] / scale[g]) : (int8_t)0;
        q[c + p] = v;
        neg[g] += (float)v;  // exact: |sum| <= 32 * 127
      }
    for (int64_t g = 0; g < G; ++g) neg[g] = -8.f * scale[g] * neg[g];
    float* lanes = xs + (size_t)m * (Kp / 8);
    for (int64_t c = 0; c < Kp / CHUNK; ++c)
      for (int64_t i = 0; i < 16; ++i) lanes[16 * c + i] = scale[4 * c + i % 4];
  }
}

// Permutation tables for dequantization: output vector o of a chunk (its group o, columns 32o..32o+31 in
// order) takes column 8L + 2j + t from element 2(o + 4L) + t of weight vector j (column_of's inverse). For
// _mm512_permutex2var_epi16: lo[o] gathers vectors 0 and 1 (bit 5 picks the second), hi[o] vectors 2 and 3, and
// from_hi marks the columns hi[o] provides (j >= 2).
struct DequantTables {
  uint16_t lo[4][32], hi[4][32];
  __mmask32 from_hi;
  DequantTables() : from_hi(0) {
    for (int o = 0; o < 4; ++o)
      for (int L = 0; L < 4; ++L)
        for (int j = 0; j < 4; ++j)
          for (int t = 0; t < 2; ++t) {
            const int d = 8 * L + 2 * j + t, src = 2 * (o + 4 * L) + t;
            (j < 2 ? lo : hi)[o][d] = (uint16_t)(src | ((j % 2) << 5));
            (j < 2 ? hi : lo)[o][d] = 0;
            if (j >= 2) from_hi |= (__mmask32)(1u << d);
          }
  }
};

TARGET_I4 void dequant_row(const uint8_t* W, const uint16_t* S, int64_t K, int64_t Kp, void* out, int out_kind) {
  static const DequantTables tables;
  const __m512i nib = _mm512_set1_epi16(0x000f);
  const __m512i eight = _mm512_set1_epi32(8);
  for (int64_t c = 0; c < Kp && c < K; c += CHUNK) {
    const __m512i v = _mm512_loadu_si512((const void*)(W + c / 2));
    const __m512i w0 = _mm512_and_si512(v, nib), w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    const __m512i w2 = _mm512_and_si512(_mm512_srli_epi16(v, 8), nib), w3 = _mm512_srli_epi16(v, 12);
    for (int o = 0; o < 4; ++o) {  // group c/32 + o: 32 columns in order
      const __m512i a = _mm512_permutex2var_epi16(w0, _mm512_loadu_si512((const void*)tables.lo[o]), w1);
      const __m512i b = _mm512_permutex2var_epi16(w2, _mm512_loadu_si512((const void*)tables.hi[o]), w3);
      const __m512i u = _mm512_mask_blend_epi16(tables.from_hi, a, b);  // q + 8, column order
      const __m512 s = _mm512_set1_ps(_cvtsh_ss(S[c / 32 + o]));
      for (int h = 0; h < 2; ++h) {  // 16 columns at a time
        const int64_t k = c + 32 * o + 16 * h;
        if (k >= K) break;
        const __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1u);
        const __m256i part = h ? _mm512_extracti64x4_epi64(u, 1) : _mm512_castsi512_si256(u);
        const __m512 val = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu16_epi32(part), eight)), s);
        if (out_kind == OUT_F32) {
          _mm512_mask_storeu_ps((float*)out + k, m, val);
        } else {
          _mm256_mask_storeu_epi16((uint16_t*)out + k, m, to_bf16x16(val));
        }
      }
    }
  }
}

// Float32 activations (the exact default): x (M, K) -> xo (M, Kp) float32 in the chunks' order (position p of chunk
// c: column col_of[p], zero past K). Each chunk's 128 weights are widened to float32 in registers, (q + 8 - 8) *
// scale, and multiplied with FMAs: the float32 product of the dequantized weights, no activation rounding. Within
// each 16-byte quarter of a chunk, byte j belongs to group j / 4 (column_of), for its low and high nibble alike.
void order_rows(const float* x, int64_t M, int64_t K, int64_t Kp, float* xo) {
  int64_t col_of[CHUNK];
  for (int64_t b = 0; b < 64; ++b)
    for (int64_t h = 0; h < 2; ++h) col_of[64 * h + b] = column_of(b, h);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < Kp; c += CHUNK)
      for (int64_t p = 0; p < CHUNK; ++p) {
        const int64_t col = c + col_of[p];
        xo[(size_t)m * Kp + c + p] = col < K ? x[(size_t)m * K + col] : 0.f;
      }
}

template <int M>
TARGET_I4 void tilef(const uint8_t* W, const uint16_t* S, const float* xo, int64_t Kp, int64_t n, __m512* out) {
  const uint8_t* row = W + (size_t)n * (Kp / 2);
  const uint16_t* sc = S + (size_t)n * (Kp / 32);
  const __m512i nib = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi32(8);
  const __m512i quarter = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < Kp / CHUNK; ++c) {
    const __m512i v = _mm512_loadu_si512((const void*)(row + 64 * c));
    const __m512i half[2] = {_mm512_and_si512(v, nib), _mm512_and_si512(_mm512_srli_epi16(v, 4), nib)};
    const __m128 g = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(sc + 4 * c)));  // the chunk's four scales
    const __m512 s = _mm512_permutexvar_ps(quarter, _mm512_castps128_ps512(g));       // lane j: group j / 4
    for (int h = 0; h < 2; ++h)
      for (int q = 0; q < 4; ++q) {
        __m128i u;
        switch (q) {  // the extract's lane index must be a constant
          case 0: u = _mm512_castsi512_si128(half[h]); break;
          case 1: u = _mm512_extracti32x4_epi32(half[h], 1); break;
          case 2: u = _mm512_extracti32x4_epi32(half[h], 2); break;
          default: u = _mm512_extracti32x4_epi32(half[h], 3); break;
        }
        const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(u), eight)), s);
        for (int m = 0; m < M; ++m)
          acc[m][q & 1] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xo + (size_t)m * Kp + CHUNK * c + 64 * h + 16 * q),
                                          acc[m][q & 1]);
      }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_add_ps(acc[m][0], acc[m][1]);
}

template <int M>
TARGET_I4 void runf(const uint8_t* W, const uint16_t* S, const float* xo, const float* bias, int64_t N, int64_t Kp,
                    void* y, int out_kind) {
  auto one = [&](int64_t n, __m512* v) { tilef<M>(W, S, xo, Kp, n, v); };
  over_rows<M, 1>(one, one, N, Kp, nullptr, nullptr, bias, y, out_kind);
}

}  // namespace

extern "C" {

// nt_linear_i4 with float32 activations (tilef): the exact product of the dequantized weights, the default.
int nt_linear_i4f(const uint8_t* W, const uint16_t* S, const float* x, const float* bias, int64_t M, int64_t N,
                  int64_t K, void* y, int out_kind) {
  const int64_t Kp = (K + CHUNK - 1) / CHUNK * CHUNK;
  if (Kp > 32768 || M > 16) return 1;
  alignas(64) static thread_local float xo[8 * 32768];  // (8, Kp) activations, chunk order
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const int64_t rows = M - m0 < 8 ? M - m0 : 8;
    order_rows(x + (size_t)m0 * K, rows, K, Kp, xo);
    char* yo = (char*)y + (size_t)m0 * N * (out_kind == OUT_F32 ? 4 : 2);
    switch (rows) {
      case 1: runf<1>(W, S, xo, bias, N, Kp, yo, out_kind); break;
      case 2: runf<2>(W, S, xo, bias, N, Kp, yo, out_kind); break;
      case 3: runf<3>(W, S, xo, bias, N, Kp, yo, out_kind); break;
      case 4: runf<4>(W, S, xo, bias, N, Kp, yo, out_kind); break;
      case 5: runf<5>(W, S, xo, bias, N, Kp, yo, out_kind); break;
      case 6: runf<6>(W, S, xo, bias, N, Kp, yo, out_kind); break;
      case 7: runf<7>(W, S, xo, bias, N, Kp, yo, out_kind); break;
      default: runf<8>(W, S, xo, bias, N, Kp, yo, out_kind); break;
    }
  }
  return 0;
}

int nt_int4_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
}

// W: (N, Kp/2) packed nibbles, S: (N, Kp/32) float16 scales (layout above), x: (M, K) float32, bias (N,) or NULL,
// y: (M, N) float32 or bfloat16. Returns 0, or 1 when K is too long for the activation buffer or M > 16.
int nt_linear_i4(const uint8_t* W, const uint16_t* S, const float* x, const float* bias, int64_t M, int64_t N,
                 int64_t K, void* y, int out_kind) {
  const int64_t Kp = (K + CHUNK - 1) / CHUNK * CHUNK;
  if (Kp > 32768 || M > 16) return 1;
  alignas(64) static thread_local int8_t xq[8 * 32768];  // (8, Kp) quantized activations, chunk order
  alignas(64) static thread_local float xs[8 * 4096];    // (8, Kp/8) chunk-lane scales
  alignas(64) static thread_local float xneg[8 * 1024];  // (8, Kp/32)
  for (int64_t m0 = 0; m0 < M; m0 += 8) {  // up to 8 activation rows per pass over the weights
    const int64_t rows = M - m0 < 8 ? M - m0 : 8;
    quantize_rows(x + (size_t)m0 * K, rows, K, Kp, xq, xs, xneg);
    char* yo = (char*)y + (size_t)m0 * N * (out_kind == OUT_F32 ? 4 : 2);
    pick((int)rows, Kp)(W, S, xq, xs, xneg, bias, N, Kp, yo, out_kind);
  }
  return 0;
}

// w (N, K) float32 -> packed (N, Kp/2) and scales (N, Kp/32) float16, as nexttoken/model/quant/int4.py's
// quantize_groups defines it (that Python function is the reference; this is the same arithmetic, fast enough
// for a 1B model at load time): per group, the value of largest magnitude m (the first one on a tie), and for
// each factor f the float16 scale d = f * m / -8, q = round-half-even(w / d) clamped to [-8, 7], squared error
// summed in double; the first factor with the least error wins.
TARGET_I4 int nt_quantize_i4(const float* w, int64_t N, int64_t K, const double* factors, int64_t n_factors,
                             uint8_t* packed, uint16_t* scales) {
  const int64_t Kp = (K + CHUNK - 1) / CHUNK * CHUNK, G = Kp / 32;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = w + (size_t)n * K;
    uint8_t u[CHUNK];  // one chunk's stored nibbles (q + 8), by column
    for (int64_t c = 0; c < Kp; c += CHUNK) {
      for (int64_t g = c / 32; g < c / 32 + 4; ++g) {
        float v[32];
        for (int64_t i = 0; i < 32; ++i) v[i] = g * 32 + i < K ? row[g * 32 + i] : 0.f;
        float extreme = v[0];
        for (int64_t i = 1; i < 32; ++i) extreme = fabsf(v[i]) > fabsf(extreme) ? v[i] : extreme;
        double best_err = 0.0;
        uint16_t best_scale = 0;
        int8_t best_q[32];
        for (int64_t f = 0; f < n_factors; ++f) {
          float sc = extreme * (float)(factors[f] / -8.0);  // as torch: the scalar rounded to float32 first
          sc = sc < -65504.f ? -65504.f : (sc > 65504.f ? 65504.f : sc);
          const uint16_t h = _cvtss_sh(sc, _MM_FROUND_TO_NEAREST_INT);
          const float d = _cvtsh_ss(h);
          int8_t q[32];
          double err = 0.0;
          for (int64_t i = 0; i < 32; ++i) {
            float r = d != 0.f ? nearbyintf(v[i] / d) : 0.f;
            r = r < -8.f ? -8.f : (r > 7.f ? 7.f : r);
            q[i] = (int8_t)r;
            const double e = (double)(r * d) - (double)v[i];
            err += e * e;
          }
          if (f == 0 || err < best_err) {
            best_err = err, best_scale = h;
            memcpy(best_q, q, 32);
          }
        }
        scales[(size_t)n * G + g] = best_scale;
        for (int64_t i = 0; i < 32; ++i) u[g * 32 - c + i] = (uint8_t)(best_q[i] + 8);
      }
      uint8_t* out = packed + (size_t)n * (Kp / 2) + c / 2;
      for (int64_t b = 0; b < 64; ++b) out[b] = (uint8_t)(u[column_of(b, 0)] | (u[column_of(b, 1)] << 4));
    }
  }
  return 0;
}

// Rows [0, N) dequantized to (N, K) float32 or bfloat16 (each value q * scale rounded once).
int nt_dequantize_i4(const uint8_t* W, const uint16_t* S, int64_t N, int64_t K, void* out, int out_kind) {
  const int64_t Kp = (K + CHUNK - 1) / CHUNK * CHUNK;
  const size_t out_row = (size_t)K * (out_kind == OUT_F32 ? 4 : 2);
#pragma omp parallel for schedule(static) if (N * K >= (1 << 18))
  for (int64_t n = 0; n < N; ++n)
    dequant_row(W + (size_t)n * (Kp / 2), S + (size_t)n * (Kp / 32), K, Kp, (char*)out + n * out_row, out_kind);
  return 0;
}
}
