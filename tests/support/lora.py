"""PEFT LoRA adapters made on tiny random models (no tests here)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_adapter(hf_model, folder: Path, seed: int, **options) -> Path:
    """A PEFT LoRA adapter on hf_model with random A and B (init_lora_weights=False: B is not zero), saved."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, **options)
    model = peft.get_peft_model(hf_model, config)
    with torch.no_grad():  # PEFT's random B is small; scale it so the adapter changes the greedy tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    model.save_pretrained(folder)
    model.unload()  # the base model's modules back as they were, for the next adapter
    return folder
PROMPTS = [[1, 5, 17, 33], [1, 40, 41, 42, 43, 44, 45, 46, 47], [1, 90, 3, 3, 8, 12], [1, 7, 7, 7, 21]]


# (variant, LoRA options): Llama with every projection, rsLoRA and a per-module alpha; Phi-3's fused checkpoint;
# Qwen2's biased q/k/v with attention-only targets and a different rank per module; Qwen3's q/k norms.
FAMILIES = {
    "llama-gqa": dict(r=4, lora_alpha=8, target_modules="all-linear", use_rslora=True,
                      alpha_pattern={"down_proj": 3}),
    "phi3-plain": dict(r=3, lora_alpha=6, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "qwen2-bias": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"],
                       rank_pattern={"v_proj": 2}),
    "qwen3-qk-norm": dict(r=2, lora_alpha=5, target_modules=["k_proj", "gate_proj", "down_proj"]),
}


def peft_model(base: Path, adapter: Path):  # noqa: ANN201
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager").eval()
    return peft.PeftModel.from_pretrained(hf, adapter).eval()


def peft_greedy(model, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def all_linear_adapter(base: Path, folder: Path, seed: int, r: int) -> Path:
    """A PEFT adapter of rank r on every linear layer of the model folder `base`, B scaled to change the text."""
    import peft
    import transformers

    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(hf, config)
    with torch.no_grad():  # PEFT's random B is small; make the adapter change the text
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(8.0)
    model.save_pretrained(folder)
    return folder
