// GGUF's quantized blocks multiplied as they are stored: y (M, N) = x (M, K) @ W (N, K)^T (+ bias), M <= 16, and
// rows dequantized for prefill and embedding lookups.
//
// Block layouts are ggml's (ggml-common.h), one row of W = K / (elements per block) blocks back to back:
//   Q4_0 (32 elements, 18 bytes): d f16, qs[16]            w = d * (q - 8),  q = nibble (low: 0..15, high: 16..31)
//   Q4_1 (32, 20): d, m f16, qs[16]                        w = d * q + m
//   Q5_0 (32, 22): d, qh[4], qs[16]                        w = d * (q - 16), bit 4 of element j = bit j of qh
//   Q5_1 (32, 24): d, m, qh[4], qs[16]                     w = d * q + m
//   Q8_0 (32, 34): d, qs[32] int8                          w = d * q
//   Q2_K (256, 84): scales[16] (4-bit scale | 4-bit min << 4), qs[64], d, dmin     w = d*sc * q - dmin*m, q 2 bits
//   Q3_K (256, 110): hmask[32], qs[64], scales[12] (6-bit, -32), d                  w = d*sc * (q - 4), q 3 bits
//   Q4_K (256, 144): d, dmin, scales[12] (6-bit scales and mins), qs[128]          w = d*sc * q - dmin*m
//   Q5_K (256, 176): d, dmin, scales[12], qh[32], qs[128]                           w = d*sc * q - dmin*m, q 5 bits
//   Q6_K (256, 210): ql[128], qh[64], scales[16] int8, d                            w = d*sc * (q - 32), q 6 bits
// (gguf-py's gguf/quants.py writes the same definitions in numpy; tests/model/quant/test_ggml_blocks.py holds this file to it.)
//
// Every type is read 64 elements (a "chunk") at a time into one vector of 64 unsigned bytes u (the stored q, with
// the offset o of the type left in: w = a * (u - o) + b), in an order the type's bits unpack into cheaply (byte
// position p holds chunk element perm(p): the natural order, or for the 32-blocks of 4/5 bits the low nibbles of
// both blocks, then their high nibbles), and two vectors of 16 floats: the weight scale a and offset b of each
// 4-byte lane (a lane never straddles a sub-block). The activations are quantized once per call, in that order:
// int8 per block of 32 elements (scale = the block's largest magnitude / 127, values rounded half to even: ggml's
// Q8_0; Q8_1's block sums for the types with a float offset), so a chunk's product is VNNI's vpdpbusd (64 byte
// products summed in fours into 16 int32 lanes), started from -o * (the lane's activation sum) to take off the
// integer offset exactly, then per lane a * xd * sum (+ b * xd * lane sum where b is a float offset). The K-quants
// use the same 32-element activation blocks (ggml uses one scale per 256, Q8_K): finer, so closer to float32,
// at the same speed. Products are float32 FMAs over the chunks; the lanes are summed at the end (rows.h).
//
// Decode is bound by reading the weights: each row is streamed once per call for all (up to 8, then again for
// 9..16) activation rows, the rows split over the OpenMP threads in blocks of 16 (rows.h's over_rows).

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
// Forced inline: the per-chunk helpers of the kernels pass vectors by value and write through pointers, which a
// call would spill to the stack.
#define INLINE inline __attribute__((always_inline))

#include "rows.h"

namespace {

enum Type { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
            MXFP4 = 39 };

// Per type: elements and bytes per block, the integer offset o, whether b (a float offset) is used, and whether
// the chunk order is the split one (bytes 0-15: block 0 elements 0-15, 16-31: block 1's 0-15, 32-47: block 0's
// 16-31, 48-63: block 1's 16-31) or the natural one.
template <int T> struct Traits;
template <> struct Traits<Q4_0> { enum { BLOCK = 32, BYTES = 18, OFFSET = 8, MIN = 0, SPLIT = 1 }; };
template <> struct Traits<Q4_1> { enum { BLOCK = 32, BYTES = 20, OFFSET = 0, MIN = 1, SPLIT = 1 }; };
template <> struct Traits<Q5_0> { enum { BLOCK = 32, BYTES = 22, OFFSET = 16, MIN = 0, SPLIT = 1 }; };
template <> struct Traits<Q5_1> { enum { BLOCK = 32, BYTES = 24, OFFSET = 0, MIN = 1, SPLIT = 1 }; };
template <> struct Traits<Q8_0> { enum { BLOCK = 32, BYTES = 34, OFFSET = 128, MIN = 0, SPLIT = 0 }; };
template <> struct Traits<Q2_K> { enum { BLOCK = 256, BYTES = 84, OFFSET = 0, MIN = 1, SPLIT = 0 }; };
template <> struct Traits<Q3_K> { enum { BLOCK = 256, BYTES = 110, OFFSET = 4, MIN = 0, SPLIT = 0 }; };
template <> struct Traits<Q4_K> { enum { BLOCK = 256, BYTES = 144, OFFSET = 0, MIN = 1, SPLIT = 0 }; };
template <> struct Traits<Q5_K> { enum { BLOCK = 256, BYTES = 176, OFFSET = 0, MIN = 1, SPLIT = 0 }; };
template <> struct Traits<Q6_K> { enum { BLOCK = 256, BYTES = 210, OFFSET = 32, MIN = 0, SPLIT = 0 }; };

struct Chunk {
  __m512i u;  // 64 stored values (q + offset as unsigned bytes), in the type's chunk order
  __m512 a;   // (16,) weight scale of each 4-byte lane
  __m512 b;   // (16,) weight offset of each lane (types with MIN; else unset)
};

TARGET inline float half(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

TARGET inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}

// Two 16-byte nibble arrays -> the split order's 64 values: [lo0, lo1, hi0, hi1].
TARGET inline __m512i nibbles_split(const uint8_t* qs0, const uint8_t* qs1, bool two) {
  const __m128i a = _mm_loadu_si128((const __m128i*)qs0);
  const __m128i b = _mm_maskz_loadu_epi8(two ? (__mmask16)0xffff : (__mmask16)0, qs1);  // masked: never past the row
  const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
  const __m256i m = _mm256_set1_epi8(0x0f);
  const __m256i lo = _mm256_and_si256(v, m), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// 32 bytes -> natural-order 64 values: their bits [s0, s0+bits) then [s1, s1+bits).
TARGET inline __m512i fields(__m256i v, int s0, int s1, int bits) {
  const __m256i m = _mm256_set1_epi8((char)((1 << bits) - 1));
  const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(s0)), m);
  const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(s1)), m);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// 32 bytes -> 64 single bits in natural order: bit s of each byte, then bit s + 1 (as 0 / 1 bytes; shifting
// 16-bit lanes is safe: only bits below 8 - s of the neighbouring byte could enter, and the mask drops them).
TARGET inline __m512i bits(__m256i v, int s) {
  const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(v), v, 1);
  const __m512i counts = _mm512_inserti64x4(_mm512_set1_epi16((short)s), _mm256_set1_epi16((short)(s + 1)), 1);
  return _mm512_and_si512(_mm512_srlv_epi16(w, counts), _mm512_set1_epi8(1));
}

// Lane i of the result = v[i / 4]: four values per 16-element sub-block (the K-quants with 16 scales per block).
TARGET inline __m512 by_quarter(__m128 v) {
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
}

// Q3_K's signed scale of sub-block j (16 of them, 6 bits each, stored + 32).
inline int scale_q3k(int j, const uint8_t* s) {
  const int lo = j < 8 ? s[j] & 0xF : s[j - 8] >> 4;
  const int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
  return (lo | (hi << 4)) - 32;
}

// Chunk c (elements [64c, 64c + 64)) of a row. `two`: for the 32-blocks, whether block 2c + 1 exists.
template <int T> TARGET INLINE Chunk decode(const uint8_t* row, int64_t c, bool two);

template <> TARGET INLINE Chunk decode<Q4_0>(const uint8_t* row, int64_t c, bool two) {
  const uint8_t* b0 = row + 2 * c * 18;
  const uint8_t* b1 = b0 + 18;
  const float d0 = half(b0), d1 = two ? half(b1) : 0.f;
  return {nibbles_split(b0 + 2, b1 + 2, two), _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(d0), _mm512_set1_ps(d1)),
          _mm512_setzero_ps()};
}

template <> TARGET INLINE Chunk decode<Q4_1>(const uint8_t* row, int64_t c, bool two) {
  const uint8_t* b0 = row + 2 * c * 20;
  const uint8_t* b1 = b0 + 20;
  const float d0 = half(b0), d1 = two ? half(b1) : 0.f, m0 = half(b0 + 2), m1 = two ? half(b1 + 2) : 0.f;
  return {nibbles_split(b0 + 4, b1 + 4, two), _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(d0), _mm512_set1_ps(d1)),
          _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(m0), _mm512_set1_ps(m1))};
}

// The fifth bits of two Q5 blocks (qh: bit j = element j's) as a byte mask in the split order.
inline __mmask64 fifth_bits(uint32_t h0, uint32_t h1) {
  return (__mmask64)((uint64_t)(h0 & 0xffff) | ((uint64_t)(h1 & 0xffff) << 16) | ((uint64_t)(h0 >> 16) << 32) |
                     ((uint64_t)(h1 >> 16) << 48));
}

template <> TARGET INLINE Chunk decode<Q5_0>(const uint8_t* row, int64_t c, bool two) {
  const uint8_t* b0 = row + 2 * c * 22;
  const uint8_t* b1 = b0 + 22;
  const float d0 = half(b0), d1 = two ? half(b1) : 0.f;
  __m512i u = nibbles_split(b0 + 6, b1 + 6, two);
  u = _mm512_mask_add_epi8(u, fifth_bits(u32(b0 + 2), two ? u32(b1 + 2) : 0), u, _mm512_set1_epi8(16));
  return {u, _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(d0), _mm512_set1_ps(d1)), _mm512_setzero_ps()};
}

template <> TARGET INLINE Chunk decode<Q5_1>(const uint8_t* row, int64_t c, bool two) {
  const uint8_t* b0 = row + 2 * c * 24;
  const uint8_t* b1 = b0 + 24;
  const float d0 = half(b0), d1 = two ? half(b1) : 0.f, m0 = half(b0 + 2), m1 = two ? half(b1 + 2) : 0.f;
  __m512i u = nibbles_split(b0 + 8, b1 + 8, two);
  u = _mm512_mask_add_epi8(u, fifth_bits(u32(b0 + 4), two ? u32(b1 + 4) : 0), u, _mm512_set1_epi8(16));
  return {u, _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(d0), _mm512_set1_ps(d1)),
          _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(m0), _mm512_set1_ps(m1))};
}

template <> TARGET INLINE Chunk decode<Q8_0>(const uint8_t* row, int64_t c, bool two) {
  const uint8_t* b0 = row + 2 * c * 34;
  const uint8_t* b1 = b0 + 34;
  const float d0 = half(b0), d1 = two ? half(b1) : 0.f;
  const __m256i q0 = _mm256_loadu_si256((const __m256i*)(b0 + 2));
  const __m256i q1 = _mm256_maskz_loadu_epi8(two ? 0xffffffffu : 0u, b1 + 2);
  // int8 q as unsigned q + 128 (the sign bit flipped); the offset 128 comes off with the activation sums
  const __m512i u = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1), _mm512_set1_epi8(-128));
  return {u, _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d0), _mm512_set1_ps(d1)), _mm512_setzero_ps()};
}

template <> TARGET INLINE Chunk decode<Q2_K>(const uint8_t* row, int64_t c, bool) {
  const uint8_t* blk = row + (c / 4) * 84;
  const int j = (int)(c % 4), h = j / 2, s = 4 * (j % 2);  // half h of the block; bit pairs s, s + 2
  const float d = half(blk + 80), dmin = half(blk + 82);
  const __m256i q = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * h));
  float a[4], b[4];
  for (int i = 0; i < 4; ++i) {  // sub-blocks 4j .. 4j + 3 (16 elements each)
    const uint8_t sc = blk[4 * j + i];
    a[i] = d * (float)(sc & 0xF);
    b[i] = -(dmin * (float)(sc >> 4));
  }
  return {fields(q, s, s + 2, 2), by_quarter(_mm_loadu_ps(a)), by_quarter(_mm_loadu_ps(b))};
}

template <> TARGET INLINE Chunk decode<Q3_K>(const uint8_t* row, int64_t c, bool) {
  const uint8_t* blk = row + (c / 4) * 110;
  const int j = (int)(c % 4), h = j / 2, s = 4 * (j % 2);
  const float d = half(blk + 108);
  const __m256i q = _mm256_loadu_si256((const __m256i*)(blk + 32 + 32 * h));
  // element e's high bit is bit e / 32 of hmask[e % 32]: bits 2j (first half) and 2j + 1 (second), worth 4
  const __m512i u = _mm512_or_si512(fields(q, s, s + 2, 2),
                                    _mm512_slli_epi16(bits(_mm256_loadu_si256((const __m256i*)blk), 2 * j), 2));
  float a[4];
  for (int i = 0; i < 4; ++i) a[i] = d * (float)scale_q3k(4 * j + i, blk + 96);
  return {u, by_quarter(_mm_loadu_ps(a)), _mm512_setzero_ps()};
}

// Q4_K / Q5_K: the 12 bytes at blk + 4 hold 8 six-bit scales and 8 six-bit mins (get_scale_min_k4's layout),
// rearranged in four 32-bit words (ggml's kmask trick) into bytes 0-7 = the scales, 8-15 = the mins; then lanes 0-7
// of a = d * sc, lanes 8-15 of b = -dmin * m (once per chunk for the int8 path's k4_chunk, once per block for direct_k).
TARGET inline void k4_block_scales(const uint8_t* blk, __m512* a, __m512* b) {
  uint32_t u[4];
  memcpy(u, blk + 4, 12);
  u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);  // mins 4-7
  const uint32_t mins = u[1] & 0x3f3f3f3fu;                                  // mins 0-3
  u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);         // scales 4-7
  u[2] = mins;
  u[0] &= 0x3f3f3f3fu;                                                        // scales 0-3
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)u)));
  *a = _mm512_mul_ps(_mm512_set1_ps(half(blk)), v);
  *b = _mm512_mul_ps(_mm512_set1_ps(-half(blk + 2)), v);
}

// Chunk j (0..3) of a Q4_K / Q5_K super-block: its two 32-element sub-blocks' scales d * sc and offsets
// -dmin * m (k4_block_scales), lanes 0-7 the first sub-block's, 8-15 the second's.
TARGET inline Chunk k4_chunk(__m512i u, const uint8_t* blk, int j) {
  __m512 a, b;
  k4_block_scales(blk, &a, &b);
  const __m512i first = _mm512_set1_epi32(2 * j), second = _mm512_set1_epi32(2 * j + 1);
  const __m512i sub = _mm512_mask_blend_epi32(0xFF00, first, second);  // lane i: sub-block 2j + (i >= 8)
  return {u, _mm512_permutexvar_ps(sub, a), _mm512_permutexvar_ps(_mm512_add_epi32(sub, _mm512_set1_epi32(8)), b)};
}

template <> TARGET INLINE Chunk decode<Q4_K>(const uint8_t* row, int64_t c, bool) {
  const uint8_t* blk = row + (c / 4) * 144;
  const int j = (int)(c % 4);
  const __m256i q = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * j));
  return k4_chunk(fields(q, 0, 4, 4), blk, j);
}

template <> TARGET INLINE Chunk decode<Q5_K>(const uint8_t* row, int64_t c, bool) {
  const uint8_t* blk = row + (c / 4) * 176;
  const int j = (int)(c % 4);
  const __m256i q = _mm256_loadu_si256((const __m256i*)(blk + 48 + 32 * j));
  // the fifth bits: bit 2j (first half) and 2j + 1 (second half) of qh[l], worth 16
  const __m512i u = _mm512_or_si512(fields(q, 0, 4, 4),
                                    _mm512_slli_epi16(bits(_mm256_loadu_si256((const __m256i*)(blk + 16)), 2 * j), 4));
  return k4_chunk(u, blk, j);
}

template <> TARGET INLINE Chunk decode<Q6_K>(const uint8_t* row, int64_t c, bool) {
  const uint8_t* blk = row + (c / 4) * 210;
  const int j = (int)(c % 4), h = j / 2, odd = j % 2;
  const float d = half(blk + 208);
  const __m512i ql = _mm512_loadu_si512((const void*)(blk + 64 * h));
  const __m512i low = odd ? _mm512_and_si512(_mm512_srli_epi16(ql, 4), _mm512_set1_epi8(0x0f))
                          : _mm512_and_si512(ql, _mm512_set1_epi8(0x0f));
  const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
  const __m512i high = fields(qh, 4 * odd, 4 * odd + 2, 2);
  const __m512i u = _mm512_or_si512(low, _mm512_slli_epi16(high, 4));  // high <= 3: stays inside each byte
  const __m128i s = _mm_cvtepi8_epi32(_mm_cvtsi32_si128((int)u32(blk + 192 + 4 * j)));  // sub-blocks 4j .. 4j + 3
  return {u, by_quarter(_mm_mul_ps(_mm_set1_ps(d), _mm_cvtepi32_ps(s))), _mm512_setzero_ps()};
}

// The chunk element at byte position p (0..63).
template <int T> inline int element_at(int p) {
  if (!Traits<T>::SPLIT) return p;
  return (p & ~48) | ((p & 16) << 1) | ((p & 32) >> 1);  // bits 4 and 5 of p swapped
}

// Where row n of a matrix lies: one block of rows (parts == 1), or up to four row ranges of one type at their own
// addresses (a fused q/k/v or gate/up whose parts stay views of the file: linear_mixed), read in one pass.
struct RowsOf {
  const uint8_t* base[4];
  int64_t end[4];    // rows before the end of each part
  int parts;
  size_t row_bytes;  // set by the product (its type's bytes per row of K)
  INLINE const uint8_t* at(int64_t n) const {
    int i = 0;
    while (i + 1 < parts && n >= end[i]) ++i;
    return base[i] + (size_t)(n - (i ? end[i - 1] : 0)) * row_bytes;
  }
};

// Quantized activations of up to 8 rows, in type T's chunk order. Kp = K rounded up to 64. Q8: int8 per block of
// 32, 4 per int32 lane of vpdpbusd (the default). Q16: int16 per block of 32 (scale = the largest magnitude /
// 32767), 2 per int32 lane of vpdpwssd: ~2^-16 relative rounding instead of ~2^-8, for a run that agrees with the
// float model (twice the multiply instructions per weight).
template <typename Q>
struct Acts {
  std::vector<Q> q;          // (M, Kp)
  std::vector<float> xd;     // (M, Kp/LANE): the block scale of each lane
  std::vector<int32_t> off;  // (M, Kp/LANE): -OFFSET * the lane's sum of q (the products' starting value)
  std::vector<float> xs;     // (M, Kp/LANE): xd * the lane's sum of q (times b, for the types with MIN)
};

template <int T, typename Q>
void quantize_acts(const float* x, int64_t M, int64_t K, int64_t Kp, Acts<Q>& a) {
  constexpr int LANE = sizeof(Q) == 1 ? 4 : 2;          // elements per int32 lane
  constexpr float QMAX = sizeof(Q) == 1 ? 127.f : 32767.f;
  const size_t lanes = (size_t)Kp / LANE;
  if (a.q.size() < (size_t)M * Kp) a.q.resize((size_t)M * Kp);
  if (a.xd.size() < M * lanes) a.xd.resize(M * lanes), a.off.resize(M * lanes), a.xs.resize(M * lanes);
  Q nat[64];
  float scale[2];
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + (size_t)m * K;
    Q* q = a.q.data() + (size_t)m * Kp;
    for (int64_t c = 0; c < Kp; c += 64) {
      for (int blk = 0; blk < 2; ++blk) {  // the chunk's two 32-element blocks, natural order
        float amax = 0.f;
        for (int64_t k = c + 32 * blk; k < c + 32 * blk + 32 && k < K; ++k)
          amax = row[k] > amax ? row[k] : (-row[k] > amax ? -row[k] : amax);
        scale[blk] = amax / QMAX;
        for (int64_t i = 0; i < 32; ++i) {
          const int64_t k = c + 32 * blk + i;
          nat[32 * blk + i] = k < K && scale[blk] > 0.f ? (Q)__builtin_lrintf(row[k] / scale[blk]) : (Q)0;
        }
      }
      for (int p = 0; p < 64; ++p) q[c + p] = nat[element_at<T>(p)];
      for (int l = 0; l < 64 / LANE; ++l) {
        int32_t sum = 0;
        for (int i = 0; i < LANE; ++i) sum += q[c + LANE * l + i];
        const float d = scale[element_at<T>(LANE * l) / 32];
        const size_t at = (size_t)m * lanes + (size_t)(c / LANE + l);
        a.xd[at] = d;
        a.off[at] = -(int32_t)Traits<T>::OFFSET * sum;
        a.xs[at] = d * (float)sum;
      }
    }
  }
}

// One weight row times M activation rows: out[m] = the 16 lanes of partial sums (summed by over_rows).
template <int T, int M>
TARGET void tile(const RowsOf& W, const Acts<int8_t>& a, int64_t Kp, int64_t blocks, int64_t n,
                 __m512* out) {
  const uint8_t* row = W.at(n);
  const size_t lanes = (size_t)Kp / 4;
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int64_t chunks = Kp / 64;
  for (int64_t c = 0; c < chunks; ++c) {
    const bool two = Traits<T>::BLOCK == 256 || 2 * c + 1 < blocks;
    const Chunk w = decode<T>(row, c, two);
    for (int m = 0; m < M; ++m) {
      const size_t at = (size_t)m * lanes + (size_t)c * 16;
      const __m512i start = Traits<T>::OFFSET ? _mm512_loadu_si512((const void*)(a.off.data() + at))
                                              : _mm512_setzero_si512();
      const __m512i dot = _mm512_dpbusd_epi32(start, w.u,
                                              _mm512_loadu_si512((const void*)(a.q.data() + (size_t)m * Kp + 64 * c)));
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(a.xd.data() + at));
      __m512& s = acc[m][c & 1];  // two chains: the FMA latency is not the limit
      s = _mm512_fmadd_ps(t, w.a, s);
      if (Traits<T>::MIN) s = _mm512_fmadd_ps(w.b, _mm512_loadu_ps(a.xs.data() + at), s);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_add_ps(acc[m][0], acc[m][1]);
}

// The same with Q16 activations: the chunk's 64 bytes widened to two vectors of 32 int16 (bytes 0-31, 32-63), each
// vpdpwssd'd with its 32 activations into 16 lanes of 2 elements; lane i of the first half is the 4-byte lane
// i / 2, of the second 8 + i / 2 (their a and b permuted so).
template <int T, int M>
TARGET void tile16(const RowsOf& W, const Acts<int16_t>& a, int64_t Kp, int64_t blocks, int64_t n,
                   __m512* out) {
  const uint8_t* row = W.at(n);
  const size_t lanes = (size_t)Kp / 2;
  const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int64_t chunks = Kp / 64;
  for (int64_t c = 0; c < chunks; ++c) {
    const bool two = Traits<T>::BLOCK == 256 || 2 * c + 1 < blocks;
    const Chunk w = decode<T>(row, c, two);
    const __m512i u[2] = {_mm512_cvtepu8_epi16(_mm512_castsi512_si256(w.u)),
                          _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(w.u, 1))};
    const __m512 wa[2] = {_mm512_permutexvar_ps(first, w.a), _mm512_permutexvar_ps(second, w.a)};
    __m512 wb[2];
    if (Traits<T>::MIN) wb[0] = _mm512_permutexvar_ps(first, w.b), wb[1] = _mm512_permutexvar_ps(second, w.b);
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < 2; ++h) {
        const size_t at = (size_t)m * lanes + (size_t)c * 32 + 16 * h;
        const __m512i start = Traits<T>::OFFSET ? _mm512_loadu_si512((const void*)(a.off.data() + at))
                                                : _mm512_setzero_si512();
        const __m512i x = _mm512_loadu_si512((const void*)(a.q.data() + (size_t)m * Kp + 64 * c + 32 * h));
        const __m512i dot = _mm512_dpwssd_epi32(start, u[h], x);
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(a.xd.data() + at));
        __m512& s = acc[m][h];
        s = _mm512_fmadd_ps(t, wa[h], s);
        if (Traits<T>::MIN) s = _mm512_fmadd_ps(wb[h], _mm512_loadu_ps(a.xs.data() + at), s);
      }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_add_ps(acc[m][0], acc[m][1]);
}

// Float32 activations: each chunk dequantized in registers, 16 consecutive byte positions at a time (w = a * (u - o)
// + b, a single-rounded FMA where gguf-py rounds the product and the sum), then multiplied by the activations (in the
// type's chunk order, float32) with FMAs: the file's own weights in float32 arithmetic, the exact default. The
// dequantizing is done once per weight for all M rows, so it costs most at M = 1.
// The common types are widened straight from their stored bytes in natural element order (direct<T>, and direct_k<T> for the K-quants with their block's scales unpacked once: a 16-byte
// load widened to 16 int32 lanes, nibbles split by a mask and a shift, one FMA applying scale and offset), about
// half the instructions of going through the chunk decoder; the others use decode<T>'s chunk (tilef below). The
// 4-bit types look their values up instead (nibble_values). One thread, 2048 x 2048, one row: Q4_0 290 -> 251 us,
// Q4_1 283 -> 249, Q4_K 302 -> 268; not Q5_0 (32 values: two permutes and a blend per 16, 349 -> 374 us).
template <int T> struct Direct { enum { ON = 0 }; };
template <> struct Direct<Q4_0> { enum { ON = 1 }; };
template <> struct Direct<Q4_1> { enum { ON = 1 }; };
template <> struct Direct<Q8_0> { enum { ON = 1 }; };
template <> struct Direct<Q5_0> { enum { ON = 1 }; };
template <> struct Direct<Q5_1> { enum { ON = 1 }; };

// 16 bytes -> 16 int32 lanes (zero- or sign-extended) as floats.
TARGET inline __m512i widen_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }

// Chunk c's 64 weights (elements 64c .. 64c + 63, natural order) as four vectors of 16 floats: w = a * q + b as
// gguf-py computes it, the product and sum fused (one rounding instead of two). `two`: for the 32-blocks, whether
// block 2c + 1 exists (its vectors are zero otherwise).
template <int T> TARGET INLINE void direct(const uint8_t* row, int64_t c, bool two, __m512* w);

// The 4-bit types look their values up: a block's 16 possible weights a * q + b (q = 0..15, the same fused
// multiply-add gguf-py's value is, so the same bits) in one vector, and each element's nibble picks its lane
// (vpermps reads an index's low 4 bits only, so the low nibbles need no mask). One permute replaces a conversion
// and a multiply-add per 16 weights.
TARGET INLINE __m512 nibble_values(float a, float b) {
  const __m512 q = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  return _mm512_fmadd_ps(q, _mm512_set1_ps(a), _mm512_set1_ps(b));
}

template <> TARGET INLINE void direct<Q4_0>(const uint8_t* row, int64_t c, bool two, __m512* w) {
  for (int i = 0; i < 2; ++i) {
    if (i == 1 && !two) { w[2] = w[3] = _mm512_setzero_ps(); break; }
    const uint8_t* b = row + (2 * c + i) * 18;
    const __m512 table = nibble_values(half(b), -8.f * half(b));
    const __m512i v = widen_u8(b + 2);
    w[2 * i] = _mm512_permutexvar_ps(v, table);                           // elements 0-15: low nibbles
    w[2 * i + 1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);  // 16-31: high nibbles
  }
}

template <> TARGET INLINE void direct<Q4_1>(const uint8_t* row, int64_t c, bool two, __m512* w) {
  for (int i = 0; i < 2; ++i) {
    if (i == 1 && !two) { w[2] = w[3] = _mm512_setzero_ps(); break; }
    const uint8_t* b = row + (2 * c + i) * 20;
    const __m512 table = nibble_values(half(b), half(b + 2));
    const __m512i v = widen_u8(b + 4);
    w[2 * i] = _mm512_permutexvar_ps(v, table);
    w[2 * i + 1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
  }
}

template <> TARGET INLINE void direct<Q8_0>(const uint8_t* row, int64_t c, bool two, __m512* w) {
  for (int i = 0; i < 2; ++i) {
    if (i == 1 && !two) { w[2] = w[3] = _mm512_setzero_ps(); break; }
    const uint8_t* b = row + (2 * c + i) * 34;
    const __m512 d = _mm512_set1_ps(half(b));
    for (int h = 0; h < 2; ++h)
      w[2 * i + h] = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2 + 16 * h)))), d);
  }
}

// Q5_0 / Q5_1: as Q4_0 / Q4_1 with a fifth bit per element, bit j of qh (elements 0-15: bits 0-15 of qh, the low
// nibbles; 16-31: bits 16-31, the high nibbles), worth 16: a masked add.
TARGET INLINE void q5_block(__m512 d, __m512 off, const uint8_t* qh, const uint8_t* qs, __m512* w) {
  const __m512i nib = _mm512_set1_epi32(0x0f), sixteen = _mm512_set1_epi32(16);
  const uint32_t h = u32(qh);
  const __m512i v = widen_u8(qs);
  const __m512i lo = _mm512_mask_add_epi32(_mm512_and_si512(v, nib), (__mmask16)(h & 0xffff), _mm512_and_si512(v, nib),
                                           sixteen);
  const __m512i hi = _mm512_mask_add_epi32(_mm512_srli_epi32(v, 4), (__mmask16)(h >> 16), _mm512_srli_epi32(v, 4),
                                           sixteen);
  w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), d, off);
  w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), d, off);
}

template <> TARGET INLINE void direct<Q5_0>(const uint8_t* row, int64_t c, bool two, __m512* w) {
  for (int i = 0; i < 2; ++i) {
    if (i == 1 && !two) { w[2] = w[3] = _mm512_setzero_ps(); break; }
    const uint8_t* b = row + (2 * c + i) * 22;
    q5_block(_mm512_set1_ps(half(b)), _mm512_set1_ps(-16.f * half(b)), b + 2, b + 6, w + 2 * i);
  }
}

template <> TARGET INLINE void direct<Q5_1>(const uint8_t* row, int64_t c, bool two, __m512* w) {
  for (int i = 0; i < 2; ++i) {
    if (i == 1 && !two) { w[2] = w[3] = _mm512_setzero_ps(); break; }
    const uint8_t* b = row + (2 * c + i) * 24;
    q5_block(_mm512_set1_ps(half(b)), _mm512_set1_ps(half(b + 2)), b + 4, b + 8, w + 2 * i);
  }
}

// The K-quants' scales, unpacked once per 256-element block into vectors (not per chunk, scalar): `a` the weight
// scales and `b` the offsets, one lane per sub-block; tilef stores them as floats for direct_k to broadcast.
template <int T> struct KScales { enum { ON = 0 }; };
template <> struct KScales<Q4_K> { enum { ON = 1 }; };
template <> struct KScales<Q5_K> { enum { ON = 1 }; };
template <> struct KScales<Q6_K> { enum { ON = 1 }; };

// Q6_K: 16 int8 scales at blk + 192, one per 16 elements: a = d * sc, b = -32 a.
TARGET inline void q6k_block_scales(const uint8_t* blk, __m512* a, __m512* b) {
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 192))));
  *a = _mm512_mul_ps(_mm512_set1_ps(half(blk + 208)), v);
  *b = _mm512_mul_ps(_mm512_set1_ps(-32.f), *a);
}

template <int T> TARGET INLINE void block_scales(const uint8_t* blk, __m512* a, __m512* b);
template <> TARGET INLINE void block_scales<Q4_K>(const uint8_t* blk, __m512* a, __m512* b) { k4_block_scales(blk, a, b); }
template <> TARGET INLINE void block_scales<Q5_K>(const uint8_t* blk, __m512* a, __m512* b) { k4_block_scales(blk, a, b); }
template <> TARGET INLINE void block_scales<Q6_K>(const uint8_t* blk, __m512* a, __m512* b) { q6k_block_scales(blk, a, b); }

// Chunk c's 64 weights of a K-quant as direct<T>'s four vectors, its block's scales given as floats (block_scales,
// stored: s[i] the weight scale of sub-block i, s[16 + i] its offset). Each vector takes one scale, broadcast from
// memory (a load, not a permute on the vector units that the FMAs need).
template <int T> TARGET INLINE void direct_k(const uint8_t* row, int64_t c, const float* s, __m512* w);

// Q4_K: chunk c is sub-blocks 2j (the low nibbles of qs[32j .. 32j + 32)) and 2j + 1 (their high nibbles) of block
// c / 4, j = c % 4; w = d * sc * q - dmin * m.
template <> TARGET INLINE void direct_k<Q4_K>(const uint8_t* row, int64_t c, const float* s, __m512* w) {
  const uint8_t* blk = row + (c / 4) * 144;
  const int j = (int)(c % 4);
  const __m512 t0 = nibble_values(s[2 * j], s[24 + 2 * j]), t1 = nibble_values(s[2 * j + 1], s[25 + 2 * j]);
  for (int h = 0; h < 2; ++h) {
    const __m512i v = widen_u8(blk + 16 + 32 * j + 16 * h);
    w[h] = _mm512_permutexvar_ps(v, t0);
    w[2 + h] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t1);
  }
}

// 32 bytes (values < 256) -> the four vectors of 16 floats times a (lanes 0-15 and 16-31 by a0, the rest by a1) plus
// b: the bit fiddling done on bytes (one 256-bit operation per 32 weights), the widening last.
TARGET INLINE void widen_scaled(__m256i u0, __m256i u1, __m512 a0, __m512 b0, __m512 a1, __m512 b1, __m512* w) {
  w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(u0))), a0, b0);
  w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(u0, 1))), a0, b0);
  w[2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(u1))), a1, b1);
  w[3] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(u1, 1))), a1, b1);
}

// Q5_K: Q4_K's layout plus qh[32] at blk + 16: element l of sub-block 2j has its fifth bit at bit 2j of qh[l], of
// sub-block 2j + 1 at bit 2j + 1 (worth 16); the nibbles sit at blk + 48. (16-bit lane shifts are safe here: the
// masks keep only bits that came from the same byte.)
template <> TARGET INLINE void direct_k<Q5_K>(const uint8_t* row, int64_t c, const float* s, __m512* w) {
  const uint8_t* blk = row + (c / 4) * 176;
  const int j = (int)(c % 4);
  const __m256i nib = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
  const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 48 + 32 * j));
  const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 16));
  const __m256i f0 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one);
  const __m256i f1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one);
  const __m256i q0 = _mm256_or_si256(_mm256_and_si256(v, nib), _mm256_slli_epi16(f0, 4));
  const __m256i q1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib), _mm256_slli_epi16(f1, 4));
  widen_scaled(q0, q1, _mm512_set1_ps(s[2 * j]), _mm512_set1_ps(s[24 + 2 * j]), _mm512_set1_ps(s[2 * j + 1]),
               _mm512_set1_ps(s[25 + 2 * j]), w);
}

// Q6_K: chunk c is elements [64 odd, 64 odd + 64) of half h = j / 2 of block c / 4 (j = c % 4, odd = j % 2):
// element l (0..31) from ql[l] and element 32 + l from ql[32 + l], their nibble `odd` and the 2-bit field 2 odd
// (resp. 2 odd + 1) of qh[l]; w = d * sc * (q - 32), 16 elements per int8 scale. The 6-bit values are assembled
// on bytes, 32 at a time (16-bit lane shifts: the masks keep only bits of the same byte).
template <> TARGET INLINE void direct_k<Q6_K>(const uint8_t* row, int64_t c, const float* s, __m512* w) {
  const uint8_t* blk = row + (c / 4) * 210;
  const int j = (int)(c % 4), h = j / 2, odd = j % 2;
  const uint8_t* ql = blk + 64 * h;
  const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
  const __m256i nib = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3);
  for (int second = 0; second < 2; ++second) {  // elements 32 second + l, l = 0..31: ql[32 second + l], qh[l]
    const __m256i v = _mm256_loadu_si256((const __m256i*)(ql + 32 * second));
    const __m256i lo = _mm256_and_si256(odd ? _mm256_srli_epi16(v, 4) : v, nib);
    const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, 4 * odd + 2 * second), three);
    const __m256i u = _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4));  // q + 32
    // sub-blocks (16 elements) 2 second + 4 odd and the next of half h; (q + 32) * a - 32 a
    const int i = 8 * h + 2 * second + 4 * odd;
    for (int half16 = 0; half16 < 2; ++half16) {
      const __m128i part = half16 ? _mm256_extracti128_si256(u, 1) : _mm256_castsi256_si128(u);
      w[half16 + 2 * second] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(part)),
                                               _mm512_set1_ps(s[i + half16]), _mm512_set1_ps(s[16 + i + half16]));
    }
  }
}

template <int T>
void order_acts(const float* x, int64_t M, int64_t K, int64_t Kp, std::vector<float>& out) {
  if (out.size() < (size_t)M * Kp) out.resize((size_t)M * Kp);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + (size_t)m * K;
    float* o = out.data() + (size_t)m * Kp;
    if (!Traits<T>::SPLIT || Direct<T>::ON) {
      memcpy(o, row, (size_t)K * 4);
      for (int64_t k = K; k < Kp; ++k) o[k] = 0.f;
      continue;
    }
    for (int64_t c = 0; c < Kp; c += 64)
      for (int p = 0; p < 64; ++p) {
        const int64_t k = c + element_at<T>(p);
        o[c + p] = k < K ? row[k] : 0.f;
      }
  }
}

template <int T, int M>
TARGET void tilef(const RowsOf& W, const float* x, int64_t Kp, int64_t blocks, int64_t n,
                  __m512* out) {
  const uint8_t* row = W.at(n);
  const __m512i off = _mm512_set1_epi32(Traits<T>::OFFSET);
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  // Two independent sums per row (parts 0 and 2, parts 1 and 3 of each 64): at one row a single chain would wait on
  // the FMA latency. Not four: at eight rows 8 x 4 accumulators fill all 32 registers and the compiler spills them
  // (Q4_K at eight rows 2350 -> 1462 us on 2048 x 2048, one row unchanged). The same two for every M, so that a
  // row's numbers never depend on the rows sharing the call (batch invariance), as int4.cpp's.
  constexpr int A = 2;
  __m512 acc[M][A];
  for (int m = 0; m < M; ++m)
    for (int a = 0; a < A; ++a) acc[m][a] = _mm512_setzero_ps();
  const int64_t chunks = Kp / 64;
  alignas(64) float scales[32];  // a K-quant block's scales (KScales): weight scales, then offsets
  for (int64_t c = 0; c < chunks; ++c) {
    const bool two = Traits<T>::BLOCK == 256 || 2 * c + 1 < blocks;
    __m512 wf[4];
    if constexpr (KScales<T>::ON) {
      if (c % 4 == 0) {  // once per 256 weights
        __m512 sa, sb;
        block_scales<T>(row + (c / 4) * Traits<T>::BYTES, &sa, &sb);
        _mm512_store_ps(scales, sa);
        _mm512_store_ps(scales + 16, sb);
      }
      direct_k<T>(row, c, scales, wf);
    } else if constexpr (Direct<T>::ON) {
      direct<T>(row, c, two, wf);
    } else {
    const Chunk w = decode<T>(row, c, two);
    for (int part = 0; part < 4; ++part) {  // byte positions [16 part, 16 part + 16)
      __m128i u16;
      switch (part) {  // the extract's lane index must be a constant
        case 0: u16 = _mm512_castsi512_si128(w.u); break;
        case 1: u16 = _mm512_extracti32x4_epi32(w.u, 1); break;
        case 2: u16 = _mm512_extracti32x4_epi32(w.u, 2); break;
        default: u16 = _mm512_extracti32x4_epi32(w.u, 3); break;
      }
      const __m512i lane = _mm512_add_epi32(idx, _mm512_set1_epi32(4 * part));
      const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(u16), off));
      const __m512 a = _mm512_permutexvar_ps(lane, w.a);
      wf[part] = Traits<T>::MIN ? _mm512_fmadd_ps(a, q, _mm512_permutexvar_ps(lane, w.b)) : _mm512_mul_ps(a, q);
    }
    }
    for (int m = 0; m < M; ++m) {
      const float* xm = x + (size_t)m * Kp + 64 * c;
      for (int p = 0; p < 4; ++p) acc[m][p % A] = _mm512_fmadd_ps(wf[p], _mm512_loadu_ps(xm + 16 * p), acc[m][p % A]);
    }
  }
  for (int m = 0; m < M; ++m) {
    __m512 s = acc[m][0];
    for (int a = 1; a < A; ++a) s = _mm512_add_ps(s, acc[m][a]);
    out[m] = s;
  }
}

template <int T, int M>
TARGET void runf(const RowsOf& W, const float* xo, const float* bias, int64_t N, int64_t K, int64_t Kp, void* y,
                 int out_kind) {
  const int64_t blocks = K / Traits<T>::BLOCK;
  auto one = [&](int64_t n, __m512* v) { tilef<T, M>(W, xo, Kp, blocks, n, v); };
  over_rows<M, 1>(one, one, N, K, nullptr, nullptr, bias, y, out_kind);
}

template <int T>
int linear_f32(RowsOf W, const float* x, const float* bias, int64_t M, int64_t N, int64_t K, void* y,
               int out_kind) {
  if (K % Traits<T>::BLOCK || M > 16) return 1;
  W.row_bytes = (size_t)(K / Traits<T>::BLOCK) * Traits<T>::BYTES;
  const int64_t Kp = (K + 63) / 64 * 64;
  static thread_local std::vector<float> xo;
  for (int64_t m0 = 0; m0 < M; m0 += 8) {  // up to 8 activation rows per pass over the weights
    const int64_t rows = M - m0 < 8 ? M - m0 : 8;
    order_acts<T>(x + (size_t)m0 * K, rows, K, Kp, xo);
    char* yo = (char*)y + (size_t)m0 * N * (out_kind == OUT_F32 ? 4 : 2);
    switch (rows) {
      case 1: runf<T, 1>(W, xo.data(), bias, N, K, Kp, yo, out_kind); break;
      case 2: runf<T, 2>(W, xo.data(), bias, N, K, Kp, yo, out_kind); break;
      case 3: runf<T, 3>(W, xo.data(), bias, N, K, Kp, yo, out_kind); break;
      case 4: runf<T, 4>(W, xo.data(), bias, N, K, Kp, yo, out_kind); break;
      case 5: runf<T, 5>(W, xo.data(), bias, N, K, Kp, yo, out_kind); break;
      case 6: runf<T, 6>(W, xo.data(), bias, N, K, Kp, yo, out_kind); break;
      case 7: runf<T, 7>(W, xo.data(), bias, N, K, Kp, yo, out_kind); break;
      default: runf<T, 8>(W, xo.data(), bias, N, K, Kp, yo, out_kind); break;
    }
  }
  return 0;
}

template <int T, int M, typename Q>
TARGET void run(const RowsOf& W, const Acts<Q>& a, const float* bias, int64_t N, int64_t K, int64_t Kp, void* y,
                int out_kind) {
  const int64_t blocks = K / Traits<T>::BLOCK;
  auto one = [&](int64_t n, __m512* v) {
    if constexpr (sizeof(Q) == 1) tile<T, M>(W, a, Kp, blocks, n, v);
    else tile16<T, M>(W, a, Kp, blocks, n, v);
  };
  over_rows<M, 1>(one, one, N, K, nullptr, nullptr, bias, y, out_kind);
}

template <int T, typename Q>
int linear(RowsOf W, const float* x, const float* bias, int64_t M, int64_t N, int64_t K, void* y,
           int out_kind) {
  if (K % Traits<T>::BLOCK || M > 16) return 1;
  W.row_bytes = (size_t)(K / Traits<T>::BLOCK) * Traits<T>::BYTES;
  const int64_t Kp = (K + 63) / 64 * 64;
  static thread_local Acts<Q> a;
  for (int64_t m0 = 0; m0 < M; m0 += 8) {  // up to 8 activation rows per pass over the weights
    const int64_t rows = M - m0 < 8 ? M - m0 : 8;
    quantize_acts<T, Q>(x + (size_t)m0 * K, rows, K, Kp, a);
    char* yo = (char*)y + (size_t)m0 * N * (out_kind == OUT_F32 ? 4 : 2);
    switch (rows) {
      case 1: run<T, 1, Q>(W, a, bias, N, K, Kp, yo, out_kind); break;
      case 2: run<T, 2, Q>(W, a, bias, N, K, Kp, yo, out_kind); break;
      case 3: run<T, 3, Q>(W, a, bias, N, K, Kp, yo, out_kind); break;
      case 4: run<T, 4, Q>(W, a, bias, N, K, Kp, yo, out_kind); break;
      case 5: run<T, 5, Q>(W, a, bias, N, K, Kp, yo, out_kind); break;
      case 6: run<T, 6, Q>(W, a, bias, N, K, Kp, yo, out_kind); break;
      case 7: run<T, 7, Q>(W, a, bias, N, K, Kp, yo, out_kind); break;
      default: run<T, 8, Q>(W, a, bias, N, K, Kp, yo, out_kind); break;
    }
  }
  return 0;
}

// acts: ACT_I8 (llama.cpp's arithmetic), ACT_I16, ACT_F32 (exact).
enum Acts_ { ACT_I8 = 0, ACT_I16 = 1, ACT_F32 = 2 };

template <int T>
int linear_any(const RowsOf& W, const float* x, const float* bias, int64_t M, int64_t N, int64_t K, void* y,
               int out_kind, int acts) {
  if (acts == ACT_F32) return linear_f32<T>(W, x, bias, M, N, K, y, out_kind);
  return acts == ACT_I16 ? linear<T, int16_t>(W, x, bias, M, N, K, y, out_kind)
                         : linear<T, int8_t>(W, x, bias, M, N, K, y, out_kind);
}

// One row dequantized: element e = a * (u - o) (+ b), each product and sum rounded once in float32 as gguf-py's
// numpy does it.
template <int T>
TARGET void dequant_row(const uint8_t* row, int64_t K, void* out, int out_kind) {
  const int64_t blocks = K / Traits<T>::BLOCK;
  const __m512i off = _mm512_set1_epi32(Traits<T>::OFFSET);
  for (int64_t c = 0; c < (K + 63) / 64; ++c) {
    const bool two = Traits<T>::BLOCK == 256 || 2 * c + 1 < blocks;
    const Chunk w = decode<T>(row, c, two);
    for (int part = 0; part < 4; ++part) {  // byte positions [16 part, 16 part + 16): 16 consecutive elements
      const int64_t e = 64 * c + element_at<T>(16 * part);
      if (e >= K) continue;
      const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
      const __m512i lane = _mm512_add_epi32(idx, _mm512_set1_epi32(4 * part));
      __m128i u16 = _mm512_extracti32x4_epi32(w.u, 0);
      switch (part) {  // the extract's lane index must be a constant
        case 1: u16 = _mm512_extracti32x4_epi32(w.u, 1); break;
        case 2: u16 = _mm512_extracti32x4_epi32(w.u, 2); break;
        case 3: u16 = _mm512_extracti32x4_epi32(w.u, 3); break;
      }
      const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(u16), off));
      __m512 v = _mm512_mul_ps(_mm512_permutexvar_ps(lane, w.a), q);
      if (Traits<T>::MIN) v = _mm512_add_ps(v, _mm512_permutexvar_ps(lane, w.b));
      const __mmask16 mask = K - e >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - e)) - 1u);
      if (out_kind == OUT_F32)
        _mm512_mask_storeu_ps((float*)out + e, mask, v);
      else
        _mm256_mask_storeu_epi16((uint16_t*)out + e, mask, to_bf16x16(v));
    }
  }
}

template <int T>
int dequantize(const uint8_t* W, int64_t first, int64_t N, int64_t K, void* out, int out_kind) {
  if (K % Traits<T>::BLOCK || first < 0) return 1;
  const size_t row_bytes = (size_t)(K / Traits<T>::BLOCK) * Traits<T>::BYTES;
  const size_t out_row = (size_t)K * (out_kind == OUT_F32 ? 4 : 2);
  W += (size_t)first * row_bytes;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 18))
  for (int64_t n = 0; n < N; ++n) dequant_row<T>(W + n * row_bytes, K, (char*)out + n * out_row, out_kind);
  return 0;
}

// Rows [first, first + N) of W of one ggml type dequantized (dequantize<T>); 1 for an unknown type.
int dequantize_rows(int type, const uint8_t* W, int64_t first, int64_t N, int64_t K, void* out, int out_kind) {
  switch (type) {
    case Q4_0: return dequantize<Q4_0>(W, first, N, K, out, out_kind);
    case Q4_1: return dequantize<Q4_1>(W, first, N, K, out, out_kind);
    case Q5_0: return dequantize<Q5_0>(W, first, N, K, out, out_kind);
    case Q5_1: return dequantize<Q5_1>(W, first, N, K, out, out_kind);
    case Q8_0: return dequantize<Q8_0>(W, first, N, K, out, out_kind);
    case Q2_K: return dequantize<Q2_K>(W, first, N, K, out, out_kind);
    case Q3_K: return dequantize<Q3_K>(W, first, N, K, out, out_kind);
    case Q4_K: return dequantize<Q4_K>(W, first, N, K, out, out_kind);
    case Q5_K: return dequantize<Q5_K>(W, first, N, K, out, out_kind);
    case Q6_K: return dequantize<Q6_K>(W, first, N, K, out, out_kind);
    default: return 1;
  }
}

}  // namespace

extern "C" int nt_linear_ggml(int type, const uint8_t* W, const float* x, const float* bias, int64_t M, int64_t N,
                              int64_t K, void* y, int out_kind);

namespace {

// A matrix whose row ranges are of different types (a fused q/k/v or gate/up of a Q4_K_M file, whose v and down
// rows are Q6_K in some layers): desc = [count, then per part: rows, type, address of its blocks]. Consecutive parts
// of one type (up to four: a fused matrix's tensors, kept as views of the file) are one pass over their rows
// (RowsOf); where the matrix has several types, each such run's product goes through a buffer into its columns of y.
const int MIXED = GGML_MIXED;  // nt_abi.h's flags on the type
const int Q16 = GGML_Q16;      // int16 activations (Acts<int16_t>) instead of int8
const int F32 = GGML_F32;      // float32 activations (tilef): the exact product
const int FLAGS = Q16 | F32;

// The product over rows W of one ggml type (type | flags: the activations, as nt_linear_ggml's).
int linear_rows(int type, const RowsOf& W, const float* x, const float* bias, int64_t M, int64_t N, int64_t K, void* y,
                int out_kind) {
  const int flags = type & FLAGS;
  const int acts = flags & F32 ? ACT_F32 : flags & Q16 ? ACT_I16 : ACT_I8;
  switch (type & ~FLAGS) {
    case Q4_0: return linear_any<Q4_0>(W, x, bias, M, N, K, y, out_kind, acts);
    case Q4_1: return linear_any<Q4_1>(W, x, bias, M, N, K, y, out_kind, acts);
    case Q5_0: return linear_any<Q5_0>(W, x, bias, M, N, K, y, out_kind, acts);
    case Q5_1: return linear_any<Q5_1>(W, x, bias, M, N, K, y, out_kind, acts);
    case Q8_0: return linear_any<Q8_0>(W, x, bias, M, N, K, y, out_kind, acts);
    case Q2_K: return linear_any<Q2_K>(W, x, bias, M, N, K, y, out_kind, acts);
    case Q3_K: return linear_any<Q3_K>(W, x, bias, M, N, K, y, out_kind, acts);
    case Q4_K: return linear_any<Q4_K>(W, x, bias, M, N, K, y, out_kind, acts);
    case Q5_K: return linear_any<Q5_K>(W, x, bias, M, N, K, y, out_kind, acts);
    case Q6_K: return linear_any<Q6_K>(W, x, bias, M, N, K, y, out_kind, acts);
    default: return 1;
  }
}

int linear_mixed(const int64_t* desc, const float* x, const float* bias, int64_t M, int64_t N, int64_t K, void* y,
                 int out_kind, int flags) {
  const size_t es = out_kind == OUT_F32 ? 4 : 2;
  static thread_local std::vector<char> part;
  int64_t n0 = 0;
  for (int64_t i = 0; i < desc[0];) {  // a run of up to four consecutive parts of one type at a time
    const int64_t type = desc[2 + 3 * i];
    if (type == MIXED || type == MXFP4) return 1;
    RowsOf W{{}, {}, 0, 0};
    int64_t rows = 0;
    for (; i < desc[0] && desc[2 + 3 * i] == type && W.parts < 4; ++i) {
      W.base[W.parts] = (const uint8_t*)(intptr_t)desc[3 + 3 * i];
      W.end[W.parts++] = rows += desc[1 + 3 * i];
    }
    if (n0 + rows > N) return 1;
    if (rows == N)  // the whole matrix: straight into y
      return linear_rows((int)type | flags, W, x, bias, M, N, K, y, out_kind);
    part.resize((size_t)M * rows * es);
    if (linear_rows((int)type | flags, W, x, bias ? bias + n0 : nullptr, M, rows, K, part.data(), out_kind)) return 1;
    for (int64_t m = 0; m < M; ++m) memcpy((char*)y + ((size_t)m * N + n0) * es, part.data() + (size_t)m * rows * es,
                                           (size_t)rows * es);
    n0 += rows;
  }
  return n0 == N ? 0 : 1;
}

}  // namespace

extern "C" {

int nt_ggml_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
}

// W: (N, K / block * block bytes) ggml blocks of `type` (ggml's type id); x: (M, K) float32; bias (N,) or NULL;
// y: (M, N) float32 or bfloat16. Returns 0, or 1 for an unknown type, K not whole blocks, or M > 16. Type 255: W is
// a description of row ranges of different types (linear_mixed). type | 256: int16 activations per block of 32
// (vpdpwssd) instead of int8: within ~2^-16 of the float product. type | 512: float32 activations, the chunks
// dequantized in registers (tilef): the float32 product of the file's own weights, the default.
extern "C" int nt_linear_mxfp4(const uint8_t* W, const float* x, const float* bias, int64_t M, int64_t N, int64_t K,
                               float* y);  // csrc/mxfp4.cpp

int nt_linear_ggml(int type, const uint8_t* W, const float* x, const float* bias, int64_t M, int64_t N, int64_t K,
                   void* y, int out_kind) {
  const int flags = type & FLAGS;
  if ((type & ~FLAGS) == MIXED) return linear_mixed((const int64_t*)W, x, bias, M, N, K, y, out_kind, flags);
  // gpt-oss's experts (quant/mxfp4.py's Mxfp4Linear): csrc/mxfp4.cpp's exact float32 product, whatever the flags
  if ((type & ~FLAGS) == MXFP4) return out_kind == OUT_F32 ? nt_linear_mxfp4(W, x, bias, M, N, K, (float*)y) : 1;
  const RowsOf one{{W}, {N}, 1, 0};
  return linear_rows(type, one, x, bias, M, N, K, y, out_kind);
}

// A GGUF array of n strings at buf[at, size): each a little-endian u64 byte count, then the bytes (gguf.md). With
// out NULL, returns the offset just after the array (-1 when a string runs past size); with out (room for that many
// bytes less `at`, which always suffices: each 8-byte count becomes one separator), also copies the strings there
// joined by NUL bytes, their total length in *out_len, and *nul = 1 when a string holds a NUL byte of its own (then
// the join cannot be split back). The reader's one loop over a vocabulary (model/weights/gguf_reader.py).
int64_t nt_gguf_strings(const uint8_t* buf, int64_t size, int64_t at, int64_t n, uint8_t* out, int64_t* out_len,
                        int* nul) {
  int64_t o = 0;
  int has_nul = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (at > size - 8) return -1;
    uint64_t len;
    memcpy(&len, buf + at, 8);
    at += 8;
    if (len > (uint64_t)(size - at)) return -1;
    if (out) {
      if (i) out[o++] = 0;
      memcpy(out + o, buf + at, len);
      has_nul |= memchr(buf + at, 0, len) != nullptr;
      o += (int64_t)len;
    }
    at += (int64_t)len;
  }
  if (out) *out_len = o, *nul = has_nul;
  return at;
}

// Row `id` of W (type | flags; type 255: W a description of parts, as nt_linear_ggml reads it) dequantized to K
// float32s: the native step's token table lookup (decode.cpp's embed), the values nt_dequantize_ggml gives that
// row. Returns 1 for an unknown type, K not whole blocks or an id past the rows.
int nt_ggml_row(int type, const uint8_t* W, int64_t id, int64_t K, float* out) {
  type &= ~FLAGS;
  if (type != MIXED) return dequantize_rows(type, W, id, 1, K, out, OUT_F32);
  const int64_t* desc = (const int64_t*)W;  // [count, then per part: rows, type, address]
  for (int64_t i = 0, n0 = 0; i < desc[0]; n0 += desc[1 + 3 * i], ++i)
    if (id < n0 + desc[1 + 3 * i])
      return dequantize_rows((int)desc[2 + 3 * i], (const uint8_t*)(intptr_t)desc[3 + 3 * i], id - n0, 1, K, out,
                             OUT_F32);
  return 1;
}

// Rows [0, N) of W dequantized to (N, K) float32 or bfloat16 (bfloat16: the float32 value rounded once).
int nt_dequantize_ggml(int type, const uint8_t* W, int64_t N, int64_t K, void* out, int out_kind) {
  return dequantize_rows(type, W, 0, N, K, out, out_kind);
}
}
