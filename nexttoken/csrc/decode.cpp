// One whole decode step of a Llama-family model in one call: every layer, the final norm and the LM head.
//
// For small models the weights stream in ~2 ms per token, while a step assembled from ~280 PyTorch operations
// spends about as long again in dispatch and allocation. This file runs the step llama2.c's way: float32
// activations in a few reused buffers, the matrix products through nt_linear (gemv.cpp, which splits them across
// the OpenMP threads), and the small operations between them (RMSNorm, RoPE, the KV-cache write, attention,
// SiLU) as plain loops. It applies to plain decode steps only (one new token per row, every cache column
// visible, float32 activations); anything else takes the PyTorch path, which is the reference this is tested
// against (same tokens, logits within float32 rounding).
//
// The arithmetic follows the PyTorch modules operation by operation (normalise then scale, rotate as
// x*cos + roll(x)*signed_sin, softmax over scaled scores); it is built with -ffp-contract=off so the compiler
// does not fuse those multiplies and adds into FMAs that the reference does not do.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

extern "C" int nt_linear(const void* W, int kind, const float* x, const float* bias, const float* scale, int64_t M,
                         int64_t N, int64_t K, void* y, int out_kind);
extern "C" int nt_argmax_f32(const float* x, int64_t M, int64_t N, int64_t* out);

// Every field is 8 bytes wide, so the ctypes mirrors in nexttoken/model/fused.py need no padding rules.
struct NtLinear {
  const void* weight;  // (out, in) float32, bfloat16 or int8
  int64_t kind;        // 0 float32, 1 bfloat16, 2 int8 (then scale is set), 3 int4 (int4.cpp's layout)
  const float* scale;  // (out,) or NULL; int4: (out, groups) float16
  const float* bias;   // (out,) or NULL
};

struct NtLayer {
  const float* attn_norm;  // (C,)
  const float* ffn_norm;   // (C,)
  NtLinear qkv;            // (H*D + 2*Hkv*D, C): q, k, v fused
  NtLinear o;              // (C, H*D)
  NtLinear w13;            // (2*I, C): gate then up
  NtLinear w2;             // (C, I)
  void* k_cache;           // this layer's (N, Hkv, bs, D) keys: N blocks of bs columns (a slot cache: bs = S)
  void* v_cache;           // and values; float32, or int8 (NtModel.kv_kind 2) with the scales below
  float* k_scale;          // int8: (N, Hkv, bs) one scale per token and head (absmax / 127); else NULL
  float* v_scale;
};

struct NtModel {
  int64_t n_layers, hidden, n_heads, n_kv_heads, head_dim, intermediate, vocab;
  NtLinear embed;             // (V, C) token table: float32, bfloat16 or int8 rows (scale set); weight NULL: none
  int64_t cache_row_stride;   // one cache block: Hkv * bs * D
  int64_t cache_head_stride;  // one head of a block: bs * D (so bs = cache_head_stride / head_dim)
  double eps;
  const float* inv_freq;    // (D/2,) RoPE inverse frequencies
  const float* final_norm;  // (C,)
  NtLinear lm_head;         // (V, C)
  const NtLayer* layers;
  int64_t kv_kind;  // the cache's elements: 0 float32, 2 int8 with per token and head scales
};

namespace {

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

struct Scratch {  // per calling thread, grown on demand and reused across steps
  std::vector<float> h, qkv, att, tmp, gu, act, cos, sin;
  void fit(const NtModel& m, int64_t B, int64_t kv_len) {
    const int64_t C = m.hidden, HD = m.n_heads * m.head_dim, I = m.intermediate;
    grow(h, B * C), grow(tmp, B * C), grow(att, B * HD), grow(act, B * I), grow(gu, B * 2 * I);
    grow(qkv, B * (HD + 2 * m.n_kv_heads * m.head_dim)), grow(cos, B * m.head_dim), grow(sin, B * m.head_dim);
  }
  static void grow(std::vector<float>& v, int64_t n) {
    if ((int64_t)v.size() < n) v.resize(n);
  }
};

thread_local Scratch scratch;
thread_local std::vector<float> scores;  // one head's attention scores, per OpenMP thread (kv_len floats)

int linear(const NtLinear& l, const float* x, int64_t B, int64_t N, int64_t K, float* y) {
  return nt_linear(l.weight, (int)l.kind, x, l.bias, l.scale, B, N, K, y, 0);
}

// out = weight * (x * rsqrt(mean(x^2) + eps)), row by row (RMSNorm's order: normalise, then scale).
TARGET void rms_norm(const float* x, const float* weight, int64_t B, int64_t C, double eps, float* out) {
  for (int64_t b = 0; b < B; ++b) {
    const float* xr = x + b * C;
    float ss = 0.f;
    for (int64_t c = 0; c < C; ++c) ss += xr[c] * xr[c];
    const float r = 1.f / sqrtf(ss / (float)C + (float)eps);
    for (int64_t c = 0; c < C; ++c) out[b * C + c] = weight[c] * (xr[c] * r);
  }
}

// Rotate one head in place: x*cos + roll(x, D/2)*signed_sin, the sin table's first half negated.
TARGET void rope(float* x, const float* cos, const float* ssin, int64_t D) {
  float tmp[512];
  memcpy(tmp, x, D * sizeof(float));
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) x[i] = tmp[i] * cos[i] + tmp[(i + half) % D] * ssin[i];
}

// Where a row's cache columns live: column s is at offset s % bs of block table[s / bs]; `head` is one kv head's
// offset inside a block. A slot cache is the case of one block per row (table = {slot}, bs = S).
struct Pages {
  const int64_t* table;
  int64_t bs, block_stride, head;
  int64_t at(int64_t s, int64_t D) const { return table[s / bs] * block_stride + head + (s % bs) * D; }
};

// One query head against cache columns [0, kv_len): softmax(q.k / sqrt(D)) @ v. Dot products in 16-lane
// vectors (a head is 48-128 wide), the weighted sum of values likewise; columns in order, block by block, so
// the sums are the same whatever the block size.
// 16 (masked) cache values of the column at `at`, from element d: float32 loaded, or int8 widened and times the
// column's scale (`scale`: NULL for float32) — the value the modules read back, q * scale rounded once.
TARGET inline __m512 load_kv(const void* data, int64_t at, const float* scale, int64_t d, __mmask16 m) {
  if (!scale) return _mm512_maskz_loadu_ps(m, (const float*)data + at + d);
  const __m128i q = _mm_maskz_loadu_epi8(m, (const int8_t*)data + at + d);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(*scale));
}

TARGET void attend(const float* q, const void* keys, const void* values, const float* k_scale,
                   const float* v_scale, const Pages& pages, int64_t kv_len, int64_t D, float* scores, float* out) {
  const float scale = 1.f / sqrtf((float)D);
  float mx = -INFINITY;
  for (int64_t s = 0; s < kv_len; ++s) {
    const int64_t at = pages.at(s, D);
    const float* ks = k_scale ? k_scale + at / D : nullptr;  // this column's scale (int8)
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 m = D - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d)) - 1u);
      acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + d), load_kv(keys, at, ks, d, m), acc);
    }
    scores[s] = _mm512_reduce_add_ps(acc) * scale;
    mx = scores[s] > mx ? scores[s] : mx;
  }
  float sum = 0.f;
  for (int64_t s = 0; s < kv_len; ++s) sum += (scores[s] = expf(scores[s] - mx));
  const float inv = 1.f / sum;
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = D - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d)) - 1u);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t s = 0; s < kv_len; ++s) {
      const int64_t at = pages.at(s, D);
      const float* vs = v_scale ? v_scale + at / D : nullptr;
      acc = _mm512_fmadd_ps(_mm512_set1_ps(scores[s] * inv), load_kv(values, at, vs, d, m), acc);
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
  const int64_t D = m->head_dim;
  if (D > 512 || D % 2 || m->n_heads % m->n_kv_heads || table_stride < 1) return 1;
  if (m->kv_kind != 0 && m->kv_kind != 2) return 1;
  *total_kv = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (kv_lens[b] < 1 || kv_lens[b] > table_stride * (m->cache_head_stride / D)) return 1;
    *total_kv += kv_lens[b];
  }
  return 0;
}

// (B, D) cos and signed sin, as rope_cos_sin builds them.
void rope_tables(const NtModel* m, int64_t B, const int64_t* positions, float* cos_t, float* sin_t) {
  const int64_t D = m->head_dim, half = D / 2;
  for (int64_t b = 0; b < B; ++b) {
    const float pos = (float)positions[b];
    for (int64_t i = 0; i < half; ++i) {
      const float f = pos * m->inv_freq[i];
      const float c = cosf(f), sn = sinf(f);
      cos_t[b * D + i] = cos_t[b * D + half + i] = c;
      sin_t[b * D + i] = -sn;
      sin_t[b * D + half + i] = sn;
    }
  }
}

// A layer's attention half without the residual add: out (B, C) = o(attention(rope(qkv(norm(x))))), writing the
// new K/V of row b at column kv_lens[b] - 1 of its blocks (tables[b * table_stride ...], column s in block s / bs).
// On a tensor-parallel rank these are this rank's heads and out is its partial sum of the o-projection.
int attention_half(const NtModel* m, const NtLayer& L, const float* x, int64_t B, const int64_t* tables,
                   int64_t table_stride, const int64_t* kv_lens, const float* cos_t, const float* sin_t,
                   bool parallel_attention, float* out) {
  const int64_t C = m->hidden, H = m->n_heads, Hkv = m->n_kv_heads, D = m->head_dim;
  const int64_t HD = H * D, KVD = Hkv * D, NQKV = HD + 2 * KVD, group = H / Hkv;
  Scratch& s = scratch;
  float *h = s.h.data(), *qkv = s.qkv.data(), *att = s.att.data();
  rms_norm(x, L.attn_norm, B, C, m->eps, h);
  if (linear(L.qkv, h, B, NQKV, C, qkv)) return 1;
  for (int64_t b = 0; b < B; ++b) {
    float* row = qkv + b * NQKV;
    for (int64_t head = 0; head < H + Hkv; ++head) rope(row + head * D, cos_t + b * D, sin_t + b * D, D);
    const Pages pages{tables + b * table_stride, m->cache_head_stride / D, m->cache_row_stride, 0};
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      const int64_t at = pages.at(kv_lens[b] - 1, D) + kh * m->cache_head_stride;
      if (m->kv_kind == 2) {
        quantize_row(row + HD + kh * D, D, (int8_t*)L.k_cache + at, L.k_scale + at / D);
        quantize_row(row + HD + KVD + kh * D, D, (int8_t*)L.v_cache + at, L.v_scale + at / D);
      } else {
        memcpy((float*)L.k_cache + at, row + HD + kh * D, D * sizeof(float));
        memcpy((float*)L.v_cache + at, row + HD + KVD + kh * D, D * sizeof(float));
      }
    }
  }
#pragma omp parallel for schedule(static) if (parallel_attention)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, head = bh % H;
    const Pages pages{tables + b * table_stride, m->cache_head_stride / D, m->cache_row_stride,
                      (head / group) * m->cache_head_stride};
    Scratch::grow(scores, kv_lens[b]);  // this thread's own buffer
    attend(qkv + b * NQKV + head * D, L.k_cache, L.v_cache, m->kv_kind == 2 ? L.k_scale : nullptr,
           m->kv_kind == 2 ? L.v_scale : nullptr, pages, kv_lens[b], D, scores.data(), att + b * HD + head * D);
  }
  return linear(L.o, att, B, C, HD, out);
}

// A layer's MLP half without the residual add: out (B, C) = down(silu(gate(norm(x))) * up(norm(x))). On a rank:
// its columns of gate/up, its partial sum of down.
int mlp_half(const NtModel* m, const NtLayer& L, const float* x, int64_t B, float* out) {
  const int64_t C = m->hidden, I = m->intermediate;
  Scratch& s = scratch;
  float *h = s.h.data(), *gu = s.gu.data(), *act = s.act.data();
  rms_norm(x, L.ffn_norm, B, C, m->eps, h);
  if (linear(L.w13, h, B, 2 * I, C, gu)) return 1;
  for (int64_t b = 0; b < B; ++b) {
    const float *g = gu + b * 2 * I, *u = g + I;
    for (int64_t i = 0; i < I; ++i) act[b * I + i] = g[i] / (1.f + expf(-g[i])) * u[i];
  }
  return linear(L.w2, act, B, C, I, out);
}

// The step for B rows that each have their own cache blocks and length: row b writes its new K/V at column
// kv_lens[b] - 1 and attends over columns [0, kv_lens[b]), column s living in block tables[b * table_stride + s / bs]
// (a slot cache: one block per row, table_stride 1). Every number of row b depends on row b alone (the products
// accumulate each row in the same order whatever the other rows, attention is per row and reads the columns in
// order), so a row gives the same logits in any batch, and in any blocks: the engine's batch invariance.
int decode_rows(const NtModel* m, float* x, int64_t B, const int64_t* positions, const int64_t* tables,
                int64_t table_stride, const int64_t* kv_lens, float* logits) {
  const int64_t C = m->hidden, H = m->n_heads, D = m->head_dim;
  int64_t total_kv;
  if (check_rows(m, B, kv_lens, table_stride, &total_kv)) return 1;
  Scratch& s = scratch;
  s.fit(*m, B, 0);
  float *tmp = s.tmp.data(), *cos_t = s.cos.data(), *sin_t = s.sin.data();
  rope_tables(m, B, positions, cos_t, sin_t);
  // Attention fans out over (row, head) when there is enough of it to pay for waking the thread pool.
  const bool parallel_attention = total_kv * H * D >= (1 << 13);

  for (int64_t l = 0; l < m->n_layers; ++l) {
    const NtLayer& L = m->layers[l];
    if (attention_half(m, L, x, B, tables, table_stride, kv_lens, cos_t, sin_t, parallel_attention, tmp)) return 1;
    for (int64_t i = 0; i < B * C; ++i) x[i] = x[i] + tmp[i];
    if (mlp_half(m, L, x, B, tmp)) return 1;
    for (int64_t i = 0; i < B * C; ++i) x[i] = x[i] + tmp[i];
  }
  rms_norm(x, m->final_norm, B, C, m->eps, s.h.data());
  return linear(m->lm_head, s.h.data(), B, m->vocab, C, logits);
}

// x (B, C) = the table's rows of ids, as float32: float32 copied, bfloat16 widened (exact), int8 times its row's
// scale (rounded once), as the embedding modules compute them. Returns 1 for an id outside the table.
int embed(const NtModel* m, const int64_t* ids, int64_t B, float* x) {
  const int64_t C = m->hidden;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t id = ids[b];
    if (id < 0 || id >= m->vocab) return 1;
    float* row = x + b * C;
    if (m->embed.kind == 0) {
      memcpy(row, (const float*)m->embed.weight + id * C, C * sizeof(float));
    } else if (m->embed.kind == 1) {
      const uint16_t* w = (const uint16_t*)m->embed.weight + id * C;
      for (int64_t c = 0; c < C; ++c) {
        const uint32_t u = (uint32_t)w[c] << 16;
        memcpy(row + c, &u, 4);
      }
    } else if (m->embed.kind == 2) {
      const int8_t* w = (const int8_t*)m->embed.weight + id * C;
      const float s = m->embed.scale[id];
      for (int64_t c = 0; c < C; ++c) row[c] = (float)w[c] * s;
    } else {
      return 1;
    }
  }
  return 0;
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
  return decode_rows(m, x, B, positions, slots.data(), 1, kv_lens.data(), logits);
}

// nt_decode_step from token ids (B,) instead of embeddings: the model's table (m->embed) is read here, so a step
// of a small model costs Python no embedding operations.
int nt_decode_step_ids(const NtModel* m, const int64_t* ids, int64_t B, const int64_t* positions, int64_t col,
                       int64_t kv_len, float* logits) {
  if (!m->embed.weight) return 1;
  thread_local std::vector<float> x;
  Scratch::grow(x, B * m->hidden);
  if (embed(m, ids, B, x.data())) return 1;
  return nt_decode_step(m, x.data(), B, positions, col, kv_len, logits);
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
  return decode_rows(m, x, B, positions, tables, table_stride, kv_lens, logits);
}

// One part of a step, for tensor-parallel ranks (model/fused.py), whose caller all-reduces the partial sums and
// adds the residual between parts: part 0 is layer `layer`'s attention half, part 1 its MLP half (out: (B, C)
// partial sums, x unchanged), part 2 the final norm and this rank's rows of the LM head (out: (B, vocab)). Rows as
// in nt_decode_rows. Returns 0, or 1 for unsupported shapes.
int nt_decode_part(const NtModel* m, int64_t layer, int64_t part, const float* x, int64_t B,
                   const int64_t* positions, const int64_t* tables, int64_t table_stride, const int64_t* kv_lens,
                   float* out) {
  int64_t total_kv;
  if (check_rows(m, B, kv_lens, table_stride, &total_kv) || layer < 0 || layer >= m->n_layers) return 1;
  Scratch& s = scratch;
  s.fit(*m, B, 0);
  const NtLayer& L = m->layers[layer];
  if (part == 0) {
    rope_tables(m, B, positions, s.cos.data(), s.sin.data());
    const bool parallel_attention = total_kv * m->n_heads * m->head_dim >= (1 << 16);
    return attention_half(m, L, x, B, tables, table_stride, kv_lens, s.cos.data(), s.sin.data(), parallel_attention,
                          out);
  }
  if (part == 1) return mlp_half(m, L, x, B, out);
  if (part != 2) return 1;
  rms_norm(x, m->final_norm, B, m->hidden, m->eps, s.h.data());
  return linear(m->lm_head, s.h.data(), B, m->vocab, m->hidden, out);
}
}
