"""Decode speed with LoRA adapters: batch 8 of the base model alone vs batch 8 over 4 adapters (2 rows each).

    python scripts/lora_decode.py MODEL_DIR [--rank 16] [--threads 2] [--steps 32] [--quantize int8]

Writes 4 random PEFT-format adapters (every projection, rank --rank) into a temporary folder, fills 8 engine
slots with 8 requests, and times decode steps only (every row decoding), the scenarios interleaved and repeated
so that a busy machine's noise falls on each alike; prints the median step time of each and the ratios. The
third scenario is the base model on the modules path (`fused.disabled()`; adapter rows take the native step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import nexttoken
from nexttoken.config import ModelConfig
from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.generation.config import GenerationConfig
from nexttoken.model import fused

MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def write_adapter(folder: Path, cfg, rank: int, seed: int) -> Path:  # noqa: ANN001
    """A PEFT LoRA adapter folder with random A and B on every projection of every layer."""
    g = torch.Generator().manual_seed(seed)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    C, I = cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (q, C), "k_proj": (kv, C), "v_proj": (kv, C), "o_proj": (C, q), "gate_proj": (I, C),
              "up_proj": (I, C), "down_proj": (C, I)}
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module in MODULES:
            out, inp = shapes[module.split(".")[1]]
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[key + ".lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp**0.5
            tensors[key + ".lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [m.split(".")[1] for m in MODULES],
         "bias": "none"}))
    return folder


def decode_steps(llm, loras: list[str | None], steps: int) -> list[float]:  # noqa: ANN001
    """Seconds of each of `steps` decode steps with one request per entry of `loras` (its adapter or None)."""
    engine = LLMEngine(llm.model, None, EngineConfig(max_num_seqs=len(loras), max_model_len=256, chunk_size=64,
                                                     enable_prefix_caching=False), llm.generation_config)
    params = GenerationConfig(max_new_tokens=steps + 4, min_new_tokens=steps + 4, do_sample=False)
    for i, lora in enumerate(loras):
        engine.add_request([1] + [100 + 7 * i + j for j in range(15)], params, lora=lora)
    while any(s.num_uncached > 1 or s.num_cached == 0 for s in engine.requests.values()):
        engine.step()  # prefill (and the first tokens)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quantize", choices=["int8", "int4", "bf16"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(4)]
        cfg = ModelConfig.from_dir(Path(args.model))
        folders = {n: write_adapter(Path(tmp) / n, cfg, args.rank, i) for i, n in enumerate(names)}
        llm = nexttoken.load(args.model, quantize=args.quantize, lora=folders)
    scenarios = {
        "base x8 (native step)": (lambda: decode_steps(llm, [None] * 8, args.steps)),
        "4 adapters x2 rows": (lambda: decode_steps(llm, [names[i // 2] for i in range(8)], args.steps)),
        "base x8 (modules path)": (lambda: _modules(llm, args.steps)),
    }
    results: dict[str, list[float]] = {k: [] for k in scenarios}
    for _ in range(args.repeats):
        for name, run in scenarios.items():
            results[name] += run()
            print(f"  ({name}: median so far {statistics.median(results[name]) * 1e3:.1f} ms)", flush=True)
    medians = {k: statistics.median(v) * 1e3 for k, v in results.items()}
    print(f"{args.model} quantize={args.quantize} rank={args.rank} threads={args.threads}: median ms per decode "
          "step at batch 8")
    first = medians["base x8 (native step)"]
    for name, ms in medians.items():
        print(f"  {name:26s} {ms:8.1f} ms   {ms / first:5.2f}x the native base   "
              f"{ms / medians['base x8 (modules path)']:5.2f}x the modules-path base")


def _modules(llm, steps: int) -> list[float]:  # noqa: ANN001
    with fused.disabled():
        return decode_steps(llm, [None] * 8, steps)


if __name__ == "__main__":
    main()
