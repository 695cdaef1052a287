"""Issue 41's layer kinds that keep a state per sequence, through the modules path, against transformers 5.24 on the
same random weights: LFM2 (gated short convolutions between attention layers), Qwen3.5 (three gated-DeltaNet
layers before each gated attention layer) and Granite 4.0-H (Mamba2 layers between NoPE attention layers). Config reading, logits at the first and late steps, greedy and seeded
tokens through `nexttoken.generate` (one row and a left-padded batch), the chunked (parallel) prefill against the
one-step recurrence, chunked prefill with chunk sizes 1, 7 and 64 leaving the same state, and `nexttoken.load`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nexttoken
from nexttoken.config import ModelConfig
from nexttoken.families import CONVOLUTION, FULL, LINEAR_ATTENTION, NOPE, STATE_SPACE, features_table
from nexttoken.model import ForwardBatch, fused, kernels, load_model
from nexttoken.model.layers import Attention
from nexttoken.model.quant.ggml import GGUFLinear, native_blocks
from nexttoken.model.recurrent import delta_rule, ssd
from support.tiny_models import BASE, HYBRID_FAMILIES, RECURRENT, VARIANTS, build_hf_model, save_variant

PROMPTS = torch.tensor([[1, 5, 17, 33, 9, 60], [1, 40, 41, 42, 43, 44], [1, 90, 3, 3, 8, 12]])
LONG = [1] + [(7 * i + 3) % 95 + 1 for i in range(69)]  # > 64 tokens: two chunks of the parallel form


@pytest.fixture(scope="module", params=sorted(RECURRENT - HYBRID_FAMILIES))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_variant(request.param, folder)
    return request.param, hf, load_model(folder), folder


def _logits(model, ids: list[int], chunk: int) -> tuple[torch.Tensor, object]:
    """(T, V) logits of every position of `ids` prefilled in chunks of `chunk`, and the cache left behind."""
    cache = model.new_cache(1, len(ids) + 1)
    valid = torch.ones(1, len(ids) + 1, dtype=torch.bool)
    out = []
    with torch.no_grad():
        for start in range(0, len(ids), chunk):
            end = min(start + chunk, len(ids))
            cols = torch.arange(start, end)[None]
            batch = ForwardBatch.build(cols, cols, valid, end, write_start=start, last_only=False)
            out.append(model(torch.tensor([ids[start:end]]), batch, cache)[0])
    return torch.cat(out), cache


def test_layer_kinds_are_transformers_layer_types() -> None:
    import transformers

    lfm = ModelConfig.from_dict(transformers.Lfm2Config(num_hidden_layers=4, full_attn_idxs=[1, 3]).to_dict())
    assert lfm.layers == (CONVOLUTION, FULL, CONVOLUTION, FULL)
    assert lfm.intermediate_size == 8192 and lfm.rms_norm_eps == 1e-5  # Lfm2MLP's 2/3 rounded up; norm_eps
    qwen = ModelConfig.from_dict(transformers.Qwen3_5TextConfig(num_hidden_layers=8).to_dict())
    assert qwen.layers == (LINEAR_ATTENTION,) * 3 + (FULL,) + (LINEAR_ATTENTION,) * 3 + (FULL,)
    assert qwen.rotary_dim == 64 and qwen.attention_output_gate and qwen.norm_plus_one  # 0.25 of head_dim 256
    granite = ModelConfig.from_dict(transformers.GraniteMoeHybridConfig(
        num_hidden_layers=4, num_local_experts=0, layer_types=["mamba", "attention", "mamba", "mamba"]).to_dict())
    assert granite.layers == (STATE_SPACE, NOPE, STATE_SPACE, STATE_SPACE)
    assert granite.recurrent.mamba_head_dim == 2 * 4096 // 128 and granite.recurrent.time_step_limit[1] == float("inf")
    moe = ModelConfig.from_dict(transformers.GraniteMoeHybridConfig(num_hidden_layers=2).to_dict()).moe
    assert (moe.num_experts, moe.top_k, moe.shared_intermediate_size) == (8, 2, 1024) and moe.softmax_after_topk
    for hf, arch in ((transformers.Lfm2Config(), "Lfm2ForCausalLM"), (transformers.Qwen3_5TextConfig(), "Qwen3_5ForCausalLM"),
                     (transformers.GraniteMoeHybridConfig(num_local_experts=0), "GraniteMoeHybridForCausalLM")):
        raw = hf.to_dict()  # a config.json with only the model_type
        raw.pop("architectures", None)
        assert ModelConfig.from_dict(raw).architecture == arch


def test_a_vision_language_qwen3_5_checkpoint_loads_its_text_model(tmp_path: Path) -> None:
    """Qwen3.5's released checkpoints are Qwen3_5ForConditionalGeneration: the text model from `text_config` and
    `model.language_model.*`, the vision tower left out; its text tokens are transformers' own model's."""
    import transformers

    _, text = VARIANTS["qwen3_5-delta"]
    text = {**BASE, **text, "num_hidden_layers": 4}
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64))
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.config.architecture == "Qwen3_5ForCausalLM" and model.config.num_hidden_layers == 4
    ids = torch.tensor([[1, 5, 17, 33, 9, 60, 7]])
    greedy = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(nexttoken.generate(model, ids, **greedy), hf.generate(input_ids=ids, **greedy))


def test_logits_first_and_late_steps_equal_transformers(pair) -> None:
    """Every position's logits of a 70-token prompt (the parallel form over two chunks of 64) within float32 rounding
    of transformers'; test_chunked_prefill_leaves_the_state_of_one_pass holds the one-step recurrence (chunks of 1:
    the first and the late steps) to these."""
    _, hf, model, _ = pair
    with torch.no_grad():
        want = hf(torch.tensor([LONG])).logits[0]
    got, _ = _logits(model, LONG, len(LONG))
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert torch.allclose(torch.log_softmax(got, -1), torch.log_softmax(want, -1), atol=1e-4)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_leaves_the_state_of_one_pass(pair, chunk: int) -> None:
    """A prompt prefilled in chunks of 1, 7 or 64 tokens leaves the same recurrent state (and K/V) as one pass,
    within float tolerance, and the same next-token logits."""
    _, _, model, _ = pair
    whole, ref = _logits(model, LONG, len(LONG))
    got, cache = _logits(model, LONG, chunk)
    assert torch.allclose(got, whole, atol=1e-4, rtol=1e-4)
    assert ref.states.tensors.keys() == cache.states.tensors.keys() and ref.states.tensors
    for layer, tensors in ref.states.tensors.items():
        for a, b in zip(tensors, cache.states.tensors[layer]):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (layer, (a - b).abs().max())
    assert torch.allclose(ref.k, cache.k, atol=1e-4, rtol=1e-4)


def test_the_chunked_delta_rule_is_the_recurrence() -> None:
    """The parallel form (chunks of 64, padded) against the one-step recurrence on the same inputs, from a
    non-zero state, with grouped value heads."""
    torch.manual_seed(0)
    B, T, hk, hv, dk, dv = 2, 70, 2, 4, 8, 6
    q, k = torch.randn(B, T, hk, dk), torch.randn(B, T, hk, dk)
    v, g, beta = torch.randn(B, T, hv, dv), -torch.rand(B, T, hv), torch.rand(B, T, hv)
    state = torch.randn(B, hv, dk, dv)
    out, s = delta_rule.chunked(q, k, v, g, beta, state)
    outs, s2 = [], state
    for t in range(T):
        o, s2 = delta_rule.recurrent(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], s2)
        outs.append(o)
    assert torch.allclose(out, torch.cat(outs, 1), atol=1e-4) and torch.allclose(s, s2, atol=1e-4)


def test_the_chunked_ssd_scan_is_the_recurrence() -> None:
    """Mamba2's parallel scan (chunks of 8, padded) against its one-step update, from a non-zero state, 2 groups."""
    torch.manual_seed(0)
    B, T, H, P, G, N = 2, 21, 4, 6, 2, 5
    x, dt = torch.randn(B, T, H, P), torch.randn(B, T, H)
    Bm, Cm, A = torch.randn(B, T, G, N), torch.randn(B, T, G, N), -torch.rand(H) - 0.1
    D, bias, state = torch.randn(H), torch.randn(H), torch.randn(B, H, P, N)
    y, s = ssd.chunk_scan(x, dt, A, Bm, Cm, D, bias, state, 8, (0.0, float("inf")))
    ys, s2 = [], state
    for t in range(T):
        o, s2 = ssd.state_update(x[:, t], dt[:, t], A, Bm[:, t], Cm[:, t], D, bias, s2)
        ys.append(o)
    assert torch.allclose(y, torch.stack(ys, 1), atol=1e-4) and torch.allclose(s, s2, atol=1e-4)


def test_generate_greedy_and_seeded_equal_transformers(pair) -> None:
    """One row and a left-padded batch of three, greedy and seeded; the fused native step takes these models'
    plain decode steps (csrc/recurrent.cpp; tests/model/test_fused_recurrent.py holds it to the modules)."""
    _, hf, model, _ = pair
    with torch.no_grad():
        assert (fused.rows_plan(model, model.new_cache(1, 8)) is not None) == kernels.available()
    ids = torch.tensor([[1, 5, 17, 33, 9, 60, 7, 7, 21]])
    greedy = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(nexttoken.generate(model, ids, **greedy), hf.generate(ids, **greedy))
    sampled = dict(max_new_tokens=12, do_sample=True, temperature=0.9, top_k=20, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(77)
    want = hf.generate(PROMPTS, **sampled)
    assert torch.equal(nexttoken.generate(model, PROMPTS, seed=77, **sampled), want)
    padded = torch.tensor([[0, 0, 0, 1, 5, 17], [1, 40, 41, 42, 43, 44], [0, 1, 90, 3, 3, 8]])
    mask = (padded != 0).long()
    mask[:, 0] = mask[:, 0] | (padded[:, 0] == 1)
    batch = nexttoken.generate(model, padded, attention_mask=mask, **greedy)[:, padded.shape[1]:]
    for row in (0, 2):  # each padded row gives its tokens alone: the padding leaves the state at zero
        alone = padded[row : row + 1, int((mask[row] == 0).sum()):]
        assert torch.equal(batch[row], hf.generate(alone, **greedy)[0, alone.shape[1]:]), row


def test_load_folder_greedy_equals_transformers(pair) -> None:
    _, hf, _, folder = pair
    llm = nexttoken.load(folder)
    ids = [5, 17, 33, 8, 61, 2, 40, 12]
    want = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(ids):].tolist()
    assert llm.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids == want


def test_docs_list_the_hybrid_families_and_their_engine_features() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    assert features_table() in docs, "docs/models.md's hybrid table differs from nexttoken.families.features_table()"


# ---- GGUF, as llama.cpp's converter writes it ------------------------------------------------------------------


# Real-tokenizer variants for llama.cpp's converter: vocab_size covering Qwen2.5's tokenizer, a narrower model.
GGUF_VARIANTS = {
    "lfm2-conv": dict(vocab_size=151680, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                      block_ff_dim=64),
    "granite4h-mamba": dict(vocab_size=151680, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                            mamba_d_head=16),
}


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
@pytest.mark.parametrize("variant", sorted(GGUF_VARIANTS))
def test_gguf_from_llama_cpps_converter(variant: str, outtype: str, tmp_path: Path, shared_dir: Path) -> None:
    """A tiny LFM2 / Granite 4.0-H over Qwen2.5's real tokenizer, converted by llama.cpp's convert_hf_to_gguf.py: the
    per-layer KV head counts (0 for the recurrent layers), the squeezed convolutions, LFM2's final norm as
    token_embd_norm, Mamba2's A stored as -exp(A_log), Granite's MLP split in gate and up read back to the folder's
    model. An f32 file gives the folder's tokens; a Q8_0 file, loaded by default (its attention and MLP matrices kept
    in their blocks, the recurrent layers' own matrices as floats), gives its own dequantized run's."""
    import json

    from support.llama_cpp import convert, with_tokenizer

    arch, overrides = VARIANTS[variant]
    hf = build_hf_model(arch, **{**overrides, **GGUF_VARIANTS[variant]})
    hf.save_pretrained(tmp_path)
    if arch == "granitemoehybrid":  # the converter reads the released checkpoints' layer names, not transformers 5's
        raw = json.loads((tmp_path / "config.json").read_text())
        raw["layer_types"] = ["mamba" if t == "linear_attention" else "attention" for t in raw["layer_types"]]
        (tmp_path / "config.json").write_text(json.dumps(raw))
    with_tokenizer(tmp_path, shared_dir / "tokenizers" / "qwen2.5-instruct")
    path = convert(tmp_path, tmp_path / f"{variant}.gguf", outtype)
    ids = [5, 17, 33, 8, 61, 2, 40, 12]
    exact = nexttoken.load(path, dequantize=True)
    assert [k.mixer for k in exact.model.config.layers] == [k.mixer for k in load_model(tmp_path).config.layers]
    got = exact.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids
    if outtype == "f32":
        assert got == hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(ids):].tolist()
    default = nexttoken.load(path)
    assert default.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids == got
    if outtype == "q8_0" and native_blocks():
        attention = next(b.attention for b in default.model.layers if isinstance(b.attention, Attention))
        assert isinstance(attention.wqkv, GGUFLinear) and isinstance(attention.wo, GGUFLinear)
        assert any(isinstance(m, GGUFLinear) for b in default.model.layers for m in (b.mlp.w13, b.mlp.w2))
        # the recurrent mixers' in_proj / out_proj stay in their blocks too (the native step reads them as stored)
        assert all(isinstance(b.attention.wi, GGUFLinear) and isinstance(b.attention.wo, GGUFLinear)
                   for b in default.model.layers if not isinstance(b.attention, Attention))


def test_qwen3_5_gguf_from_llama_cpps_converter(tmp_path: Path, shared_dir: Path) -> None:
    """A tiny Qwen3.5 (4 value heads over 2 key heads, so the converter tiles the value heads) saved as bf16 and
    converted by llama.cpp's converter (`qwen35`, without the MTP head): its recurrent layers, the delta rule's
    sizes under ssm.*, the (1 + w) norms stored shifted (the delta rule's own norm not), A stored as -exp(A_log),
    the value heads put back in the checkpoint's order; it gives the folder's tokens, kept as stored (bf16
    matrices) and dequantized."""
    from support.llama_cpp import convert, with_tokenizer

    arch, overrides = VARIANTS["qwen3_5-delta"]
    build_hf_model(arch, **{**overrides, "vocab_size": 151680}).to(torch.bfloat16).save_pretrained(tmp_path)
    with_tokenizer(tmp_path, shared_dir / "tokenizers" / "qwen2.5-instruct")
    path = convert(tmp_path, tmp_path / "qwen35.gguf", "bf16", ("--no-mtp",))
    folder = nexttoken.load(tmp_path)
    ids = [5, 17, 33, 8, 61, 2, 40, 12]
    want = folder.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids
    packed = nexttoken.load(path)
    for llm in (packed, nexttoken.load(path, dequantize=True)):
        assert llm.model.config.layers == folder.model.config.layers
        assert llm.model.config.recurrent == folder.model.config.recurrent
        assert llm.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids == want
    # the delta rule's in_proj rows stay as stored, taken in the checkpoint's order (the untiling moves whole rows);
    # out_proj's untiling moves columns, so it is read as floats
    from nexttoken.model.quant.bf16 import BF16Linear

    mixers = [b.attention for b in packed.model.layers if not isinstance(b.attention, Attention)]
    assert mixers and all(isinstance(m.wi, BF16Linear) and not isinstance(m.wo, BF16Linear) for m in mixers)


def test_qwen3_5_chat_with_its_real_template_and_the_server(shared_dir: Path, tmp_path: Path) -> None:
    """A tiny Qwen3.5 over Qwen2.5's real tokenizer with Qwen3.5's own chat template (llama.cpp's copy, thinking
    and tool calls in it): `chat` and `nexttoken serve` (driven by the openai client) give transformers' greedy
    continuation of the rendered prompt."""
    import json

    openai = pytest.importorskip("openai")
    import transformers
    from support.llama_cpp import template
    from support.server import start_server, stop_server
    from support.tiny_models import build_chat_model

    _, overrides = VARIANTS["qwen3_5-delta"]
    folder = build_chat_model(tmp_path / "qwen3_5", shared_dir / "tokenizers" / "qwen2.5-instruct", "qwen3_5",
                              **{**overrides, "num_hidden_layers": 4})
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template("Qwen3.5-4B")}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    llm = nexttoken.load(folder)
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = llm.chat_prompt(messages)
    assert "<|im_start|>assistant" in llm.tokenizer.decode(ids)
    want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(ids):].tolist()
    assert llm.chat(messages, max_new_tokens=8, ignore_eos=True, temperature=0).token_ids == want
    proc, url = start_server(folder)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        done = client.completions.create(model=folder.name, prompt=ids, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert done.choices[0].text == llm.tokenizer.decode(want)
    finally:
        stop_server(proc)
