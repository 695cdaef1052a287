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
