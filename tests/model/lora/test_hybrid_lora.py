"""LoRA adapters on the hybrid families (issue 41): PEFT adapters on the attention and MLP matrices of tiny random
LFM2, Qwen3.5 and Granite 4.0-H models (their checkpoint names: LFM2's feed_forward.w1 / self_attn.out_proj,
Qwen3.5's gated q_proj, Granite's fused shared_mlp.input_linear), of the MoE hybrids (LFM2-MoE, Qwen3.5-MoE,
Qwen3-Next, Granite 4.0-H with experts: attention, and the dense layers' MLP) and of Falcon-H1 and Nemotron-H (their
own networks' names and layers; Falcon-H1's µP multipliers), read by nexttoken: greedy tokens equal to PEFT's
PeftModel.generate and first-step logits within float32 rounding; the engine gives an adapter's request and the
base's their solo tokens in one batch; an adapter on a recurrent layer's own matrices is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nexttoken
from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.errors import LoraError
from nexttoken.generation.config import GenerationConfig
from nexttoken.model import ForwardBatch
from nexttoken.model.lora import read_adapter

from support.tiny_models import save_variant
from support.lora import PROMPTS, make_adapter, peft_greedy, peft_model

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")

# variant -> PEFT options: the attention and MLP matrices only (a regex: `out_proj` is also LFM2's convolution's)
HYBRIDS = {
    "lfm2-conv": dict(r=4, lora_alpha=8, target_modules=r".*\.(self_attn\.(q_proj|k_proj|v_proj|out_proj)"
                                                            r"|feed_forward\.(w1|w2|w3))"),
    "qwen3_5-delta": dict(r=3, lora_alpha=6, target_modules=r".*\.(self_attn\.(q_proj|v_proj|o_proj)"
                                                                r"|mlp\.(gate_proj|down_proj))"),
    "granite4h-mamba": dict(r=2, lora_alpha=5, target_modules=r".*\.(self_attn\.(k_proj|o_proj)"
                                                                  r"|shared_mlp\.(input_linear|output_linear))"),
    # the MoE hybrids: the attention everywhere, the MLP of the dense layers (LFM2-MoE's first); Qwen3.5-MoE's and
    # Granite's with experts: attention only (a shared expert sits in sparse blocks their families' native step runs)
    "lfm2-moe": dict(r=4, lora_alpha=8, target_modules=r".*\.self_attn\.(q_proj|k_proj|v_proj|out_proj)"
                                                       r"|model\.layers\.0\.feed_forward\.(w1|w2|w3)"),
    "qwen3_5-moe": dict(r=3, lora_alpha=6, target_modules=r".*\.self_attn\.(q_proj|k_proj|v_proj|o_proj)"),
    # (Qwen3-Next: PEFT under transformers 5 turns gate_proj / up_proj / down_proj targets into the stacked experts'
    # parameters, and leaves the dense first layer's MLP alone: an adapter on it cannot be made with PEFT)
    # (and its shared_expert.down_proj alone: PEFT adapts the experts' down_proj parameters with it)
    "qwen3_next": dict(r=3, lora_alpha=6, target_modules=r".*\.self_attn\.(q_proj|v_proj|o_proj)"),
    "granite4h-moe": dict(r=2, lora_alpha=5, target_modules=r".*\.self_attn\.(q_proj|k_proj|v_proj|o_proj)"),
    # the networks of their own: Falcon-H1's attention and MLP beside its Mamba2 mixer (µP multipliers on k, the
    # MLP's gate and down), Nemotron-H's attention layer and squared-ReLU MLP layers (PEFT's model.layers.{i}.mixer.*,
    # the checkpoint's backbone.layers.{i}.mixer.*)
    "falcon_h1": dict(r=2, lora_alpha=6, target_modules=r".*\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)"
                                                        r"|feed_forward\.(gate_proj|up_proj|down_proj))"),
    "nemotron_h": dict(r=2, lora_alpha=6, target_modules=r"model\.layers\.2\.mixer\.(q_proj|k_proj|v_proj|o_proj)"
                                                         r"|model\.layers\.[13]\.mixer\.(up_proj|down_proj)"),
}


# PEFT refuses out_proj and conv1d on Mamba-based models (all-linear would target them): the mixer's in_proj
MAMBA_MIXER = {"falcon_h1": r".*\.mamba\.in_proj", "nemotron_h": r".*\.mixer\.in_proj"}


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid(request, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """(variant, base folder, adapter folder, the HF model)."""
    root = tmp_path_factory.mktemp("hybrid-lora")
    base = root / request.param
    hf = save_variant(request.param, base)
    return request.param, base, make_adapter(hf, root / "adapter", seed=1, **HYBRIDS[request.param]), hf


def test_greedy_tokens_and_logits_match_peft(hybrid) -> None:
    variant, base, adapter, _ = hybrid
    ref = peft_model(base, adapter)
    llm = nexttoken.load(base, lora={"a": adapter})
    changed = False
    for prompt in PROMPTS[:3]:
        want = peft_greedy(ref, prompt, 8)
        assert llm.generate(prompt, lora="a", max_new_tokens=8, min_new_tokens=8).token_ids == want, (variant, prompt)
        changed |= llm.generate(prompt, max_new_tokens=8, min_new_tokens=8).token_ids != want
    assert changed, "the adapter should change the base model's tokens"
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        want = ref(ids).logits[0, -1]
        T = ids.shape[1]
        cols = torch.arange(T)[None]
        batch = ForwardBatch.build(cols, cols, torch.ones(1, T, dtype=torch.bool), T, None, write_start=0)
        batch.lora = torch.tensor([0])
        got = llm.model(ids, batch, llm.model.new_cache(1, T))[0].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the engine: the adapter's request and the base's in one batch (prefix cache on) give their solo tokens
    engine = LLMEngine(llm.model, None, EngineConfig(max_num_seqs=4, chunk_size=4), llm.generation_config)
    params = GenerationConfig(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    seqs = [engine.add_request(PROMPTS[1], params, lora=name) for name in ("a", None, "a")]
    while engine.has_unfinished():
        engine.step()
    assert [s.output_ids for s in seqs] == [peft_greedy(ref, PROMPTS[1], 8),
                                            llm.generate(PROMPTS[1], max_new_tokens=8, min_new_tokens=8).token_ids,
                                            peft_greedy(ref, PROMPTS[1], 8)]


def test_an_adapter_on_experts_is_refused(tmp_path: Path) -> None:
    """PEFT's adapter on a sparse MLP (here Qwen3-Next's: PEFT adapts its stacked experts' parameters) is refused by
    name: LoRA applies to the attention and the dense MLPs."""
    hf = save_variant("qwen3_next", tmp_path / "base")
    folder = make_adapter(hf, tmp_path / "experts", seed=3, r=2, lora_alpha=4, target_modules=r".*\.mlp\.down_proj")
    with pytest.raises(LoraError, match="mixture of experts"):
        read_adapter("experts", folder, nexttoken.load(tmp_path / "base").model.config)


def test_an_adapter_on_a_recurrent_layer_is_refused(hybrid, tmp_path: Path) -> None:
    variant, base, _, hf = hybrid
    targets = MAMBA_MIXER.get(variant, "all-linear")
    folder = make_adapter(hf, tmp_path / "all", seed=2, r=2, lora_alpha=4, target_modules=targets)
    cfg = nexttoken.load(base).model.config
    with pytest.raises(LoraError, match="does not apply LoRA to|is a .* layer"):
        read_adapter("all", folder, cfg)
