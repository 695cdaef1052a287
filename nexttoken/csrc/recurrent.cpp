// Issue 41's recurrent layer kinds in the fused decode step (csrc/decode.cpp calls nt_recurrent_half for a layer
// whose NtLayer.mixer is not attention): LFM2's gated short convolution, the gated delta rule (Qwen3.5 /
// Qwen3-Next's Gated DeltaNet) and Mamba2's selective state space (SSD), one new token per row.
//
// Each row reads and updates its own state slot in place: row b's slot is NtModel.state_slots[b] (the engine's
// Sequence.slot), or b (generate()'s cache, one slot per row). The slots are model/recurrent/slots.py's tensors:
// the convolution window (slots, channels, K - 1) and the recurrent matrix (slots, heads, Dk, Dv) / (slots, heads,
// P, N). Nothing a row computes reads another row's numbers, and the products (nt_linear) accumulate each row in
// the same order whatever the batch, so a row's numbers never depend on its batch-mates.
//
// The arithmetic follows the PyTorch modules (model/recurrent/*.py, which are transformers' torch paths) operation
// by operation: the convolution's taps multiplied and added in tap order, the activations in their order (SiLU as
// x / (1 + exp(-x)), softplus as log1p(exp(x)) below 20), the state decayed, then read, then written, the gated
// norms normalise-then-scale. The sums over a head (the delta rule's k^T S and q^T S over Dk, the SSD's S C over
// N, the norms' sums of squares) are in another order than the modules' reductions: float32 rounding, which the
// tests bound. Built with -ffp-contract=off like the rest: no fused multiply-adds the modules do not do, but for
// the explicit vector multiply-adds of those sums.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "nt_abi.h"

extern "C" int nt_linear(const void* W, int kind, const float* x, const float* bias, const float* scale, int64_t M,
                         int64_t N, int64_t K, void* y, int out_kind);

namespace {

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

thread_local std::vector<float> proj_buf, mixed_buf, conv_buf;

void grow(std::vector<float>& v, int64_t n) {
  if ((int64_t)v.size() < n) v.resize(n);
}

int linear(const NtLinear& l, const float* x, int64_t B, int64_t N, int64_t K, float* y) {
  return nt_linear(l.weight, (int)l.kind, x, l.bias, l.scale, B, N, K, y, OUT_F32);
}

inline __mmask16 tail(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

inline float silu(float x) { return x / (1.f + expf(-x)); }  // F.silu's x / (1 + exp(-x))

inline float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }  // F.softplus (beta 1, threshold 20)

int64_t slot_of(const NtModel* m, int64_t b) { return m->state_slots ? m->state_slots[b] : b; }

// One row's causal depthwise convolution (model/recurrent/conv.py's causal_conv, T = 1): y[c] = sum over the K taps
// of [window; x][c] times conv[c], in tap order, plus the bias; the window then drops its oldest input and takes x.
// silu: the activation after it (the delta rule's, the SSD's).
TARGET void conv_step(const NtRecurrent& R, float* window, const float* x, bool silu_after, float* y) {
  const int64_t n = R.channels, K = R.kernel, W = K - 1;
  for (int64_t c = 0; c < n; ++c) {
    float* win = window + c * W;
    const float* taps = R.conv + c * K;
    const float newest = x[c];
    float acc = (W > 0 ? win[0] : newest) * taps[0];
    for (int64_t j = 1; j < K; ++j) acc = acc + (j < W ? win[j] : newest) * taps[j];
    if (R.conv_bias) acc = acc + R.conv_bias[c];
    for (int64_t j = 0; j + 1 < W; ++j) win[j] = win[j + 1];
    if (W > 0) win[W - 1] = newest;
    y[c] = silu_after ? silu(acc) : acc;
  }
}

// LFM2's gated short convolution (short_conv.py): [B; C; x] = in_proj(h); y = conv(B * x); out = out_proj(C * y).
int short_conv(const NtModel* m, const NtRecurrent& R, const float* h, int64_t B, float* out) {
  const int64_t C = m->hidden;
  grow(proj_buf, B * 3 * C), grow(mixed_buf, B * C), grow(conv_buf, 2 * C);
  float *proj = proj_buf.data(), *mixed = mixed_buf.data(), *bx = conv_buf.data(), *y = bx + C;
  if (linear(R.wi, h, B, 3 * C, C, proj)) return 1;
  for (int64_t b = 0; b < B; ++b) {
    const float* p = proj + b * 3 * C;
    for (int64_t c = 0; c < C; ++c) bx[c] = p[c] * p[2 * C + c];
    conv_step(R, R.window + slot_of(m, b) * C * (R.kernel - 1), bx, false, y);
    for (int64_t c = 0; c < C; ++c) mixed[b * C + c] = p[C + c] * y[c];
  }
  return linear(R.wo, mixed, B, C, C, out);
}

// x (n,) times rsqrt(sum(x^2) + eps), delta_rule.py's l2norm.
void l2norm(float* x, int64_t n, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / sqrtf(ss + eps);
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * r;
}

// One value head's step of the gated delta rule on its (Dk, Dv) state S (delta_rule.py's recurrent): S *= exp(g);
// memory = k^T S; delta = (v - memory) * beta; S += k delta^T; o = q^T S. Two passes over S, 16 values at a time.
TARGET void delta_head(float* S, const float* q, const float* k, const float* v, float decay, float beta,
                       int64_t Dk, int64_t Dv, float* o) {
  const __m512 dec = _mm512_set1_ps(decay);
  for (int64_t d = 0; d < Dv; d += 16) {
    const __mmask16 mk = tail(Dv - d);
    __m512 mem = _mm512_setzero_ps();
    for (int64_t i = 0; i < Dk; ++i) {
      float* row = S + i * Dv + d;
      const __m512 s = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, row), dec);
      _mm512_mask_storeu_ps(row, mk, s);
      mem = _mm512_fmadd_ps(s, _mm512_set1_ps(k[i]), mem);
    }
    const __m512 delta = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, v + d), mem), _mm512_set1_ps(beta));
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < Dk; ++i) {
      float* row = S + i * Dv + d;
      const __m512 s = _mm512_add_ps(_mm512_maskz_loadu_ps(mk, row), _mm512_mul_ps(_mm512_set1_ps(k[i]), delta));
      _mm512_mask_storeu_ps(row, mk, s);
      acc = _mm512_fmadd_ps(s, _mm512_set1_ps(q[i]), acc);
    }
    _mm512_mask_storeu_ps(o + d, mk, acc);
  }
}

// Qwen3.5's gated delta rule (delta_rule.py's GatedDeltaNet, T = 1): [q; k; v; z; b; a] = in_proj(h); the SiLU
// convolution of [q; k; v]; q, k L2-normed per key head (q also / sqrt(Dk)), shared by Hv / Hk value heads; beta =
// sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the recurrence per value head; RMSNorm(o) * weight *
// silu(z) per head; out_proj.
int delta_rule(const NtModel* m, const NtRecurrent& R, const float* h, int64_t B, float* out) {
  const int64_t C = m->hidden, Hv = R.heads, Hk = R.groups, Dk = R.head_k, Dv = R.head_v;
  const int64_t key = Hk * Dk, value = Hv * Dv, n = R.channels, width = n + value + 2 * Hv, per = Hv / Hk;
  grow(proj_buf, B * width), grow(mixed_buf, B * value), grow(conv_buf, B * n);
  float *proj = proj_buf.data(), *mixed = mixed_buf.data(), *qkv = conv_buf.data();
  if (linear(R.wi, h, B, width, C, proj)) return 1;
  const float root = (float)sqrt((double)Dk);  // q / Dk ** 0.5
  for (int64_t b = 0; b < B; ++b) {
    float* row = qkv + b * n;
    conv_step(R, R.window + slot_of(m, b) * n * (R.kernel - 1), proj + b * width, true, row);
    for (int64_t head = 0; head < Hk; ++head) {
      l2norm(row + head * Dk, Dk, 1e-6f), l2norm(row + key + head * Dk, Dk, 1e-6f);
      for (int64_t i = 0; i < Dk; ++i) row[head * Dk + i] = row[head * Dk + i] / root;
    }
  }
  const int64_t state_size = Hv * Dk * Dv;
#pragma omp parallel for schedule(static) if (B * state_size >= (1 << 16))
  for (int64_t bh = 0; bh < B * Hv; ++bh) {
    const int64_t b = bh / Hv, head = bh % Hv, kh = head / per;
    const float *p = proj + b * width, *row = qkv + b * n;
    const float a = p[n + value + Hv + head], beta_in = p[n + value + head];
    const float g = -expf(R.A_log[head]) * softplus(a + R.dt_bias[head]);
    const float beta = 1.f / (1.f + expf(-beta_in));
    float* o = mixed + b * value + head * Dv;
    delta_head(R.state + slot_of(m, b) * state_size + head * Dk * Dv, row + kh * Dk, row + key + kh * Dk,
               row + 2 * key + head * Dv, expf(g), beta, Dk, Dv, o);
    const float* z = p + n + head * Dv;  // RMSNormGated: normalise, scale, times silu(z)
    float ss = 0.f;
    for (int64_t d = 0; d < Dv; ++d) ss += o[d] * o[d];
    const float r = 1.f / sqrtf(ss / (float)Dv + (float)m->eps);
    for (int64_t d = 0; d < Dv; ++d) o[d] = (R.norm[d] * (o[d] * r)) * silu(z[d]);
  }
  return linear(R.wo, mixed, B, C, value, out);
}

// One head's SSD step (ssd.py's state_update) on its (P, N) state S: S = S * exp(dt A) + (dt B) x^T, y = S C + D x.
TARGET void ssd_head(float* S, const float* x, const float* Bg, const float* Cg, float dt, float dA, float Dh,
                     int64_t P, int64_t N, float* y) {
  const __m512 decay = _mm512_set1_ps(dA), vdt = _mm512_set1_ps(dt);
  for (int64_t p = 0; p < P; ++p) {
    float* row = S + p * N;
    const __m512 xv = _mm512_set1_ps(x[p]);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < N; i += 16) {
      const __mmask16 mk = tail(N - i);
      const __m512 dtB = _mm512_mul_ps(vdt, _mm512_maskz_loadu_ps(mk, Bg + i));
      const __m512 s = _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, row + i), decay), _mm512_mul_ps(dtB, xv));
      _mm512_mask_storeu_ps(row + i, mk, s);
      acc = _mm512_fmadd_ps(s, _mm512_maskz_loadu_ps(mk, Cg + i), acc);
    }
    y[p] = _mm512_reduce_add_ps(acc) + x[p] * Dh;
  }
}

// The SSD's gated norm of one row's y (inner,) with its gate z, over norm_groups parts: Granite's / Mamba2's
// (GraniteMoeHybridRMSNormGated) the gate first, then the norm; Falcon-H1's (conv.py's gated_rms_norm,
// norm_before_gate) the norm, then the gate; without a norm weight the gate alone (FalconMixer._norm).
void ssd_norm(const NtModel* m, const NtRecurrent& R, float* y, const float* z, int64_t inner) {
  if (!R.norm || !R.norm_first)
    for (int64_t i = 0; i < inner; ++i) y[i] = y[i] * silu(z[i]);
  if (!R.norm) return;
  const int64_t part = inner / R.norm_groups;
  for (int64_t grp = 0; grp < R.norm_groups; ++grp) {
    float* yg = y + grp * part;
    const float* w = R.norm + grp * part;
    float ss = 0.f;
    for (int64_t i = 0; i < part; ++i) ss += yg[i] * yg[i];
    const float r = 1.f / sqrtf(ss / (float)part + (float)m->eps);
    if (R.norm_first) {
      for (int64_t i = 0; i < part; ++i) yg[i] = (w[i] * (yg[i] * r)) * silu(z[grp * part + i]);
    } else {
      for (int64_t i = 0; i < part; ++i) yg[i] = w[i] * (yg[i] * r);
    }
  }
}

// Mamba2's selective state space layer (ssd.py's Mamba2Mixer, T = 1): [z; xBC; dt] = in_proj(h); the SiLU
// convolution (with its bias) of xBC; per head dt = softplus(dt + dt_bias), the state step with its group's B and
// C; then the gated norm (ssd_norm); out_proj.
int ssd(const NtModel* m, const NtRecurrent& R, const float* h, int64_t B, float* out) {
  const int64_t C = m->hidden, H = R.heads, G = R.groups, P = R.head_k, N = R.head_v;
  const int64_t inner = H * P, n = R.channels, width = inner + n + H, per = H / G;
  grow(proj_buf, B * width), grow(mixed_buf, B * inner), grow(conv_buf, B * n);
  float *proj = proj_buf.data(), *mixed = mixed_buf.data(), *xbc = conv_buf.data();
  if (linear(R.wi, h, B, width, C, proj)) return 1;
  for (int64_t b = 0; b < B; ++b)
    conv_step(R, R.window + slot_of(m, b) * n * (R.kernel - 1), proj + b * width + inner, true, xbc + b * n);
  const int64_t state_size = H * P * N;
#pragma omp parallel for schedule(static) if (B * state_size >= (1 << 16))
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, head = bh % H, g = head / per;
    const float *p = proj + b * width, *row = xbc + b * n;
    const float dt = softplus(p[inner + n + head] + R.dt_bias[head]);
    const float dA = expf(dt * -expf(R.A_log[head]));
    ssd_head(R.state + slot_of(m, b) * state_size + head * P * N, row + head * P, row + inner + g * N,
             row + inner + G * N + g * N, dt, dA, R.D[head], P, N, mixed + b * inner + head * P);
  }
  for (int64_t b = 0; b < B; ++b) ssd_norm(m, R, mixed + b * inner, proj + b * width, inner);
  return linear(R.wo, mixed, B, C, inner, out);
}

}  // namespace

extern "C" {

// A recurrent layer's mixer on B rows: out (B, C) = mixer(h), h (B, C) the block's normed input, each row's state
// slot read and updated in place. Returns 0, or 1 for an unknown mixer or an unsupported shape.
int nt_recurrent_half(const NtModel* m, const NtLayer* L, const float* h, int64_t B, float* out) {
  const NtRecurrent* R = L->recurrent;
  if (!R || !R->window || R->kernel < 1) return 1;
  switch (L->mixer) {
    case MIX_SHORT_CONV:
      return R->channels == m->hidden ? short_conv(m, *R, h, B, out) : 1;
    case MIX_DELTA_RULE:
      if (!R->state || R->groups < 1 || R->heads % R->groups) return 1;
      return delta_rule(m, *R, h, B, out);
    case MIX_SSD:
      if (!R->state || R->groups < 1 || R->heads % R->groups || R->norm_groups < 1) return 1;
      return ssd(m, *R, h, B, out);
    default:
      return 1;
  }
}
}
