// nt_abi_layout(): the layout of nt_abi.h as this library was compiled, for nexttoken/model/native_abi.py to
// compare with its ctypes mirrors when the library loads (a drift is an error at start, never a wrong number).
//
// One line per struct, field and code, in declaration order:
//   struct NAME SIZE
//   field STRUCT NAME OFFSET SIZE
//   code NAME VALUE
// Each struct's listed fields are checked here to cover it (their sizes sum to its size, none overlapping), so a
// field added to nt_abi.h without its line below fails to compile; their order is the header's, by offset.

#include <stddef.h>
#include <stdint.h>

#include <string>

#include "nt_abi.h"

namespace {

struct Field {
  const char* owner;
  const char* name;
  size_t offset, size;
};

#define NT_FIELD(S, f) Field{#S, #f, offsetof(S, f), sizeof(((S*)nullptr)->f)}

constexpr Field kFields[] = {
    NT_FIELD(NtLinear, weight), NT_FIELD(NtLinear, kind), NT_FIELD(NtLinear, scale), NT_FIELD(NtLinear, bias),

    NT_FIELD(NtLora, A), NT_FIELD(NtLora, Bt), NT_FIELD(NtLora, rank),

    NT_FIELD(NtExpert, w13), NT_FIELD(NtExpert, w2),

    NT_FIELD(NtLayer, attn_norm), NT_FIELD(NtLayer, ffn_norm), NT_FIELD(NtLayer, qkv), NT_FIELD(NtLayer, o),
    NT_FIELD(NtLayer, w13), NT_FIELD(NtLayer, w2), NT_FIELD(NtLayer, k_cache), NT_FIELD(NtLayer, v_cache),
    NT_FIELD(NtLayer, k_scale), NT_FIELD(NtLayer, v_scale), NT_FIELD(NtLayer, q_norm), NT_FIELD(NtLayer, k_norm),
    NT_FIELD(NtLayer, attn_post_norm), NT_FIELD(NtLayer, ffn_post_norm), NT_FIELD(NtLayer, sliding), NT_FIELD(NtLayer, no_rope),
    NT_FIELD(NtLayer, router), NT_FIELD(NtLayer, experts), NT_FIELD(NtLayer, shared),
    NT_FIELD(NtLayer, shared_gate), NT_FIELD(NtLayer, lora_qkv), NT_FIELD(NtLayer, lora_o),
    NT_FIELD(NtLayer, lora_w13), NT_FIELD(NtLayer, lora_w2), NT_FIELD(NtLayer, mixer),
    NT_FIELD(NtLayer, recurrent), NT_FIELD(NtLayer, gated), NT_FIELD(NtLayer, correction),
    NT_FIELD(NtLayer, sinks), NT_FIELD(NtLayer, parallel), NT_FIELD(NtLayer, parallel_mixer),
    NT_FIELD(NtLayer, parallel_in), NT_FIELD(NtLayer, parallel_out), NT_FIELD(NtLayer, attn_in),
    NT_FIELD(NtLayer, attn_out), NT_FIELD(NtLayer, head_dim), NT_FIELD(NtLayer, n_kv_heads),
    NT_FIELD(NtLayer, intermediate), NT_FIELD(NtLayer, kv_shared), NT_FIELD(NtLayer, values_from_keys),
    NT_FIELD(NtLayer, v_norm), NT_FIELD(NtLayer, layer_scalar), NT_FIELD(NtLayer, input_gate),
    NT_FIELD(NtLayer, input_projection), NT_FIELD(NtLayer, input_norm), NT_FIELD(NtLayer, router_scale),
    NT_FIELD(NtLayer, expert_scale), NT_FIELD(NtLayer, mlp_post_norm), NT_FIELD(NtLayer, experts_norm),
    NT_FIELD(NtLayer, experts_post_norm),

    NT_FIELD(NtRecurrent, wi), NT_FIELD(NtRecurrent, wo), NT_FIELD(NtRecurrent, conv),
    NT_FIELD(NtRecurrent, conv_bias), NT_FIELD(NtRecurrent, dt_bias), NT_FIELD(NtRecurrent, A_log),
    NT_FIELD(NtRecurrent, D), NT_FIELD(NtRecurrent, norm), NT_FIELD(NtRecurrent, window),
    NT_FIELD(NtRecurrent, state), NT_FIELD(NtRecurrent, channels), NT_FIELD(NtRecurrent, kernel),
    NT_FIELD(NtRecurrent, heads), NT_FIELD(NtRecurrent, groups), NT_FIELD(NtRecurrent, head_k),
    NT_FIELD(NtRecurrent, head_v), NT_FIELD(NtRecurrent, norm_groups), NT_FIELD(NtRecurrent, norm_first),

    NT_FIELD(NtModel, n_layers), NT_FIELD(NtModel, hidden), NT_FIELD(NtModel, n_heads),
    NT_FIELD(NtModel, n_kv_heads), NT_FIELD(NtModel, head_dim), NT_FIELD(NtModel, intermediate),
    NT_FIELD(NtModel, vocab), NT_FIELD(NtModel, embed), NT_FIELD(NtModel, cache_row_stride),
    NT_FIELD(NtModel, cache_head_stride), NT_FIELD(NtModel, eps), NT_FIELD(NtModel, inv_freq),
    NT_FIELD(NtModel, final_norm), NT_FIELD(NtModel, lm_head), NT_FIELD(NtModel, layers),
    NT_FIELD(NtModel, kv_kind), NT_FIELD(NtModel, flags), NT_FIELD(NtModel, qk_norm),
    NT_FIELD(NtModel, embed_mult), NT_FIELD(NtModel, embed_scale), NT_FIELD(NtModel, attn_scale),
    NT_FIELD(NtModel, attn_softcap), NT_FIELD(NtModel, residual), NT_FIELD(NtModel, final_softcap),
    NT_FIELD(NtModel, logits_scaling), NT_FIELD(NtModel, window), NT_FIELD(NtModel, local_inv_freq),
    NT_FIELD(NtModel, long_inv_freq), NT_FIELD(NtModel, rope_original_max), NT_FIELD(NtModel, rope_scaling),
    NT_FIELD(NtModel, n_experts), NT_FIELD(NtModel, top_k), NT_FIELD(NtModel, norm_topk),
    NT_FIELD(NtModel, moe_intermediate), NT_FIELD(NtModel, shared_intermediate), NT_FIELD(NtModel, state_slots),
    NT_FIELD(NtModel, rotary_dim), NT_FIELD(NtModel, lora_slots), NT_FIELD(NtModel, router),
    NT_FIELD(NtModel, n_group), NT_FIELD(NtModel, topk_group), NT_FIELD(NtModel, routed_scaling),
    NT_FIELD(NtModel, topk_norm_eps), NT_FIELD(NtModel, swiglu_limit), NT_FIELD(NtModel, swiglu_alpha),
    NT_FIELD(NtModel, kv_dim), NT_FIELD(NtModel, per_layer), NT_FIELD(NtModel, per_layer_dim),
};

struct Struct {
  const char* name;
  size_t size;
};

constexpr Struct kStructs[] = {{"NtLinear", sizeof(NtLinear)}, {"NtLora", sizeof(NtLora)},
                               {"NtExpert", sizeof(NtExpert)}, {"NtLayer", sizeof(NtLayer)},
                               {"NtModel", sizeof(NtModel)}, {"NtRecurrent", sizeof(NtRecurrent)}};

struct Code {
  const char* name;
  int64_t value;
};

#define NT_CODE(c) Code{#c, (int64_t)(c)}

constexpr Code kCodes[] = {
    NT_CODE(W_F32),       NT_CODE(W_BF16),      NT_CODE(W_I8),          NT_CODE(W_I4),       NT_CODE(W_I8_F32),   NT_CODE(W_I4_F32),  NT_CODE(W_GGML),
    NT_CODE(GGML_MIXED),  NT_CODE(GGML_Q16),    NT_CODE(GGML_F32),    NT_CODE(OUT_F32),       NT_CODE(OUT_BF16),   NT_CODE(KV_F32),
    NT_CODE(KV_I8),       NT_CODE(NT_PLUS_ONE), NT_CODE(NT_SANDWICH),   NT_CODE(NT_NORM_AFTER),
    NT_CODE(NT_GELU),     NT_CODE(NT_RELU2),    NT_CODE(QK_NONE),     NT_CODE(QK_HEAD),       NT_CODE(QK_PROJECTION),
    NT_CODE(MIX_ATTENTION), NT_CODE(MIX_SHORT_CONV), NT_CODE(MIX_DELTA_RULE), NT_CODE(MIX_SSD),
    NT_CODE(ROUTE_SOFTMAX), NT_CODE(ROUTE_TOPK_SOFTMAX), NT_CODE(ROUTE_SIGMOID),
};

constexpr bool same(const char* a, const char* b) { return *a == *b && (*a == 0 || same(a + 1, b + 1)); }

// Struct s's listed fields cover it: their sizes sum to its size and no two overlap, so none is left out (in
// whatever order nt_abi.h declares them: describe() reports them by offset, and Python checks the order).
constexpr bool covered(const Struct& s) {
  size_t total = 0;
  for (const Field& f : kFields) {
    if (!same(f.owner, s.name)) continue;
    total += f.size;
    for (const Field& g : kFields)
      if (&g != &f && same(g.owner, s.name) && g.offset < f.offset + f.size && f.offset < g.offset + g.size)
        return false;
  }
  return total == s.size;
}

static_assert(covered(kStructs[0]), "abi.cpp lists every field of NtLinear");
static_assert(covered(kStructs[1]), "abi.cpp lists every field of NtLora");
static_assert(covered(kStructs[2]), "abi.cpp lists every field of NtExpert");
static_assert(covered(kStructs[3]), "abi.cpp lists every field of NtLayer");
static_assert(covered(kStructs[4]), "abi.cpp lists every field of NtModel");
static_assert(covered(kStructs[5]), "abi.cpp lists every field of NtRecurrent");

std::string describe() {
  std::string out;
  for (const Struct& s : kStructs) out += "struct " + std::string(s.name) + " " + std::to_string(s.size) + "\n";
  for (const Struct& s : kStructs)  // each struct's fields in memory order
    for (size_t at = 0; at < s.size;) {
      const Field* next = nullptr;
      for (const Field& f : kFields)
        if (same(f.owner, s.name) && f.offset == at) next = &f;
      if (!next) break;  // padding: covered() rules it out
      out += "field " + std::string(s.name) + " " + next->name + " " + std::to_string(at) + " " +
             std::to_string(next->size) + "\n";
      at += next->size;
    }
  for (const Code& c : kCodes) out += "code " + std::string(c.name) + " " + std::to_string(c.value) + "\n";
  return out;
}

}  // namespace

extern "C" const char* nt_abi_layout() {
  static const std::string text = describe();  // built once (thread-safe), kept for the library's lifetime
  return text.c_str();
}
