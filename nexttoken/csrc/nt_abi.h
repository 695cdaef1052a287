// The native boundary: every struct and code that Python hands to the kernels, in one place.
//
// nexttoken/model/native_abi.py mirrors these structs with ctypes and, when the library loads, compares its
// mirrors with nt_abi_layout() (abi.cpp: each struct's size and each field's offset and size, and the codes'
// values). A field added, moved or resized on one side only is then an error at load, never a wrong number.
// Change a struct or a code here and in native_abi.py together; abi.cpp's table lists every field.
//
// Every field is 8 bytes wide, so the mirrors need no padding rules.

#pragma once

#include <stdint.h>

// A weight's kind (NtLinear.kind, nt_linear's `kind`): how its rows are stored.
enum NtKind : int64_t {
  W_F32 = 0,    // float32 rows
  W_BF16 = 1,   // bfloat16 rows, widened exactly
  W_I8 = 2,     // int8 rows times one float32 scale per row (NtLinear.scale)
  W_I4 = 3,     // int4.cpp's grouped 4-bit layout, float16 scales per group of 32 (NtLinear.scale)
  W_I8_F32 = 4,  // W_I8 multiplied with float32 activations (exact; the default) instead of int16 per row
  W_I4_F32 = 5,  // W_I4 multiplied with float32 activations (exact; the default) instead of int8 per group
  W_GGML = 16,  // W_GGML + t: GGUF's blocks of ggml type t (ggml.cpp); t may carry the two flags below
};

// Flags on a ggml type (W_GGML + (t | flags)).
enum NtGgml : int64_t {
  GGML_MIXED = 255,  // the weight is a description of row ranges of several types (ggml.cpp's linear_mixed)
  GGML_Q16 = 256,    // int16 activations per block of 32 instead of int8
  GGML_F32 = 512,    // float32 activations on the dequantized weights (exact; the default)
};

enum NtOut { OUT_F32 = 0, OUT_BF16 = 1 };  // an output's dtype: float32 or bfloat16

enum NtKv : int64_t { KV_F32 = 0, KV_I8 = 2 };  // NtModel.kv_kind: the cache's elements

// NtModel.flags: the families' switches on the one block. NT_RELU2: the MLP is ungated, w2(relu(w13(x))^2) with
// w13 (I, C) the up projection alone (Nemotron-H).
enum NtFlag : int64_t { NT_PLUS_ONE = 1, NT_SANDWICH = 2, NT_NORM_AFTER = 4, NT_GELU = 8, NT_RELU2 = 16 };

// NtModel.qk_norm: where q and k are normalised before RoPE.
enum NtQkNorm : int64_t { QK_NONE = 0, QK_HEAD = 1, QK_PROJECTION = 2 };

// NtModel.router: how a MoE layer's router logits (E,) become the chosen experts and their weights (model/moe.py's
// route). ROUTE_SOFTMAX: softmax over the experts in float32, the top k (+ NtLayer.correction for the choice
// only: ERNIE 4.5), renormalised where norm_topk. ROUTE_TOPK_SOFTMAX: the top k logits (the router's bias
// included), softmax over those k (gpt-oss, Granite 4.0-H). ROUTE_SIGMOID: sigmoid scores, the choice by score +
// correction within the topk_group best of n_group groups (the sum of each group's two best), the chosen plain
// scores renormalised (+ topk_norm_eps) where norm_topk, times routed_scaling (GLM-4 MoE, LFM2-MoE).
enum NtRouter : int64_t { ROUTE_SOFTMAX = 0, ROUTE_TOPK_SOFTMAX = 1, ROUTE_SIGMOID = 2 };

struct NtLinear {
  const void* weight;  // (out, in) rows of `kind`; a GGUF mixed matrix: its int64 description of parts
  int64_t kind;        // NtKind: W_F32, W_BF16, W_I8 (then scale is set), W_I4, or W_GGML + ggml type (| flags)
  const float* scale;  // (out,) or NULL; W_I4: (out, groups) float16
  const float* bias;   // (out,) or NULL
};

struct NtLora {         // one matrix's LoRA adapters (model/lora/layers.py's LoraLinear), applied per row
  const float* A;       // (slots, R, in) float32; NULL: no adapters on this matrix
  const float* Bt;      // (slots, R, out) float32: B transposed
  int64_t rank;         // R: the stack's padded width (zeros past an adapter's own rank)
};

struct NtExpert {  // one gated MLP of a mixture of experts
  NtLinear w13;     // (2*I, C): gate then up
  NtLinear w2;      // (C, I)
};

// NtLayer.mixer: the layer kind's mixer (families/base.py's LayerKind.mixer). Issue 41's recurrent kinds read and
// update each row's state slot in place (NtLayer.recurrent, csrc/recurrent.cpp).
enum NtMixer : int64_t { MIX_ATTENTION = 0, MIX_SHORT_CONV = 1, MIX_DELTA_RULE = 2, MIX_SSD = 3 };

struct NtRecurrent {      // one recurrent layer's weights and its state slots (model/recurrent/)
  NtLinear wi;            // in_proj: short conv (3C, C) [B; C; x]; delta rule [q; k; v; z; b; a]; SSD [z; xBC; dt]
  NtLinear wo;            // out_proj (C, inner)
  const float* conv;      // (channels, K) depthwise taps
  const float* conv_bias; // (channels,) or NULL
  const float* dt_bias;   // (heads,) delta rule / SSD
  const float* A_log;     // (heads,)
  const float* D;         // (heads,) SSD's skip
  const float* norm;      // the gated norm's weight: delta rule (Dv,), SSD (heads * head_dim,)
  float* window;          // (slots, channels, K - 1): each slot's last K - 1 convolution inputs, updated in place
  float* state;           // (slots, heads, head_k, head_v) float32: delta rule (Dk, Dv), SSD (P, N); NULL: none
  int64_t channels, kernel;  // convolved channels, K taps
  int64_t heads, groups;     // value heads (SSD: heads); key heads (SSD: B / C groups)
  int64_t head_k, head_v;    // delta rule: Dk, Dv; SSD: head_dim P, state_size N
  int64_t norm_groups;       // SSD: the gated norm's groups
  int64_t norm_first;        // SSD: 0 the gate then the norm (Granite, Mamba2); 1 the norm then the gate (Falcon-H1's
                             // norm_before_gate); norm NULL: the gate alone (Falcon-H1 without mamba_rms_norm)
};

struct NtLayer {
  const float* attn_norm;  // (C,)
  const float* ffn_norm;   // (C,)
  NtLinear qkv;            // (H*D + 2*Hkv*D, C): q, k, v fused
  NtLinear o;              // (C, H*D)
  NtLinear w13;            // (2*I, C): gate then up
  NtLinear w2;             // (C, I)
  void* k_cache;           // this layer's (N, Hkv, bs, D) keys: N blocks of bs columns (a slot cache: bs = S)
  void* v_cache;           // and values; float32, or int8 (NtModel.kv_kind KV_I8) with the scales below
  float* k_scale;          // int8: (N, Hkv, bs) one scale per token and head (absmax / 127); else NULL
  float* v_scale;
  // The families' parts (model/layers.py); NULL / 0 where the block has none.
  const float* q_norm;          // q's RMSNorm weight before RoPE: (D,) per head, or (H*D,) the whole projection
  const float* k_norm;          // k's: (D,) or (Hkv*D,)
  const float* attn_post_norm;  // Gemma's sandwich: the attention output's norm (C,) before the residual add
  const float* ffn_post_norm;   // and the MLP output's
  int64_t sliding;              // 1: this layer attends the last NtModel.window columns (with local_inv_freq's RoPE)
  int64_t no_rope;              // 1: q and k are not rotated (a NoPE layer: SmolLM3's every fourth)
  NtLinear router;              // a MoE layer: (E, C) float32 router (weight NULL: a dense MLP, w13 / w2 above)
  const NtExpert* experts;      // (E,) the experts' gated MLPs
  NtExpert shared;              // the always-on shared expert (w13.weight NULL: none)
  NtLinear shared_gate;         // its (1, C) sigmoid gate (Qwen2-MoE); weight NULL: ungated (GLM-4 MoE, ERNIE 4.5)
  NtLora lora_qkv, lora_o, lora_w13, lora_w2;  // LoRA stacks of the four matrices (A NULL: none)
  // Issue 41 (csrc/recurrent.cpp): the mixer; a recurrent one reads `recurrent` instead of qkv / o / the cache.
  // w13.weight and router.weight both NULL: a block without an MLP (Mamba2: norm, mixer, residual).
  int64_t mixer;                 // NtMixer
  const NtRecurrent* recurrent;  // MIX_SHORT_CONV / MIX_DELTA_RULE / MIX_SSD's weights and state; else NULL
  int64_t gated;                 // 1: q_proj's rows are [query; gate] per head, the output times sigmoid(gate)
  const float* correction;       // (E,) float32 added to the scores for the choice only (NtModel.router); NULL: none
  const float* sinks;            // (H,) a learned logit per head joining each softmax (gpt-oss); NULL: none
  // Falcon-H1: a recurrent mixer beside the attention on the same normed input h (NULL: none), the layer's first
  // branch mixer(h * parallel_in) * parallel_out + attention(h * attn_in) * attn_out (FalconBlock's order).
  const NtRecurrent* parallel;   // its weights and state slots
  int64_t parallel_mixer;        // its NtMixer
  double parallel_in, parallel_out, attn_in, attn_out;  // the branches' multipliers (read only with `parallel`)
  // Gemma 4 (model/gemma4.py's Gemma4Block): the layer's own shapes (0: the model's), its attention's parts, its
  // per-layer input and scalar, and the MoE block beside its dense MLP.
  int64_t head_dim, n_kv_heads, intermediate;  // D, Hkv (its cache columns' first heads and dims), the MLP's I
  int64_t kv_shared;           // 1: q alone; k_cache / v_cache (and scales) are the source layer's, written earlier
                               // in the same step
  int64_t values_from_keys;    // 1: qkv holds q and k only; the values are the keys before their norm and RoPE
  int64_t v_norm;              // 1: the values RMS-normed without a weight
  const float* layer_scalar;   // (1,) the layer's output times it; NULL: none
  NtLinear input_gate;         // (P, C): x += input_norm(input_projection(act(input_gate(x)) * per_layer[l]));
  NtLinear input_projection;   // (C, P)    weight NULL: no per-layer input
  const float* input_norm;     // (C,)
  const float* router_scale;   // (C,) the experts beside the dense MLP, routed by router(rms(x) * router_scale *
                               // C^-0.5); NULL: no such block (router / experts above are then a plain MoE's)
  const float* expert_scale;   // (E,) a chosen expert's weight times its scale (after the renormalisation)
  const float* mlp_post_norm;  // (C,) the dense MLP's output norm,
  const float* experts_norm;   // the experts' input norm
  const float* experts_post_norm;  // and their output norm; the sum of both branches then takes ffn_post_norm
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
  int64_t kv_kind;  // NtKv: the cache's elements, KV_F32, or KV_I8 with per token and head scales
  // The families' switches (config.py's ModelConfig; the neutral value where the family has none).
  int64_t flags;            // NtFlag: NT_PLUS_ONE | NT_SANDWICH | NT_NORM_AFTER | NT_GELU
  int64_t qk_norm;          // NtQkNorm: QK_NONE, QK_HEAD each head over D (Qwen3, Gemma 3), QK_PROJECTION (OLMo 2)
  double embed_mult;        // embeddings times this (Granite's embedding_multiplier; 1.0: none)
  double embed_scale;       // then times this, already rounded to float32 (Gemma: sqrt(hidden); 1.0: none)
  double attn_scale;        // attention scores' scale (Granite's multiplier, Gemma's query_pre_attn_scalar^-0.5);
                            // 0: 1/sqrt(D)
  double attn_softcap;      // scores = cap * tanh(scores / cap) before the softmax (Gemma 2); 0: none
  double residual;          // each branch times this before the residual add (Granite; 1.0: none)
  double final_softcap;     // logits = cap * tanh(logits / cap) (Gemma); 0: none
  double logits_scaling;    // logits / this (Granite; 1.0: none)
  int64_t window;           // a sliding layer's columns: the last `window` (0: no sliding layers)
  const float* local_inv_freq;  // (D/2,) the sliding layers' own RoPE (Gemma 3); NULL: inv_freq
  const float* long_inv_freq;   // (D/2,) Phi-3 LongRoPE's long set (NULL: none), taken past rope_original_max
  int64_t rope_original_max;
  double rope_scaling;          // cos and sin times this (LongRoPE's attention factor; 1.0: none)
  int64_t n_experts, top_k, norm_topk;        // MoE layers: route each row to top_k of n_experts (renormalised)
  int64_t moe_intermediate, shared_intermediate;  // an expert's width, the shared expert's (0: none)
  const int64_t* state_slots;  // (B,) this call's recurrent state slot per row; NULL: row b uses slot b
  int64_t rotary_dim;          // the rotated first part of each head (Qwen3.5's partial RoPE); 0: all of head_dim.
                               // Gemma 4: its full layers' whole head (NtLayer.head_dim) on inv_freq
  const int64_t* lora_slots;  // (B,) this call's adapter slot per row (-1: the base alone); NULL: no adapters
  int64_t router;             // NtRouter: the MoE layers' routing rule
  int64_t n_group, topk_group;  // ROUTE_SIGMOID's expert groups (n_group <= 1: no group limit)
  double routed_scaling;      // ROUTE_SIGMOID: the weights times this (1.0: none)
  double topk_norm_eps;       // ROUTE_SIGMOID: added to the chosen scores' sum before renormalising (0: none)
  double swiglu_limit;        // gpt-oss's clamped SwiGLU: gate <= limit, |up| <= limit, (up + 1) * gate *
  double swiglu_alpha;        // sigmoid(alpha * gate); limit 0: the plain silu(gate) * up
  int64_t kv_dim;             // a cache column's width: the widest layer's head_dim (Gemma 4); 0: head_dim
  const float* per_layer;     // (B, n_layers, per_layer_dim) this call's per-layer inputs (Gemma 4); NULL: none
  int64_t per_layer_dim;      // P
};
