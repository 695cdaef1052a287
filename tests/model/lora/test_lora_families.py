"""LoRA on the attention families of issue 42 (GLM-4 MoE, OLMo 3, EXAONE 4, ERNIE 4.5) against PEFT on the same
tiny random models: per-row adapters and merged, PEFT's greedy tokens, which differ from the base model's. GLM-4
MoE's adapter covers its attention (its sparse layers' MLPs are no LoRA target); ERNIE 4.5's q / k adapters are
reordered with the base's rows (RoPE over pairs, families/ernie.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import nexttoken
from support.lora import make_adapter, peft_greedy, peft_model
from support.tiny_models import save_variant

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
CASES = {
    "glm4-moe-groups": dict(r=4, lora_alpha=8, target_modules=ATTENTION),
    "olmo3-sliding": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    "exaone4-sliding-nope": dict(r=2, lora_alpha=6, target_modules=ATTENTION + ["gate_proj", "down_proj"]),
    "ernie4_5-pairs-bias": dict(r=4, lora_alpha=8, target_modules=ATTENTION + ["up_proj"]),
}
PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47]


@pytest.mark.parametrize("variant", sorted(CASES))
def test_adapters_equal_peft(variant: str, tmp_path: Path) -> None:
    base = tmp_path / "base"
    hf = save_variant(variant, base)
    adapter = make_adapter(hf, tmp_path / "adapter", seed=3, **CASES[variant])
    want = peft_greedy(peft_model(base, adapter), PROMPT, 10)
    llm = nexttoken.load(base, lora={"a": adapter})
    assert llm.generate(PROMPT, lora="a", max_new_tokens=10, min_new_tokens=10).token_ids == want
    assert llm.generate(PROMPT, max_new_tokens=10, min_new_tokens=10).token_ids != want
    merged = nexttoken.load(base, lora={"a": adapter}, merge=True)
    assert merged.generate(PROMPT, max_new_tokens=10, min_new_tokens=10).token_ids == want
