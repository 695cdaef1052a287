"""`nexttoken bench lora MODEL_DIR`: decode speed with LoRA adapters: batch 8 of the base model alone vs batch 8 over
4 adapters (2 rows each), and the base model on the PyTorch modules path (`fused.disabled()`).

Writes 4 random PEFT-format adapters (every projection, rank --rank) into a temporary folder, fills 8 engine slots
with 8 requests, and times decode steps only (every row decoding), the scenarios interleaved and repeated so that a
busy machine's noise falls on each alike; reports the median step time of each and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from .output import BenchError, progress_printer, write_report

MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
BATCH = 8
SCENARIOS = ("base x8 (native step)", "4 adapters x2 rows", "base x8 (modules path)")


def write_adapter(folder: Path, cfg, rank: int, seed: int) -> Path:  # noqa: ANN001
    """A PEFT LoRA adapter folder with random A and B on every projection of every layer."""
    import torch  # here, not at the top: `nexttoken --help` must not import torch
    from safetensors.torch import save_file

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
            tensors[key + ".lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp**0.5  # (r, in)
            tensors[key + ".lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01  # (out, r)
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [m.split(".")[1] for m in MODULES],
         "bias": "none"}))
    return folder


def decode_steps(llm, loras: list[str | None], steps: int) -> list[float]:  # noqa: ANN001
    """Seconds of each of `steps` decode steps with one request per entry of `loras` (its adapter or None)."""
    from ..engine import EngineConfig, LLMEngine
    from ..generation.config import GenerationConfig

    engine = LLMEngine(llm.model, None, EngineConfig(max_num_seqs=len(loras), max_model_len=256, chunk_size=64,
                                                     enable_prefix_caching=False), llm.generation_config)
    params = GenerationConfig(max_new_tokens=steps + 4, min_new_tokens=steps + 4, do_sample=False)
    for i, lora in enumerate(loras):
        engine.add_request([1] + [(100 + 7 * i + j) % llm.model.config.vocab_size for j in range(15)], params,
                           lora=lora)
    while any(s.num_uncached > 1 or s.num_cached == 0 for s in engine.requests.values()):
        engine.step()  # prefill (and the first tokens)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def _modules_path(llm, steps: int) -> list[float]:  # noqa: ANN001
    from ..model import fused

    with fused.disabled():
        return decode_steps(llm, [None] * BATCH, steps)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lora", help="decode step time at batch 8: the base model vs 4 LoRA adapters x 2 rows")
    p.add_argument("model", help="a Hugging Face model folder (Llama-style projections)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per scenario and repeat")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions of the scenarios")
    p.add_argument("--quantize", choices=["int8", "int4", "bf16"])
    p.add_argument("--out", default="bench-lora", help="output prefix: writes OUT.json")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch  # here, not at the top: `nexttoken --help` must not import torch

    import nexttoken

    from ..config import ModelConfig

    if min(args.rank, args.steps, args.repeats, args.threads) < 1:
        raise BenchError("--rank, --steps, --repeats and --threads must be >= 1")
    if not (Path(args.model) / "config.json").is_file():
        raise BenchError(f"{args.model}: no config.json there; `bench lora` needs a Hugging Face model folder")
    progress = progress_printer()
    torch.set_num_threads(args.threads)
    names = [f"a{i}" for i in range(4)]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ModelConfig.from_dir(Path(args.model))
        folders = {n: write_adapter(Path(tmp) / n, cfg, args.rank, i) for i, n in enumerate(names)}
        llm = nexttoken.load(args.model, quantize=args.quantize, lora=folders)
    scenarios = dict(zip(SCENARIOS, (
        lambda: decode_steps(llm, [None] * BATCH, args.steps),
        lambda: decode_steps(llm, [names[i // 2] for i in range(BATCH)], args.steps),
        lambda: _modules_path(llm, args.steps))))
    results: dict[str, list[float]] = {k: [] for k in scenarios}
    for _ in range(args.repeats):
        for name, measure in scenarios.items():
            results[name] += measure()
            progress(f"{name}: median so far {statistics.median(results[name]) * 1e3:.1f} ms")
    ms = {k: statistics.median(v) * 1e3 for k, v in results.items()}
    native, modules = ms[SCENARIOS[0]], ms[SCENARIOS[2]]
    rows = [{"scenario": k, "median_step_ms": v, "vs_native_base": v / native, "vs_modules_base": v / modules}
            for k, v in ms.items()]
    print(f"{args.model} quantize={args.quantize} rank={args.rank} threads={args.threads}: median ms per decode "
          f"step at batch {BATCH}")
    for r in rows:
        print(f"  {r['scenario']:26s} {r['median_step_ms']:8.1f} ms   {r['vs_native_base']:5.2f}x the native base   "
              f"{r['vs_modules_base']:5.2f}x the modules-path base")
    report = {"model": str(args.model), "quantize": args.quantize, "rank": args.rank, "threads": args.threads,
              "batch": BATCH, "steps": args.steps, "repeats": args.repeats, "rows": rows}
    progress(f"wrote {write_report(report, Path(args.out).with_suffix('.json'))}")
    return 0
