// One whole decode step of a decoder in one call: every layer, the final norm and the LM head, for every family
// nexttoken loads (Llama, Mistral, Qwen 2 / 3, OLMo 2, Granite, Gemma 2 / 3, Phi-3, the MoEs).
//
// For small models the weights stream in ~2 ms per token, while a step assembled from ~280 PyTorch operations
// spends about as long again in dispatch and allocation. This file runs the step llama2.c's way: float32
// activations in a few reused buffers, the matrix products through nt_linear (gemv.cpp, which splits them across
// the OpenMP threads), and the small operations between them (RMSNorm, RoPE, the KV-cache write, attention,
// SiLU) as plain loops. It applies to decode steps only (one new token per row, every cache column visible but
// for the sliding layers' window, which is computed here, float32 activations); anything else takes the PyTorch
// path, which is the reference this is tested against (same tokens, logits within float32 rounding).
//
// The families are switches on the one block (NtModel.flags and the fields after it): q/k norms before RoPE,
// Gemma's (1 + w) norms around each branch, OLMo 2's norms after each branch, Granite's multipliers, GeGLU,
// soft-caps, sliding-window layers with their own RoPE, LongRoPE, gpt-oss's attention sinks and clamped SwiGLU,
// mixture-of-experts MLPs that run only the chosen experts' products, and Gemma 4's block (each layer's own head
// dims and KV heads in the cache's widest columns, KV-shared layers, per-layer inputs, the experts beside the MLP).
//
// The arithmetic follows the PyTorch modules operation by operation (normalise then scale, rotate as
// x*cos + roll(x)*signed_sin, softmax over scaled scores); it is built with -ffp-contract=off so the compiler
// does not fuse those multiplies and adds into FMAs that the reference does not do.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "nt_abi.h"

extern "C" int nt_linear(const void* W, int kind, const float* x, const float* bias, const float* scale, int64_t M,
                         int64_t N, int64_t K, void* y, int out_kind);
extern "C" int nt_argmax_f32(const float* x, int64_t M, int64_t N, int64_t* out);
extern "C" int nt_ggml_row(int type, const uint8_t* W, int64_t id, int64_t K, float* out);
extern "C" int nt_recurrent_half(const NtModel* m, const NtLayer* L, const float* h, int64_t B, float* out);


namespace {

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

// A layer's own shapes (Gemma 4's NtLayer.head_dim / n_kv_heads / intermediate), else the model's.
int64_t head_dim(const NtModel& m, const NtLayer& L) { return L.head_dim ? L.head_dim : m.head_dim; }
int64_t kv_heads(const NtModel& m, const NtLayer& L) { return L.n_kv_heads ? L.n_kv_heads : m.n_kv_heads; }
int64_t mlp_width(const NtModel& m, const NtLayer& L) { return L.intermediate ? L.intermediate : m.intermediate; }
int64_t kv_dim(const NtModel& m) { return m.kv_dim ? m.kv_dim : m.head_dim; }  // a cache column's width

struct Widest {  // the widest of any layer: head dim, K/V width, gated MLP (dense, expert or shared expert)
  int64_t D, KVD, I;
  explicit Widest(const NtModel& m) : D(m.head_dim), KVD(m.n_kv_heads * m.head_dim), I(m.intermediate) {
    I = m.moe_intermediate > I ? m.moe_intermediate : I;
    I = m.shared_intermediate > I ? m.shared_intermediate : I;
    for (int64_t l = 0; l < m.n_layers; ++l) {
      const NtLayer& L = m.layers[l];
      const int64_t d = head_dim(m, L), kvd = kv_heads(m, L) * d, i = mlp_width(m, L);
      D = d > D ? d : D, KVD = kvd > KVD ? kvd : KVD, I = i > I ? i : I;
    }
  }
};

struct Scratch {  // per calling thread, grown on demand and reused across steps
  std::vector<float> h, qkv, att, tmp, gu, act, cos, sin, cos_l, sin_l, moe_in, moe_out, route, gated, gate;
  void fit(const NtModel& m, int64_t B) {
    const Widest w(m);
    const int64_t C = m.hidden, HD = m.n_heads * w.D, I = w.I;
    grow(h, B * C), grow(tmp, B * C), grow(att, B * HD), grow(act, B * I), grow(gu, B * 2 * I);
    grow(qkv, B * (HD + 2 * w.KVD)), grow(cos, B * w.D), grow(sin, B * w.D);
    grow(cos_l, B * m.head_dim), grow(sin_l, B * m.head_dim);
    if (m.n_experts) grow(moe_in, B * C), grow(moe_out, B * C), grow(route, B * m.n_experts);
    grow(gated, B * (2 * HD + 2 * w.KVD)), grow(gate, B * HD);  // Qwen3.5's gated attention; Gemma 4's q [; k]
  }
  static void grow(std::vector<float>& v, int64_t n) {
    if ((int64_t)v.size() < n) v.resize(n);
  }
};

thread_local Scratch scratch;
thread_local std::vector<float> scores;  // one head's attention scores, per OpenMP thread (kv_len floats)

int linear(const NtLinear& l, const float* x, int64_t B, int64_t N, int64_t K, float* y) {
  return nt_linear(l.weight, (int)l.kind, x, l.bias, l.scale, B, N, K, y, OUT_F32);
}

// y (B, N) += each row's adapter product (x[b] @ A[slot]^T) @ Bt[slot] (x (B, K)), as LoraLinear adds it: the
// low-rank product in float32, then added to the base product; rows with slot -1 (or no slots) unchanged.
TARGET void add_lora(const NtLora& lora, const int64_t* slots, const float* x, int64_t B, int64_t K, int64_t N,
                     float* y) {
  if (!lora.A || !slots) return;
  const int64_t R = lora.rank;
  thread_local std::vector<float> t, d;
  Scratch::grow(t, R), Scratch::grow(d, N);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t slot = slots[b];
    if (slot < 0) continue;
    const float *xr = x + b * K, *A = lora.A + slot * R * K, *Bt = lora.Bt + slot * R * N;
    for (int64_t r = 0; r < R; ++r) {  // (R,) = A x
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1u);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, xr + k), _mm512_maskz_loadu_ps(m, A + r * K + k), acc);
      }
      t[r] = _mm512_reduce_add_ps(acc);
    }
    for (int64_t n = 0; n < N; ++n) d[n] = 0.f;
    for (int64_t r = 0; r < R; ++r) {  // (N,) = t @ Bt, rank by rank
      const float tr = t[r], *row = Bt + r * N;
      if (tr == 0.f) continue;  // a padded rank (zeros in A) adds nothing
      for (int64_t n = 0; n < N; ++n) d[n] = d[n] + tr * row[n];
    }
    for (int64_t n = 0; n < N; ++n) y[b * N + n] = y[b * N + n] + d[n];
  }
}

// out = weight * (x * rsqrt(mean(x^2) + eps)), row by row (RMSNorm's order: normalise, then scale); plus_one:
// (x * rsqrt(...)) * (1 + weight), Gemma's order; weight NULL: the normalised x alone (Gemma 4's unscaled norms).
// out may be x (each element is read before it is written).
TARGET void rms_norm(const float* x, const float* weight, int64_t B, int64_t C, double eps, float* out,
                     bool plus_one = false) {
  for (int64_t b = 0; b < B; ++b) {
    const float* xr = x + b * C;
    float ss = 0.f;
    for (int64_t c = 0; c < C; ++c) ss += xr[c] * xr[c];
    const float r = 1.f / sqrtf(ss / (float)C + (float)eps);
    if (!weight) {
      for (int64_t c = 0; c < C; ++c) out[b * C + c] = xr[c] * r;
    } else if (plus_one) {
      for (int64_t c = 0; c < C; ++c) out[b * C + c] = (xr[c] * r) * (1.f + weight[c]);
    } else {
      for (int64_t c = 0; c < C; ++c) out[b * C + c] = weight[c] * (xr[c] * r);
    }
  }
}

// Rotate one head in place: x*cos + roll(x, D/2)*signed_sin, the sin table's first half negated.
TARGET void rope(float* x, const float* cos, const float* ssin, int64_t D) {
  float tmp[512];
  memcpy(tmp, x, D * sizeof(float));
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) x[i] = tmp[i] * cos[i] + tmp[(i + half) % D] * ssin[i];
}

// Where a row's cache columns live: column s is at offset s % bs of block table[s / bs], columns `D` wide (the
// cache's, NtModel.kv_dim: a narrower layer uses the first dims of each); `head` is one kv head's offset inside a
// block. A slot cache is the case of one block per row (table = {slot}, bs = S).
struct Pages {
  const int64_t* table;
  int64_t bs, block_stride, head;
  int64_t at(int64_t s, int64_t D) const { return table[s / bs] * block_stride + head + (s % bs) * D; }
};

// 16 (masked) cache values of the column at `at`, from element d: float32 loaded, or int8 widened and times the
// column's scale (`scale`: NULL for float32) — the value the modules read back, q * scale rounded once.
TARGET inline __m512 load_kv(const void* data, int64_t at, const float* scale, int64_t d, __mmask16 m) {
  if (!scale) return _mm512_maskz_loadu_ps(m, (const float*)data + at + d);
  const __m128i q = _mm_maskz_loadu_epi8(m, (const int8_t*)data + at + d);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(*scale));
}

// How one query head scores the columns: scores times `scale`, then soft-capped (cap * tanh(s / cap), Gemma 2)
// where softcap > 0.
struct Scoring {
  float scale, softcap;
};

// 16 vectors' horizontal sums as one vector, lane j = the sum of v[j]'s 16 lanes: a transpose-and-add tree, about
// 3 instructions per vector where a reduction of each would take 8 (the lanes summed pairwise in a fixed order).
TARGET inline __m512 sums16(const __m512* v) {
  __m512 r1[8], r2[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of v[2i] = a, v[2i + 1] = b
    r1[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the four vectors 4i .. 4i + 3's partial sums
    r2[i] = _mm512_add_ps(_mm512_shuffle_ps(r1[2 * i], r1[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(r1[2 * i], r1[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 r3[2];
  for (int i = 0; i < 2; ++i)  // [lanes 0 + 1, lanes 2 + 3] of r2[2i], then of r2[2i + 1]
    r3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r2[2 * i], r2[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(r2[2 * i], r2[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(r3[0], r3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(r3[0], r3[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Scores of q against columns [first, kv_len) into scores[0 ..), 16 columns at a time: each column's products
// summed over D in 16-lane vectors (in d order), the 16 columns' vectors reduced together (sums16); returns the
// largest score. D (the head's) a multiple of 16; a column is KD wide (the cache's, D or more).
TARGET float scores16(const float* q, const void* keys, const float* k_scale, const Pages& pages, int64_t first,
                      int64_t kv_len, int64_t D, int64_t KD, const Scoring& how, float* scores) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t s0 = first; s0 < kv_len; s0 += 16) {
    const int n = kv_len - s0 < 16 ? (int)(kv_len - s0) : 16;
    int64_t at[16];
    const float* ks[16];
    for (int j = 0; j < 16; ++j) {
      at[j] = pages.at(s0 + (j < n ? j : 0), KD);
      ks[j] = k_scale ? k_scale + at[j] / KD : nullptr;
    }
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 qd = _mm512_loadu_ps(q + d);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j)
        if (j < n) acc[j] = _mm512_fmadd_ps(qd, load_kv(keys, at[j], ks[j], d, (__mmask16)0xffff), acc[j]);
    }
    __m512 sc = _mm512_mul_ps(sums16(acc), _mm512_set1_ps(how.scale));
    const __mmask16 valid = n == 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    _mm512_mask_storeu_ps(scores + (s0 - first), valid, sc);
    if (how.softcap > 0.f) {
      for (int j = 0; j < n; ++j) scores[s0 - first + j] = tanhf(scores[s0 - first + j] / how.softcap) * how.softcap;
      sc = _mm512_maskz_loadu_ps(valid, scores + (s0 - first));
    }
    mx = _mm512_mask_max_ps(mx, valid, mx, sc);
  }
  return _mm512_reduce_max_ps(mx);
}

// exp of 16 floats (Cephes' expf: n = round(x log2 e), r = x - n ln 2 in two parts, a degree-6 polynomial, times
// 2^n by scalef), within 2 ulp of expf; below -87.3 it underflows to zero as expf does.
TARGET inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// scores[0, n) = exp(scores - mx) in place, 16 at a time; returns their sum (16 lanes of partial sums, added at the
// end: a fixed order for a given n).
TARGET float exp_sum16(float* scores, int64_t n, float mx) {
  __m512 sum = _mm512_setzero_ps();
  const __m512 m = _mm512_set1_ps(mx);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 valid = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, scores + i), m));
    _mm512_mask_storeu_ps(scores + i, valid, e);
    sum = _mm512_mask_add_ps(sum, valid, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// out (D,) = sum over columns [first, kv_len) of p[s - first] * v_s, column by column in order, NC = D / 16
// accumulators held in registers; columns KD wide (the cache's, D or more).
template <int NC>
TARGET void weighted_values(const void* values, const float* v_scale, const Pages& pages, int64_t first,
                            int64_t kv_len, int64_t KD, const float* p, float* out) {
  __m512 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t s = first; s < kv_len; ++s) {
    const int64_t at = pages.at(s, KD);
    const float* vs = v_scale ? v_scale + at / KD : nullptr;
    const __m512 w = _mm512_set1_ps(p[s - first]);
    for (int c = 0; c < NC; ++c) acc[c] = _mm512_fmadd_ps(w, load_kv(values, at, vs, 16 * c, (__mmask16)0xffff), acc[c]);
  }
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + 16 * c, acc[c]);
}

// One query head against cache columns [first, kv_len): softmax(score(q.k)) @ v (a sliding layer's window starts
// at first > 0; the modules' window mask hides the columns before it). Dot products in 16-lane vectors (a head
// is 48-256 wide), the weighted sum of values likewise; columns in order, block by block, so the sums are the same
// whatever the block size. `sink` (gpt-oss; NULL: none): the head's learned logit joins the softmax's max and
// denominator, its share then dropped (model/layers.py's sink_attention). Heads of 48..256 (a multiple of 16) score
// 16 columns at a time (scores16, exp_sum16), others a column at a time; the weighted values take D/16 registers
// (weighted_values) for the common widths, else 16 dims at a time.
TARGET void attend(const float* q, const void* keys, const void* values, const float* k_scale,
                   const float* v_scale, const Pages& pages, int64_t first, int64_t kv_len, int64_t D, int64_t KD,
                   const Scoring& how, const float* sink, float* scores, float* out) {
  const bool blocked = D % 16 == 0 && D >= 48 && D <= 256;
  float mx = -INFINITY;
  if (blocked) {
    mx = scores16(q, keys, k_scale, pages, first, kv_len, D, KD, how, scores);
  } else {
    for (int64_t s = first; s < kv_len; ++s) {  // a column is KD wide (the cache's), its first D this head's
      const int64_t at = pages.at(s, KD);
      const float* ks = k_scale ? k_scale + at / KD : nullptr;  // this column's scale (int8)
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 m = D - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d)) - 1u);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + d), load_kv(keys, at, ks, d, m), acc);
      }
      float sc = _mm512_reduce_add_ps(acc) * how.scale;
      if (how.softcap > 0.f) sc = tanhf(sc / how.softcap) * how.softcap;
      scores[s - first] = sc;
      mx = sc > mx ? sc : mx;
    }
  }
  if (sink) mx = *sink > mx ? *sink : mx;
  float sum = 0.f;
  if (blocked) {
    sum = exp_sum16(scores, kv_len - first, mx);
  } else {
    for (int64_t s = first; s < kv_len; ++s) sum += (scores[s - first] = expf(scores[s - first] - mx));
  }
  if (sink) sum += expf(*sink - mx);  // the sink's share of the denominator, last as in the modules' row
  const float inv = 1.f / sum;
  for (int64_t s = first; s < kv_len; ++s) scores[s - first] *= inv;  // the probabilities
  if (D % 16 == 0) {
    switch (D / 16) {
      case 3: weighted_values<3>(values, v_scale, pages, first, kv_len, KD, scores, out); return;
      case 4: weighted_values<4>(values, v_scale, pages, first, kv_len, KD, scores, out); return;
      case 5: weighted_values<5>(values, v_scale, pages, first, kv_len, KD, scores, out); return;
      case 6: weighted_values<6>(values, v_scale, pages, first, kv_len, KD, scores, out); return;
      case 7: weighted_values<7>(values, v_scale, pages, first, kv_len, KD, scores, out); return;
      case 8: weighted_values<8>(values, v_scale, pages, first, kv_len, KD, scores, out); return;
      case 10: weighted_values<10>(values, v_scale, pages, first, kv_len, KD, scores, out); return;
      case 12: weighted_values<12>(values, v_scale, pages, first, kv_len, KD, scores, out); return;
      case 16: weighted_values<16>(values, v_scale, pages, first, kv_len, KD, scores, out); return;
      default: break;  // other widths: 16 dims at a time below
    }
  }
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = D - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d)) - 1u);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t s = first; s < kv_len; ++s) {
      const int64_t at = pages.at(s, KD);
      const float* vs = v_scale ? v_scale + at / KD : nullptr;
      acc = _mm512_fmadd_ps(_mm512_set1_ps(scores[s - first]), load_kv(values, at, vs, d, m), acc);
    }
    _mm512_mask_storeu_ps(out + d, m, acc);
  }
}


// One head's new key or value as the int8 cache stores it: scale = absmax / 127, q = round-half-even(x / scale)
// (model/cache.py's _quantize, the modules' writes).
void quantize_row(const float* x, int64_t D, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
  const float s = amax / 127.f, div = s > 0.f ? s : 1.f;
  for (int64_t d = 0; d < D; ++d) {
    float r = nearbyintf(x[d] / div);
    q[d] = (int8_t)(r > 127.f ? 127.f : (r < -127.f ? -127.f : r));
  }
  *scale = s;
}

// Rows are valid when each has 1..(its table's blocks * bs) cache columns; their total sizes the decision to fan
// attention out.
int check_rows(const NtModel* m, int64_t B, const int64_t* kv_lens, int64_t table_stride, int64_t* total_kv) {
  const int64_t D = kv_dim(*m);
  if (D > 512 || m->head_dim % 2 || m->n_heads % m->n_kv_heads || table_stride < 1) return 1;
  for (int64_t l = 0; l < m->n_layers; ++l) {  // Gemma 4's per-layer shapes: within the cache's columns and heads
    const NtLayer& L = m->layers[l];
    const int64_t d = head_dim(*m, L), hkv = kv_heads(*m, L);
    if (d % 2 || d > D || m->n_heads % hkv || hkv * m->cache_head_stride > m->cache_row_stride) return 1;
    const bool local = L.sliding && m->local_inv_freq;  // the RoPE tables' width fits the layer's heads
    if (!L.no_rope && (local ? m->head_dim > d : (m->rotary_dim ? m->rotary_dim > d : d != m->head_dim))) return 1;
  }
  if (m->kv_kind != KV_F32 && m->kv_kind != KV_I8) return 1;
  if (m->n_experts && (m->top_k < 1 || m->top_k > m->n_experts || m->n_experts > 1024)) return 1;
  if (m->router < ROUTE_SOFTMAX || m->router > ROUTE_SIGMOID) return 1;
  if (m->n_group > 1 && (m->n_experts % m->n_group || m->n_experts / m->n_group < 2 || m->topk_group < 1 ||
                         m->topk_group > m->n_group || m->topk_group * (m->n_experts / m->n_group) < m->top_k))
    return 1;
  *total_kv = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (kv_lens[b] < 1 || kv_lens[b] > table_stride * (m->cache_head_stride / D)) return 1;
    *total_kv += kv_lens[b];
  }
  return 0;
}

// (B, D) cos and signed sin of one RoPE (inverse frequencies `inv_freq`, or per row `choose(b)`'s), as
// rope_cos_sin builds them: angles pos * f in float32, cos and sin times `scaling` (LongRoPE's attention factor),
// the sin table's first half negated.
template <class Choose>
void rope_tables(int64_t D, int64_t B, const int64_t* positions, Choose choose, float scaling, float* cos_t,
                 float* sin_t) {
  const int64_t half = D / 2;
  for (int64_t b = 0; b < B; ++b) {
    const float pos = (float)positions[b];
    const float* inv_freq = choose(b);
    for (int64_t i = 0; i < half; ++i) {
      const float f = pos * inv_freq[i];
      const float c = cosf(f) * scaling, sn = sinf(f) * scaling;
      cos_t[b * D + i] = cos_t[b * D + half + i] = c;
      sin_t[b * D + i] = -sn;
      sin_t[b * D + half + i] = sn;
    }
  }
}

// The tables of every RoPE the layers use: the global one in s.cos / s.sin, and the sliding layers' own in
// s.cos_l / s.sin_l (Gemma 3). LongRoPE takes the long frequencies once a position passes the original context:
// row by row (by_max false: the engine's rows, each its own forward), or for every row by the furthest position
// (by_max true: one forward of the rows together, as the modules decide it, rope.longrope_inv_freq).
void all_rope_tables(const NtModel* m, int64_t B, const int64_t* positions, bool by_max, Scratch& s) {
  int64_t furthest = 0;
  for (int64_t b = 0; b < B; ++b) furthest = positions[b] > furthest ? positions[b] : furthest;
  auto global = [&](int64_t b) {
    const int64_t pos = by_max ? furthest : positions[b];
    return m->long_inv_freq && pos + 1 > m->rope_original_max ? m->long_inv_freq : m->inv_freq;
  };
  const int64_t rot = m->rotary_dim ? m->rotary_dim : m->head_dim;  // partial RoPE: tables of the rotated part
  rope_tables(rot, B, positions, global, (float)m->rope_scaling, s.cos.data(), s.sin.data());
  if (m->local_inv_freq)
    rope_tables(m->head_dim, B, positions, [&](int64_t) { return m->local_inv_freq; }, 1.f, s.cos_l.data(),
                s.sin_l.data());
}

// The q and k norms before RoPE of one row's qkv (H + Hkv heads of D, then the values): each head over D with a
// (D,) weight (Qwen3, Gemma 3), or q's and k's whole projections (OLMo 2).
void qk_norms(const NtModel* m, const NtLayer& L, float* row) {
  const int64_t H = m->n_heads, Hkv = L.kv_shared ? 0 : kv_heads(*m, L), D = head_dim(*m, L);
  const bool plus_one = m->flags & NT_PLUS_ONE;
  if (m->qk_norm == QK_HEAD) {
    for (int64_t head = 0; head < H; ++head) rms_norm(row + head * D, L.q_norm, 1, D, m->eps, row + head * D, plus_one);
    for (int64_t head = H; head < H + Hkv; ++head)
      rms_norm(row + head * D, L.k_norm, 1, D, m->eps, row + head * D, plus_one);
  } else if (m->qk_norm == QK_PROJECTION) {
    rms_norm(row, L.q_norm, 1, H * D, m->eps, row, plus_one);
    rms_norm(row + H * D, L.k_norm, 1, Hkv * D, m->eps, row + H * D, plus_one);
  }
}

// Qwen3.5's gated q projection: the (B, 2*H*D + 2*Hkv*D) product is [q_0; gate_0; q_1; gate_1; ...; k; v]; qkv
// (B, H*D + 2*Hkv*D) takes the queries, k and v as an ungated layer's, scratch.gate (B, H*D) the gates.
int gated_qkv(const NtModel* m, const NtLayer& L, const float* in, int64_t B, float* qkv) {
  const int64_t C = m->hidden, H = m->n_heads, D = m->head_dim, HD = H * D, KVD = m->n_kv_heads * D;
  const int64_t wide = 2 * HD + 2 * KVD, NQKV = HD + 2 * KVD;
  float *raw = scratch.gated.data(), *gate = scratch.gate.data();
  if (linear(L.qkv, in, B, wide, C, raw)) return 1;
  for (int64_t b = 0; b < B; ++b) {
    const float* r = raw + b * wide;
    for (int64_t head = 0; head < H; ++head) {
      memcpy(qkv + b * NQKV + head * D, r + head * 2 * D, D * sizeof(float));
      memcpy(gate + b * HD + head * D, r + head * 2 * D + D, D * sizeof(float));
    }
    memcpy(qkv + b * NQKV + HD, r + 2 * HD, 2 * KVD * sizeof(float));
  }
  return 0;
}

// Gemma 4's q [; k [; v]] rows (a KV-shared layer's q alone; keys as values: q and k) as a plain layer's qkv rows
// (B, H*D + 2*Hkv*D): the values the keys' copy before their norm and RoPE (v_norm then norms them). `raw` holds
// the product (B, H*D + own).
void own_qkv(const float* raw, int64_t B, int64_t HD, int64_t KVD, int64_t own, float* qkv) {
  const int64_t NQKV = HD + 2 * KVD;
  for (int64_t b = 0; b < B; ++b) {
    const float* r = raw + b * (HD + own);
    float* row = qkv + b * NQKV;
    memcpy(row, r, (HD + own) * sizeof(float));
    if (own == KVD) memcpy(row + HD + KVD, r + HD, KVD * sizeof(float));  // values from keys
  }
}

// A layer's attention half without the residual add: out (B, C) = o(attention(rope(qkv(norm(x))))) (OLMo 2: of
// x itself, its norm comes after), writing the new K/V of row b at column kv_lens[b] - 1 of its blocks
// (tables[b * table_stride ...], column s in block s / bs). On a tensor-parallel rank these are this rank's heads
// and out is its partial sum of the o-projection. `normed`: x is the normed input already (parallel_half's).
// Gemma 4's layers have their own D and Hkv (the first dims and heads of the cache's columns, the rest of a written
// column zero, as its modules pad it); a KV-shared layer computes q alone and attends its source layer's columns.
int attention_half(const NtModel* m, const NtLayer& L, const float* x, int64_t B, const int64_t* tables,
                   int64_t table_stride, const int64_t* kv_lens, bool parallel_attention, float* out,
                   bool normed = false) {
  const int64_t C = m->hidden, H = m->n_heads, Hkv = kv_heads(*m, L), D = head_dim(*m, L), KD = kv_dim(*m);
  const int64_t HD = H * D, KVD = Hkv * D, NQKV = HD + 2 * KVD, group = H / Hkv;
  const int64_t own = L.kv_shared ? 0 : (L.values_from_keys ? KVD : 2 * KVD);  // the product's k / v rows
  Scratch& s = scratch;
  float *h = s.h.data(), *qkv = s.qkv.data(), *att = s.att.data();
  const bool local = L.sliding && m->local_inv_freq;
  const float *cos_t = local ? s.cos_l.data() : s.cos.data(), *sin_t = local ? s.sin_l.data() : s.sin.data();
  const bool norm_first = !(m->flags & NT_NORM_AFTER) && !normed;
  if (norm_first) rms_norm(x, L.attn_norm, B, C, m->eps, h, m->flags & NT_PLUS_ONE);
  if (L.gated) {  // Qwen3.5: q_proj's rows are [query; gate] per head; the gates aside, the rest as usual
    if (gated_qkv(m, L, norm_first ? h : x, B, qkv)) return 1;
  } else if (own != 2 * KVD) {  // Gemma 4's q alone, or q and k
    if (linear(L.qkv, norm_first ? h : x, B, HD + own, C, s.gated.data())) return 1;
    own_qkv(s.gated.data(), B, HD, KVD, own, qkv);
  } else {
    if (linear(L.qkv, norm_first ? h : x, B, NQKV, C, qkv)) return 1;
    add_lora(L.lora_qkv, m->lora_slots, norm_first ? h : x, B, C, NQKV, qkv);
  }
  // the rotated first part of each head: the local RoPE's tables are head_dim wide, the global ones rotary_dim
  const int64_t rot = local ? m->head_dim : (m->rotary_dim ? m->rotary_dim : D);
  const int64_t rotated_heads = L.kv_shared ? H : H + Hkv;
  for (int64_t b = 0; b < B; ++b) {
    float* row = qkv + b * NQKV;
    qk_norms(m, L, row);
    if (L.v_norm && !L.kv_shared)
      for (int64_t head = 0; head < Hkv; ++head) rms_norm(row + HD + KVD + head * D, nullptr, 1, D, m->eps,
                                                          row + HD + KVD + head * D);
    if (!L.no_rope)
      for (int64_t head = 0; head < rotated_heads; ++head) rope(row + head * D, cos_t + b * rot, sin_t + b * rot, rot);
    if (L.kv_shared) continue;  // the source layer wrote this column
    const Pages pages{tables + b * table_stride, m->cache_head_stride / KD, m->cache_row_stride, 0};
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      const int64_t at = pages.at(kv_lens[b] - 1, KD) + kh * m->cache_head_stride;
      if (m->kv_kind == KV_I8) {  // the padding's zeros change no scale
        quantize_row(row + HD + kh * D, D, (int8_t*)L.k_cache + at, L.k_scale + at / KD);
        quantize_row(row + HD + KVD + kh * D, D, (int8_t*)L.v_cache + at, L.v_scale + at / KD);
        if (KD > D) memset((int8_t*)L.k_cache + at + D, 0, KD - D), memset((int8_t*)L.v_cache + at + D, 0, KD - D);
      } else {
        memcpy((float*)L.k_cache + at, row + HD + kh * D, D * sizeof(float));
        memcpy((float*)L.v_cache + at, row + HD + KVD + kh * D, D * sizeof(float));
        if (KD > D)
          memset((float*)L.k_cache + at + D, 0, (KD - D) * sizeof(float)),
              memset((float*)L.v_cache + at + D, 0, (KD - D) * sizeof(float));
      }
    }
  }
  // The scale as SDPA / softcapped_attention take it: the given multiplier, else 1/sqrt(D); the cap as a float.
  const Scoring how{m->attn_scale > 0 ? (float)m->attn_scale : 1.f / sqrtf((float)D), (float)m->attn_softcap};
  const int64_t window = L.sliding ? m->window : 0;
#pragma omp parallel for schedule(static) if (parallel_attention)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, head = bh % H;
    const Pages pages{tables + b * table_stride, m->cache_head_stride / KD, m->cache_row_stride,
                      (head / group) * m->cache_head_stride};
    // the window mask's columns: s > query column - window, query column kv_len - 1 (model/batch.py)
    const int64_t first = window > 0 && kv_lens[b] > window ? kv_lens[b] - window : 0;
    Scratch::grow(scores, kv_lens[b] - first);  // this thread's own buffer
    attend(qkv + b * NQKV + head * D, L.k_cache, L.v_cache, m->kv_kind == KV_I8 ? L.k_scale : nullptr,
           m->kv_kind == KV_I8 ? L.v_scale : nullptr, pages, first, kv_lens[b], D, KD, how,
           L.sinks ? L.sinks + head : nullptr, scores.data(), att + b * HD + head * D);
  }
  if (L.gated) {  // y * sigmoid(gate), as Attention.forward
    const float* gate = s.gate.data();
    for (int64_t i = 0; i < B * HD; ++i) att[i] = att[i] * (1.f / (1.f + expf(-gate[i])));
  }
  if (linear(L.o, att, B, C, HD, out)) return 1;
  add_lora(L.lora_o, m->lora_slots, att, B, HD, C, out);
  return 0;
}

// One gated MLP on n rows: out (n, C) = w2(act(gate(x)) * up(x)), act SiLU or GeGLU's tanh-approximated GELU (in
// PyTorch's order: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))); gpt-oss's clamped SwiGLU where
// swiglu_limit > 0 (layers.py's clamped_swiglu: gate <= limit, |up| <= limit, (up + 1) * (gate * sigmoid(alpha *
// gate))). w13's and w2's biases (NtLinear.bias) are added by their products.
TARGET int gated_mlp(const NtModel* m, const NtLinear& w13, const NtLinear& w2, int64_t I, const float* x, int64_t n,
                     float* out, const NtLayer* lora = nullptr) {
  const int64_t C = m->hidden;
  Scratch& s = scratch;
  float *gu = s.gu.data(), *act = s.act.data();
  if (linear(w13, x, n, 2 * I, C, gu)) return 1;
  if (lora) add_lora(lora->lora_w13, m->lora_slots, x, n, C, 2 * I, gu);
  const bool gelu = m->flags & NT_GELU;
  const float beta = (float)(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
  const float limit = (float)m->swiglu_limit, alpha = (float)m->swiglu_alpha;
  for (int64_t b = 0; b < n; ++b) {
    const float *g = gu + b * 2 * I, *u = g + I;
    if (limit > 0.f) {
      for (int64_t i = 0; i < I; ++i) {
        const float v = g[i] > limit ? limit : g[i], w = u[i] < -limit ? -limit : (u[i] > limit ? limit : u[i]);
        act[b * I + i] = (w + 1.f) * (v * (1.f / (1.f + expf(-(v * alpha)))));
      }
    } else if (gelu) {
      for (int64_t i = 0; i < I; ++i) {
        const float v = g[i], inner = beta * (v + kappa * (v * v * v));
        act[b * I + i] = 0.5f * v * (1.f + tanhf(inner)) * u[i];
      }
    } else {
      for (int64_t i = 0; i < I; ++i) act[b * I + i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
  }
  if (linear(w2, act, n, C, I, out)) return 1;
  if (lora) add_lora(lora->lora_w2, m->lora_slots, act, n, I, C, out);
  return 0;
}

// The k largest of v (E,), largest first, ties to the lower index (torch.topk's order on distinct values).
void top(const float* v, int64_t E, int64_t k, int64_t* out) {
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken |= out[i] == e;
      if (!taken && (best < 0 || v[e] > v[best])) best = e;
    }
    out[j] = best;
  }
}

// One row's routing (model/moe.py's route, by NtModel.router): its router logits p (E,) (used up; `choice` (E,)
// scratch) -> the k chosen experts and their weights.
void route(const NtModel* m, const NtLayer& L, float* p, float* choice, int64_t* chosen, float* weight) {
  const int64_t E = m->n_experts, k = m->top_k;
  if (m->router == ROUTE_TOPK_SOFTMAX) {  // gpt-oss, Granite 4.0-H: the top k logits, softmax over those k
    top(p, E, k, chosen);
    const float mx = p[chosen[0]];
    float sum = 0.f;
    for (int64_t j = 0; j < k; ++j) sum += (weight[j] = expf(p[chosen[j]] - mx));
    for (int64_t j = 0; j < k; ++j) weight[j] = weight[j] / sum;
    return;
  }
  if (m->router == ROUTE_SIGMOID) {  // GLM-4 MoE, LFM2-MoE: sigmoid scores
    for (int64_t e = 0; e < E; ++e) p[e] = 1.f / (1.f + expf(-p[e]));
  } else {  // softmax over the experts
    float mx = -INFINITY, sum = 0.f;
    for (int64_t e = 0; e < E; ++e) mx = p[e] > mx ? p[e] : mx;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = expf(p[e] - mx));
    for (int64_t e = 0; e < E; ++e) p[e] = p[e] / sum;
  }
  for (int64_t e = 0; e < E; ++e) choice[e] = L.correction ? p[e] + L.correction[e] : p[e];  // moves the choice only
  if (m->router == ROUTE_SIGMOID && m->n_group > 1) {  // only the experts of the topk_group best groups
    const int64_t G = m->n_group, per = E / G;
    std::vector<float> group(G);
    std::vector<int64_t> two(2), best(m->topk_group);
    for (int64_t g = 0; g < G; ++g) {  // a group's score: its two best choices summed
      top(choice + g * per, per, 2, two.data());
      group[g] = choice[g * per + two[0]] + choice[g * per + two[1]];
    }
    top(group.data(), G, m->topk_group, best.data());
    for (int64_t g = 0; g < G; ++g) {
      bool kept = false;
      for (int64_t i = 0; i < m->topk_group; ++i) kept |= best[i] == g;
      if (!kept)
        for (int64_t e = g * per; e < (g + 1) * per; ++e) choice[e] = -INFINITY;
    }
  }
  top(choice, E, k, chosen);
  float total = 0.f;
  for (int64_t j = 0; j < k; ++j) total += (weight[j] = p[chosen[j]]);
  const bool sigmoid = m->router == ROUTE_SIGMOID;
  if (m->norm_topk)
    for (int64_t j = 0; j < k; ++j) weight[j] = weight[j] / (sigmoid ? total + (float)m->topk_norm_eps : total);
  if (sigmoid)
    for (int64_t j = 0; j < k; ++j) weight[j] = weight[j] * (float)m->routed_scaling;
  if (L.expert_scale)  // Gemma 4: times each chosen expert's own scale
    for (int64_t j = 0; j < k; ++j) weight[j] = weight[j] * L.expert_scale[chosen[j]];
}

// A mixture-of-experts MLP on h (B, C), as model/moe.py computes it: router logits, each row's experts and weights
// (route), then each chosen expert, in ascending order, on the rows that chose it (only those experts' weights are
// read), its output times the row's weight added into the row's sum; then the shared expert: Qwen2-MoE's scaled
// by sigmoid(shared_gate(h)), GLM-4 MoE's and ERNIE 4.5's ungated (shared_gate NULL). out (B, C). `routed`: the
// router's input where it is not h (Gemma 4's; NULL: h).
int moe_half(const NtModel* m, const NtLayer& L, const float* h, int64_t B, float* out,
             const float* routed = nullptr) {
  const int64_t C = m->hidden, E = m->n_experts, k = m->top_k;
  Scratch& s = scratch;
  float *route_logits = s.route.data(), *in = s.moe_in.data(), *y = s.moe_out.data();
  if (linear(L.router, routed ? routed : h, B, E, C, route_logits)) return 1;
  std::vector<int64_t> chosen(B * k);
  std::vector<float> weight(B * k), choice(E);
  for (int64_t b = 0; b < B; ++b)
    route(m, L, route_logits + b * E, choice.data(), chosen.data() + b * k, weight.data() + b * k);
  for (int64_t i = 0; i < B * C; ++i) out[i] = 0.f;
  std::vector<int64_t> rows;
  std::vector<float> row_w;
  for (int64_t e = 0; e < E; ++e) {
    rows.clear(), row_w.clear();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < k; ++j)
        if (chosen[b * k + j] == e) rows.push_back(b), row_w.push_back(weight[b * k + j]);
    if (rows.empty()) continue;
    const int64_t n = rows.size();
    for (int64_t i = 0; i < n; ++i) memcpy(in + i * C, h + rows[i] * C, C * sizeof(float));
    if (gated_mlp(m, L.experts[e].w13, L.experts[e].w2, m->moe_intermediate, in, n, y)) return 1;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < C; ++c) out[rows[i] * C + c] = out[rows[i] * C + c] + y[i * C + c] * row_w[i];
  }
  if (L.shared.w13.weight) {
    float* gate = route_logits;  // (B,) the router logits are used up
    if (L.shared_gate.weight && linear(L.shared_gate, h, B, 1, C, gate)) return 1;
    if (gated_mlp(m, L.shared.w13, L.shared.w2, m->shared_intermediate, h, B, y)) return 1;
    for (int64_t b = 0; b < B; ++b) {
      if (!L.shared_gate.weight) {  // ungated: out + shared(h)
        for (int64_t c = 0; c < C; ++c) out[b * C + c] = out[b * C + c] + y[b * C + c];
        continue;
      }
      const float g = 1.f / (1.f + expf(-gate[b]));
      for (int64_t c = 0; c < C; ++c) out[b * C + c] = out[b * C + c] + g * y[b * C + c];
    }
  }
  return 0;
}

// Nemotron-H's ungated MLP (NemotronHMLP): out (B, C) = w2(relu(w13(x))^2), w13 the (I, C) up projection, the
// square as torch.square's r * r.
int relu2_mlp(const NtModel* m, const NtLayer& L, const float* x, int64_t B, float* out) {
  const int64_t C = m->hidden, I = m->intermediate;
  float* act = scratch.act.data();
  if (linear(L.w13, x, B, I, C, act)) return 1;
  add_lora(L.lora_w13, m->lora_slots, x, B, C, I, act);  // adapters on up (and down below): LoRA's rows
  for (int64_t i = 0; i < B * I; ++i) {
    const float r = act[i] > 0.f ? act[i] : 0.f;
    act[i] = r * r;
  }
  if (linear(L.w2, act, B, C, I, out)) return 1;
  add_lora(L.lora_w2, m->lora_slots, act, B, I, C, out);
  return 0;
}

// Gemma 4's MoE block beside the dense MLP (Gemma4Block.forward), without ffn_post_norm and the residual add:
// out (B, C) = mlp_post_norm(mlp(ffn_norm(x))) + experts_post_norm(experts(experts_norm(x))), the experts routed by
// router(rms(x) * router_scale * C^-0.5) (Gemma4Experts: softmax, top k, renormalised, times expert_scale).
int beside_half(const NtModel* m, const NtLayer& L, const float* x, int64_t B, float* out) {
  const int64_t C = m->hidden, n = B * C;
  thread_local std::vector<float> dense, routed, normed;  // (B, C) each
  Scratch::grow(dense, n), Scratch::grow(routed, n), Scratch::grow(normed, n);
  if (gated_mlp(m, L.w13, L.w2, mlp_width(*m, L), scratch.h.data(), B, dense.data())) return 1;  // ffn_norm'd x
  rms_norm(dense.data(), L.mlp_post_norm, B, C, m->eps, dense.data());
  const float root = (float)pow((double)C, -0.5);  // the modules' Python float, times a float32 tensor
  rms_norm(x, nullptr, B, C, m->eps, routed.data());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = 0; c < C; ++c) routed[b * C + c] = routed[b * C + c] * L.router_scale[c] * root;
  rms_norm(x, L.experts_norm, B, C, m->eps, normed.data());
  if (moe_half(m, L, normed.data(), B, out, routed.data())) return 1;
  rms_norm(out, L.experts_post_norm, B, C, m->eps, out);
  for (int64_t i = 0; i < n; ++i) out[i] = dense[i] + out[i];
  return 0;
}

// A layer's MLP half without the residual add: out (B, C) = mlp(norm(x)) (OLMo 2: mlp(x)), the dense gated MLP
// or the layer's experts (Gemma 4: both, beside_half). On a rank: its columns of gate/up, its partial sum of down.
int mlp_half(const NtModel* m, const NtLayer& L, const float* x, int64_t B, float* out) {
  const float* in = x;
  if (!(m->flags & NT_NORM_AFTER)) {
    rms_norm(x, L.ffn_norm, B, m->hidden, m->eps, scratch.h.data(), m->flags & NT_PLUS_ONE);
    in = scratch.h.data();
  }
  if (L.router_scale) return beside_half(m, L, x, B, out);
  if (L.router.weight) return moe_half(m, L, in, B, out);
  if (m->flags & NT_RELU2) return relu2_mlp(m, L, in, B, out);
  return gated_mlp(m, L.w13, L.w2, mlp_width(*m, L), in, B, out, &L);  // the dense MLP's rows are the step's rows
}

// Gemma 4's per-layer input (Gemma4Block.forward's last part), added into x (B, C) in place: x +=
// input_norm(input_projection(act(input_gate(x)) * per_layer[b, l])), per_layer (B, n_layers, P).
TARGET int per_layer_half(const NtModel* m, const NtLayer& L, int64_t l, float* x, int64_t B) {
  const int64_t C = m->hidden, P = m->per_layer_dim, n = m->n_layers;
  thread_local std::vector<float> g, y;  // (B, P), (B, C)
  Scratch::grow(g, B * P), Scratch::grow(y, B * C);
  if (linear(L.input_gate, x, B, P, C, g.data())) return 1;
  const bool gelu = m->flags & NT_GELU;
  const float beta = (float)(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
  for (int64_t b = 0; b < B; ++b) {
    const float* p = m->per_layer + (b * n + l) * P;
    for (int64_t i = 0; i < P; ++i) {
      const float v = g[b * P + i];
      const float a = gelu ? 0.5f * v * (1.f + tanhf(beta * (v + kappa * (v * v * v)))) : v / (1.f + expf(-v));
      g[b * P + i] = a * p[i];
    }
  }
  if (linear(L.input_projection, g.data(), B, C, P, y.data())) return 1;
  rms_norm(y.data(), L.input_norm, B, C, m->eps, y.data());
  for (int64_t i = 0; i < B * C; ++i) x[i] = x[i] + y[i];
  return 0;
}

// A recurrent layer's mixer without the residual add: out (B, C) = mixer(norm(x)) (csrc/recurrent.cpp).
int recurrent_half(const NtModel* m, const NtLayer& L, const float* x, int64_t B, float* out) {
  const float* in = x;
  if (!(m->flags & NT_NORM_AFTER)) {
    rms_norm(x, L.attn_norm, B, m->hidden, m->eps, scratch.h.data(), m->flags & NT_PLUS_ONE);
    in = scratch.h.data();
  }
  return nt_recurrent_half(m, &L, in, B, out);
}

// Falcon-H1's first branch without the residual add (FalconBlock): h = norm(x); out (B, C) = mixer(h *
// parallel_in) * parallel_out + attention(h * attn_in) * attn_out, each product rounded to float32 as the
// modules' tensor-times-scalar operations are.
int parallel_half(const NtModel* m, const NtLayer& L, const float* x, int64_t B, const int64_t* tables,
                  int64_t table_stride, const int64_t* kv_lens, bool parallel_attention, float* out) {
  const int64_t n = B * m->hidden;
  thread_local std::vector<float> normed, in, mixed;  // (B, C) each
  Scratch::grow(normed, n), Scratch::grow(in, n), Scratch::grow(mixed, n);
  rms_norm(x, L.attn_norm, B, m->hidden, m->eps, normed.data(), m->flags & NT_PLUS_ONE);
  const float p_in = (float)L.parallel_in, p_out = (float)L.parallel_out;
  const float a_in = (float)L.attn_in, a_out = (float)L.attn_out;
  for (int64_t i = 0; i < n; ++i) in[i] = normed[i] * p_in;
  NtLayer mixer = L;  // the recurrent mixer as a layer of its own (nt_recurrent_half reads mixer and recurrent)
  mixer.mixer = L.parallel_mixer, mixer.recurrent = L.parallel;
  if (nt_recurrent_half(m, &mixer, in.data(), B, mixed.data())) return 1;
  for (int64_t i = 0; i < n; ++i) in[i] = normed[i] * a_in;
  if (attention_half(m, L, in.data(), B, tables, table_stride, kv_lens, parallel_attention, out, true)) return 1;
  for (int64_t i = 0; i < n; ++i) out[i] = mixed[i] * p_out + out[i] * a_out;
  return 0;
}

// x += branch, the way Block joins a branch's output (B, C) to the residual: Gemma's post-norm of the branch,
// OLMo 2's norm of it (`after`: the layer's pre-branch norm weight), Granite's multiplier, or a plain add.
void join(const NtModel* m, float* x, float* branch, const float* post_norm, const float* after, int64_t B) {
  const int64_t n = B * m->hidden;
  const float* w = m->flags & NT_SANDWICH ? post_norm : (m->flags & NT_NORM_AFTER ? after : nullptr);
  if (w) {
    rms_norm(branch, w, B, m->hidden, m->eps, branch, m->flags & NT_PLUS_ONE);
  } else if (m->residual != 1.0) {
    const float r = (float)m->residual;
    for (int64_t i = 0; i < n; ++i) branch[i] = branch[i] * r;
  }
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] + branch[i];
}

// The step for B rows that each have their own cache blocks and length: row b writes its new K/V at column
// kv_lens[b] - 1 and attends over columns [0, kv_lens[b]) (a sliding layer: the last `window` of them), column s
// living in block tables[b * table_stride + s / bs] (a slot cache: one block per row, table_stride 1). Every
// number of row b depends on row b alone (the products accumulate each row in the same order whatever the other
// rows, attention is per row and reads the columns in order, the experts' products are row by row too), so a
// row gives the same logits in any batch, and in any blocks: the engine's batch invariance. (rope_by_max: one
// forward of rows together, whose LongRoPE choice the modules make by the furthest row; see all_rope_tables.)
int decode_rows(const NtModel* m, float* x, int64_t B, const int64_t* positions, const int64_t* tables,
                int64_t table_stride, const int64_t* kv_lens, float* logits, bool rope_by_max) {
  const int64_t C = m->hidden, H = m->n_heads, D = m->head_dim, V = m->vocab;
  int64_t total_kv;
  if (check_rows(m, B, kv_lens, table_stride, &total_kv)) return 1;
  Scratch& s = scratch;
  s.fit(*m, B);
  float* tmp = s.tmp.data();
  all_rope_tables(m, B, positions, rope_by_max, s);
  if (m->embed_mult != 1.0) {  // Granite's multiplier, then Gemma's sqrt(hidden) (float32), as _trunk applies them
    const float f = (float)m->embed_mult;
    for (int64_t i = 0; i < B * C; ++i) x[i] = x[i] * f;
  }
  if (m->embed_scale != 1.0) {
    const float f = (float)m->embed_scale;
    for (int64_t i = 0; i < B * C; ++i) x[i] = x[i] * f;
  }
  // Attention fans out over (row, head) when there is enough of it to pay for waking the thread pool.
  const bool parallel_attention = total_kv * H * D >= (1 << 13);

  for (int64_t l = 0; l < m->n_layers; ++l) {
    const NtLayer& L = m->layers[l];
    if (L.parallel) {  // Falcon-H1: a recurrent mixer and the attention side by side
      if (parallel_half(m, L, x, B, tables, table_stride, kv_lens, parallel_attention, tmp)) return 1;
    } else if (L.mixer != MIX_ATTENTION) {  // issue 41's recurrent kinds (csrc/recurrent.cpp): each row's state slot
      if (recurrent_half(m, L, x, B, tmp)) return 1;
    } else if (attention_half(m, L, x, B, tables, table_stride, kv_lens, parallel_attention, tmp)) {
      return 1;
    }
    join(m, x, tmp, L.attn_post_norm, L.attn_norm, B);
    if (!L.w13.weight && !L.router.weight) continue;  // a block without an MLP (Mamba2)
    if (mlp_half(m, L, x, B, tmp)) return 1;
    join(m, x, tmp, L.ffn_post_norm, L.ffn_norm, B);
    if (L.input_gate.weight && (!m->per_layer || per_layer_half(m, L, l, x, B))) return 1;  // Gemma 4's
    if (L.layer_scalar) {
      const float f = *L.layer_scalar;
      for (int64_t i = 0; i < B * C; ++i) x[i] = x[i] * f;
    }
  }
  rms_norm(x, m->final_norm, B, C, m->eps, s.h.data(), m->flags & NT_PLUS_ONE);
  if (linear(m->lm_head, s.h.data(), B, V, C, logits)) return 1;
  if (m->final_softcap > 0) {  // Gemma: cap * tanh(logits / cap)
    const float cap = (float)m->final_softcap;
    for (int64_t i = 0; i < B * V; ++i) logits[i] = tanhf(logits[i] / cap) * cap;
  }
  if (m->logits_scaling != 1.0) {  // Granite: logits / logits_scaling
    const float f = (float)m->logits_scaling;
    for (int64_t i = 0; i < B * V; ++i) logits[i] = logits[i] / f;
  }
  return 0;
}

// x (B, C) = the table's rows of ids, as float32: float32 copied, bfloat16 widened (exact), int8 times its row's
// scale (rounded once), GGUF blocks dequantized (ggml.cpp's nt_ggml_row), as the embedding modules compute them.
// Returns 1 for an id outside the table.
int embed(const NtModel* m, const int64_t* ids, int64_t B, float* x) {
  const int64_t C = m->hidden;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t id = ids[b];
    if (id < 0 || id >= m->vocab) return 1;
    float* row = x + b * C;
    if (m->embed.kind == W_F32) {
      memcpy(row, (const float*)m->embed.weight + id * C, C * sizeof(float));
    } else if (m->embed.kind == W_BF16) {
      const uint16_t* w = (const uint16_t*)m->embed.weight + id * C;
      for (int64_t c = 0; c < C; ++c) {
        const uint32_t u = (uint32_t)w[c] << 16;
        memcpy(row + c, &u, 4);
      }
    } else if (m->embed.kind == W_I8) {
      const int8_t* w = (const int8_t*)m->embed.weight + id * C;
      const float s = m->embed.scale[id];
      for (int64_t c = 0; c < C; ++c) row[c] = (float)w[c] * s;
    } else if (m->embed.kind >= W_GGML) {  // GGUF blocks: the row dequantized as GGUFEmbedding does
      if (nt_ggml_row((int)(m->embed.kind - W_GGML), (const uint8_t*)m->embed.weight, id, C, row)) return 1;
    } else {
      return 1;
    }
  }
  return 0;
}

// The rows of ids (B,) in this thread's buffer (embed), or NULL: no table, or an id outside it.
float* embedded(const NtModel* m, const int64_t* ids, int64_t B) {
  thread_local std::vector<float> x;
  if (!m->embed.weight) return nullptr;
  Scratch::grow(x, B * m->hidden);
  return embed(m, ids, B, x.data()) ? nullptr : x.data();
}

}  // namespace

extern "C" {

// x: (B, C) float32 embeddings of the new tokens, overwritten; positions: (B,) rotary positions; the new K/V go to
// cache column `col` (= kv_len - 1) of cache row b; logits: (B, V) float32. Returns 0, or 1 for unsupported shapes.
int nt_decode_step(const NtModel* m, float* x, int64_t B, const int64_t* positions, int64_t col, int64_t kv_len,
                   float* logits) {
  if (col != kv_len - 1) return 1;
  std::vector<int64_t> slots(B), kv_lens(B, kv_len);
  for (int64_t b = 0; b < B; ++b) slots[b] = b;
  return decode_rows(m, x, B, positions, slots.data(), 1, kv_lens.data(), logits, true);
}

// nt_decode_step from token ids (B,) instead of embeddings: the model's table (m->embed) is read here, so a step
// of a small model costs Python no embedding operations.
int nt_decode_step_ids(const NtModel* m, const int64_t* ids, int64_t B, const int64_t* positions, int64_t col,
                       int64_t kv_len, float* logits) {
  float* x = embedded(m, ids, B);
  return x ? nt_decode_step(m, x, B, positions, col, kv_len, logits) : 1;
}

// Greedy decoding of one sequence for up to n steps without returning to Python: step i runs `token` (at rotary
// position position + i, cache column col + i, which it fills), takes the argmax of the logits (nt_argmax_f32,
// the decode loop's own choice) as out[i] and the next step's token, and stops after a token in eos[0..n_eos).
// Each step is nt_decode_step_ids's, so the tokens are the step-by-step loop's. Returns the number of tokens
// written (1..n; the last is an eos id or the n-th), or -1 for unsupported shapes. `logits` (V,) holds the last
// step's logits.
int nt_decode_greedy(const NtModel* m, int64_t token, int64_t position, int64_t col, int64_t n, const int64_t* eos,
                     int64_t n_eos, int64_t* out, float* logits) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = position + i, c = col + i;
    if (nt_decode_step_ids(m, &token, 1, &pos, c, c + 1, logits)) return -1;
    nt_argmax_f32(logits, 1, m->vocab, &token);
    out[i] = token;
    for (int64_t e = 0; e < n_eos; ++e)
      if (eos[e] == token) return i + 1;
  }
  return n;
}

// The engine's step: row b's K/V live in the blocks tables[b * table_stride ...] (B, table_stride) of the paged pool
// (or a slot cache's rows: table_stride 1, tables the slots), kv_lens[b] columns long after this token.
int nt_decode_rows(const NtModel* m, float* x, int64_t B, const int64_t* positions, const int64_t* tables,
                   int64_t table_stride, const int64_t* kv_lens, float* logits) {
  return decode_rows(m, x, B, positions, tables, table_stride, kv_lens, logits, false);
}

// nt_decode_rows from token ids (B,) instead of embeddings: the model's table (m->embed) is read here, as
// nt_decode_step_ids does, so the engine's step costs Python no embedding operations.
int nt_decode_rows_ids(const NtModel* m, const int64_t* ids, int64_t B, const int64_t* positions,
                       const int64_t* tables, int64_t table_stride, const int64_t* kv_lens, float* logits) {
  float* x = embedded(m, ids, B);
  return x ? decode_rows(m, x, B, positions, tables, table_stride, kv_lens, logits, false) : 1;
}

// One part of a step, for tensor-parallel ranks (model/fused.py), whose caller all-reduces the partial sums and
// joins them to the residual between parts (post-norms, multipliers: fused._branch), and applies the embedding's
// multipliers and the final soft-cap / scaling: part 0 is layer `layer`'s attention half, part 1 its MLP half
// (out: (B, C) partial sums, x unchanged), part 2 the final norm and this rank's rows of the LM head
// (out: (B, vocab)). Rows as in nt_decode_rows. Returns 0, or 1 for unsupported shapes.
int nt_decode_part(const NtModel* m, int64_t layer, int64_t part, const float* x, int64_t B,
                   const int64_t* positions, const int64_t* tables, int64_t table_stride, const int64_t* kv_lens,
                   float* out) {
  int64_t total_kv;
  if (check_rows(m, B, kv_lens, table_stride, &total_kv) || layer < 0 || layer >= m->n_layers) return 1;
  Scratch& s = scratch;
  s.fit(*m, B);
  const NtLayer& L = m->layers[layer];
  // tensor parallelism refuses the hybrids (families' declarations)
  if (L.mixer != MIX_ATTENTION || L.gated || L.parallel || L.input_gate.weight || L.layer_scalar) return 1;
  if (part == 0) {
    all_rope_tables(m, B, positions, false, s);
    const bool parallel_attention = total_kv * m->n_heads * m->head_dim >= (1 << 16);
    return attention_half(m, L, x, B, tables, table_stride, kv_lens, parallel_attention, out);
  }
  if (part == 1) return mlp_half(m, L, x, B, out);
  if (part != 2) return 1;
  rms_norm(x, m->final_norm, B, m->hidden, m->eps, s.h.data(), m->flags & NT_PLUS_ONE);
  return linear(m->lm_head, s.h.data(), B, m->vocab, m->hidden, out);
}
}
