"""`nexttoken bench`: nexttoken vs transformers' generate on the same weights, against this machine's limits; and
its subcommands, a module each: `load` (a running server under concurrent clients, load.py), `decode` (the fused
native step vs the PyTorch modules on family shapes, decode.py), `gguf` (GGUF files beside llama.cpp, gguf.py),
`lora` (decode steps with adapters, lora.py), `tp-memory` (a tensor-parallel model's memory per rank,
tp_memory.py)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .output import BenchError, progress_printer, write_report
from .shapes import SHAPES, random_checkpoint

__all__ = ["BenchError", "add_parser", "cmd_bench"]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,8, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return values


def add_parser(sub) -> None:  # noqa: ANN001
    p = sub.add_parser("bench", help="speed vs transformers on random-weight models (or --model), JSON + plot")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--shape", choices=list(SHAPES),
                     help="random-weight Llama: tiny 15M (the default), small 110M, 1b (Llama-3.2-1B, bf16); micro for "
                          "smoke tests")
    src.add_argument("--model", action="append",
                     help="a Hugging Face model folder, .gguf file or Hub id (org/name, org/name:Q4_K_M) instead of a "
                          "random shape (the speed table needs a folder or Hub id). With --matrix: repeat it for each "
                          "model; FOLDER::FILE.gguf runs llama.cpp on that GGUF of the folder's weights (a .gguf model "
                          "is compared with itself)")
    p.add_argument("--revision", help="the Hub revision of --model (a branch, tag or commit)")
    p.add_argument("--gguf-file", metavar="FILE", help="the GGUF file of the Hub repository --model")
    p.add_argument("--download-dir", metavar="DIR", help="the Hugging Face cache folder for Hub ids")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the shape's (1b: bfloat16, else float32)")
    p.add_argument("--prompt-len", type=int, default=128,
                   help="prompt tokens per sequence (with --matrix --model: the prompt decode follows)")
    p.add_argument("--prefill-len", type=int, default=512, help="with --matrix --model: the prompt prefill is timed on")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens per run (>= 2 to measure decode)")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 8], help="comma-separated, e.g. 1,8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: time by this process's CPU time (use with --threads 1 on a machine shared with other "
                        "work; it ignores time the process waited for a CPU)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; medians are reported")
    p.add_argument("--quantize", default="none",
                   help="our variants, comma-separated: none, int8, int4, bf16 (bf16 weights, float32 activations)")
    p.add_argument("--no-transformers", action="store_true", help="skip transformers' generate")
    p.add_argument("--engine", action="store_true",
                   help="also the continuous-batching engine (what LLM.generate on a list and the server run): the "
                        "batch as that many concurrent requests, reported against the padded loop")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory probes (fresh processes)")
    p.add_argument("--accuracy", action="store_true",
                   help="instead of timing: --quantize's int8/int4/bf16 (default int8) vs float32 top-1 agreement and KL "
                        "on real text (needs --model "
                        "with a tokenizer, e.g. stories260k)")
    p.add_argument("--structured", action="store_true",
                   help="instead of the speed table: tokens/s under a JSON Schema vs unconstrained (the packaged "
                        "model, --model DIR, or --shape with --tokenizer DIR), and llguidance vs xgrammar on the "
                        "schema corpus")
    p.add_argument("--speculative", action="store_true",
                   help="instead of the speed table: greedy tokens/s with and without speculative decoding on an "
                        "input-grounded prompt, acceptance, and whether the output is the same (prompt lookup; "
                        "--draft DIR or --draft-noise for a draft model)")
    p.add_argument("--num-speculative-tokens", type=_int_list, default=[4],
                   help="with --speculative: tokens drafted per step, comma-separated (default 4)")
    p.add_argument("--draft", help="with --speculative: a draft model (a folder, .gguf file or Hub id; same tokenizer)")
    p.add_argument("--draft-noise", help="with --speculative: drafts made from the target, each weight perturbed by "
                                         "this multiple of its spread, comma-separated (e.g. 0,0.5,1)")
    p.add_argument("--draft-layers", type=int, help="with --draft-noise: the draft keeps the target's first N blocks")
    p.add_argument("--target-tail-scale",
                   help="with --speculative --draft-layers N: the draft is the target's first N blocks and the target's "
                        "later blocks add to the residual stream scaled by each of these factors in turn, e.g. "
                        "0,0.1,0.3,1 (0: the target is the draft; larger: lower acceptance)")
    p.add_argument("--draft-quantize", choices=["none", "int8", "int4", "bf16"], default="none",
                   help="with --draft-noise or --target-tail-scale: the draft's weights quantized (a cheaper draft)")
    p.add_argument("--tokenizer", help="with --structured --shape: a tokenizer folder whose vocabulary fits the shape "
                                       "(e.g. a Llama 2 tokenizer for tiny and small)")
    p.add_argument("--matrix", action="store_true",
                   help="llama.cpp's table instead: every size in --shapes x every precision in --precisions, each "
                        "with transformers in the same run, figures also as shares of the measured limits")
    p.add_argument("--shapes", default="tiny,small", help="with --matrix: comma-separated shapes (tiny,small,1b)")
    p.add_argument("--precisions", default="none,bf16,int8,int4",
                   help="with --matrix: comma-separated, none (the checkpoint's dtype), bf16, int8, int4")
    p.add_argument("--llama-bench", help="with --matrix: a built llama.cpp llama-bench (or $NEXTTOKEN_LLAMA_BENCH) to run "
                                        "as a peer on --gguf-dir's files, or on each --model's GGUF file "
                                        "(llama-batched-bench beside it for larger batches)")
    p.add_argument("--gguf-dir", help="with --matrix --llama-bench: GGUF files of the shapes' weights, named "
                                      "SHAPE-TYPE.gguf, TYPE one of f32, bf16, q8_0, q4_0")
    p.add_argument("--out", default="bench", help="output prefix: writes OUT.json and OUT.png")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "nexttoken" / "bench"),
                   help="where random-weight checkpoints are written (reused across runs)")
    p.set_defaults(run=cmd_bench)
    _add_subcommands(p)


def _add_subcommands(p: argparse.ArgumentParser) -> None:
    """`nexttoken bench SUBCOMMAND ...`; without one, `nexttoken bench [flags]` is the speed table above."""
    from . import decode, gguf, load, lora, tp_memory

    sub = p.add_subparsers(dest="bench_command", metavar="{load,decode,gguf,lora,tp-memory}",
                           title="subcommands (without one: the speed table vs transformers)")
    for module in (load, decode, gguf, lora, tp_memory):
        module.add_parser(sub)


def cmd_bench(args: argparse.Namespace) -> int:
    from ..loadspec import LoadSpec
    from ..pretrained import resolve_source
    from .engines import transformers_available
    from .report import plot, summarize, table
    from .runner import Workload, run

    progress = progress_printer()
    models = args.model or []
    if args.matrix and models:
        return _model_matrix(args, models, progress)
    if len(models) > 1:
        raise BenchError(f"--model is given {len(models)} times: only --matrix compares several models")
    args.model = models[0] if models else None
    if args.model:  # a Hub id or GGUF file becomes the local folder / file every part below reads
        spec = LoadSpec.of(model=args.model, revision=args.revision, download_dir=args.download_dir,
                           gguf_file=args.gguf_file, dtype=args.dtype, draft_model=args.draft)
        args.model = str(resolve_source(spec.model, spec.revision, spec.download_dir, spec.gguf_file).path)
    if args.draft:
        args.draft = str(resolve_source(args.draft, download_dir=args.download_dir).path)

    if args.accuracy:
        return _accuracy(args, progress)
    if args.structured:
        return _structured(args, progress)
    if args.speculative:
        return _speculative(args, progress)
    if args.matrix:
        return _matrix(args, progress)
    args.shape = args.shape or "tiny"
    if args.model:
        path, label = Path(args.model), Path(args.model).name
        dtype = args.dtype or "float32"
        if not (path / "config.json").is_file():
            raise BenchError(f"--model {path}: no config.json there; the speed table (which runs transformers on "
                             "the same folder) needs a Hugging Face model folder or Hub id")
    else:
        dtype = args.dtype or SHAPES[args.shape][1]
        label = args.shape
        progress(f"random-weight checkpoint for {args.shape} ({dtype}) ...")
        path = random_checkpoint(args.shape, dtype, Path(args.cache_dir) / f"{args.shape}-{dtype}")
    variants = [v.strip() for v in args.quantize.split(",") if v.strip()]
    bad = [v for v in variants if v not in ("none", "int8", "int4", "bf16")]
    if bad or not variants:
        raise BenchError(f"--quantize {args.quantize!r}: use none, int8, int4, bf16 or a comma-separated list of them")
    if args.new_tokens < 1 or args.prompt_len < 1:
        raise BenchError("--new-tokens and --prompt-len must be >= 1")
    engines = ["nexttoken" if v == "none" else f"nexttoken+{v}" for v in variants]
    if args.engine:
        engines.append("nexttoken-engine")
    if not args.no_transformers:
        if transformers_available():
            engines.append("transformers")
        else:
            progress("transformers is not installed: measuring nexttoken alone")
    workload = Workload(path, label, dtype, args.prompt_len, args.new_tokens, args.batch_sizes, engines,
                        args.rounds, args.threads, memory=not args.no_memory, clock=args.clock)
    summary = summarize(run(workload, progress), workload)
    print(table(summary))
    for r in summary["rows"]:
        if r.get("vs_padded_loop") is not None:
            print(f"engine, {r['batch']} concurrent requests: {r['decode_tok_s']:.1f} tok/s = "
                  f"{r['vs_padded_loop']:.2f}x the padded loop at batch {r['batch']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_report(summary, out.with_suffix(".json"))
    wrote_plot = plot(summary, out.with_suffix(".png"))
    progress(f"wrote {out.with_suffix('.json')}" + (f" and {out.with_suffix('.png')}" if wrote_plot else
                                                     " (no plot: matplotlib is not installed)"))
    return 0


def _structured(args: argparse.Namespace, progress) -> int:  # noqa: ANN001
    import shutil

    import torch

    from ..llm import load
    from .structured import compare_engines, throughput

    torch.set_num_threads(args.threads)
    if args.shape is None:
        path, label = args.model, Path(args.model).name if args.model else "packaged model"
    else:
        if not args.tokenizer:
            raise BenchError("--structured --shape needs --tokenizer DIR (a tokenizer.json with the shape's vocabulary)")
        dtype = args.dtype or SHAPES[args.shape][1]
        path = random_checkpoint(args.shape, dtype, Path(args.cache_dir) / f"{args.shape}-{dtype}")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (Path(args.tokenizer) / name).is_file():
                shutil.copy(Path(args.tokenizer) / name, path / name)
        label = f"{args.shape} (random weights, {Path(args.tokenizer).name} tokenizer)"
    llm = load(path)
    progress(f"structured output on {label}: throughput ...")
    report = {"model": label, "threads": args.threads, "new_tokens": args.new_tokens,
              "throughput": throughput(llm, args.batch_sizes, args.new_tokens, args.rounds, progress)}
    for b, r in report["throughput"].items():
        print(f"batch {b}: unconstrained {r['free_tok_s']:.1f} tok/s, json_schema {r['json_schema_tok_s']:.1f} "
              f"tok/s = {r['ratio']:.2f}x")
    progress("grammar engines on the schema corpus ...")
    report["engines"] = compare_engines(llm, progress)
    for name, r in report["engines"].items():
        print(f"{name}: compiled {r['compiled']}/{r['schemas']} schemas, compile median {r['compile_ms_median']:.2f} "
              f"ms (max {r['compile_ms_max']:.1f}), mask median {r['mask_us_median']:.1f} us/token "
              f"(p99 {r['mask_us_p99']:.1f})")
        for kw, verdict in r["unsupported"].items():
            print(f"  {kw}: {verdict}")
    out = write_report(report, Path(args.out).with_suffix(".json"))
    progress(f"wrote {out}")
    return 0


def _speculative(args: argparse.Namespace, progress) -> int:  # noqa: ANN001
    import torch

    from ..llm import load
    from . import speculative as spec

    torch.set_num_threads(args.threads)
    if args.shape is None:
        path, label, dtype = args.model, Path(args.model).name if args.model else "packaged model", args.dtype
    else:
        dtype = args.dtype or SHAPES[args.shape][1]
        path = random_checkpoint(args.shape, dtype, Path(args.cache_dir) / f"{args.shape}-{dtype}")
        label = f"{args.shape} ({dtype}, random weights)"
    target_quantize = args.quantize if args.quantize in ("int8", "int4", "bf16") else None  # one value: the target's
    llm = load(path, dtype=dtype, quantize=target_quantize)
    label += f", {target_quantize}" if target_quantize else ""
    if args.target_tail_scale:
        return _speculative_tail(args, llm, path, dtype, label, progress)
    variants: dict[str, dict] = {}
    for k in args.num_speculative_tokens:
        if args.draft:
            variants[f"draft {Path(args.draft).name}, k={k}"] = dict(
                assistant_model=load(args.draft, dtype=dtype), num_assistant_tokens=k)
        elif args.draft_noise:
            for noise in (float(v) for v in args.draft_noise.split(",")):
                layers = f"{args.draft_layers} blocks, " if args.draft_layers else ""
                progress(f"draft from the target: {layers}noise {noise} ...")
                draft = spec.draft_from_target(Path(llm.path), dtype, args.draft_layers, noise,
                                               quantize=args.draft_quantize)
                variants[f"draft ({layers}noise {noise}), k={k}"] = dict(assistant_model=draft, num_assistant_tokens=k)
        else:
            variants[f"prompt lookup, k={k}"] = dict(prompt_lookup_num_tokens=k)
    prompt = spec.grounded_prompt(llm, args.prompt_len, args.new_tokens)
    progress(f"speculative decoding on {label}: prompt {len(prompt)} tokens, {args.new_tokens} new ...")
    rows = []
    for batch in args.batch_sizes:
        rows += spec.measure(llm, prompt, batch, args.new_tokens, args.rounds, variants, progress,
                                clock=time.process_time if args.clock == "cpu" else time.perf_counter)
    return _speculative_report(args, label, prompt, rows, progress)


def _speculative_tail(args: argparse.Namespace, llm, path, dtype, label: str, progress) -> int:  # noqa: ANN001
    """The speedup-versus-acceptance curve: a draft made of the target's first --draft-layers blocks, the target's
    later blocks scaled by each --target-tail-scale factor (bench/speculative.py, TailScale)."""
    from . import speculative as spec

    try:
        scales = [float(v) for v in args.target_tail_scale.split(",") if v.strip()]
    except ValueError:
        raise BenchError(f"--target-tail-scale {args.target_tail_scale!r}: use comma-separated numbers like 0,0.3,1") from None
    if not scales or args.draft_layers is None:
        raise BenchError("--target-tail-scale needs factors (e.g. 0,0.3,1) and --draft-layers N (the draft's blocks)")
    try:
        tail = spec.TailScale(llm.model, args.draft_layers)
    except ValueError as e:
        raise BenchError(str(e)) from None
    quant = "" if args.draft_quantize == "none" else f", {args.draft_quantize}"
    progress(f"draft: the target's first {args.draft_layers} blocks{quant} ...")
    draft = spec.draft_from_target(Path(llm.path), dtype, args.draft_layers, 0.0, quantize=args.draft_quantize)
    prompt = spec.grounded_prompt(llm, args.prompt_len, args.new_tokens)
    progress(f"speculative decoding on {label}: prompt {len(prompt)} tokens, {args.new_tokens} new ...")
    rows = []
    for eps in scales:
        tail.set(eps)
        variants = {f"draft ({args.draft_layers} blocks{quant}), tail x{eps:g}, k={k}":
                    dict(assistant_model=draft, num_assistant_tokens=k) for k in args.num_speculative_tokens}
        for batch in args.batch_sizes:
            got = spec.measure(llm, prompt, batch, args.new_tokens, args.rounds, variants, progress,
                                clock=time.process_time if args.clock == "cpu" else time.perf_counter)
            for row in got:
                row["tail_scale"] = eps
                if row["variant"] == "plain":
                    row["variant"] = f"plain, tail x{eps:g}"
            rows += got
    tail.set(1.0)
    return _speculative_report(args, label, prompt, rows, progress, draft_layers=args.draft_layers,
                               draft_quantize=args.draft_quantize)


def _speculative_report(args: argparse.Namespace, label: str, prompt: list[int], rows: list[dict], progress,  # noqa: ANN001
                        **extra) -> int:
    """The speculative bench's table on stdout and its JSON at --out."""
    from . import speculative as spec

    print(f"{label}, greedy, {args.new_tokens} new tokens, {args.threads} threads, best of {args.rounds} rounds, "
          f"{args.clock} clock:")
    print(spec.table(rows))
    report = {"model": label, "threads": args.threads, "new_tokens": args.new_tokens, "prompt_tokens": len(prompt),
              **extra, "rows": rows}
    out = write_report(report, Path(args.out).with_suffix(".json"))
    progress(f"wrote {out}")
    return 0


def _matrix(args: argparse.Namespace, progress) -> int:  # noqa: ANN001
    from .engines import transformers_available
    from .matrix import PRECISIONS, matrix_table, plot_matrix, run_matrix

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if not shapes or any(s not in SHAPES for s in shapes):
        raise BenchError(f"--shapes {args.shapes!r}: use a comma-separated list of {', '.join(SHAPES)}")
    if not precisions or any(p not in PRECISIONS for p in precisions):
        raise BenchError(f"--precisions {args.precisions!r}: use a comma-separated list of {', '.join(PRECISIONS)}")
    with_transformers = not args.no_transformers and transformers_available()
    base = dict(prompt_len=args.prompt_len, new_tokens=args.new_tokens, batch_sizes=args.batch_sizes,
                rounds=args.rounds, threads=args.threads, memory=False, clock=args.clock)
    from .llamacpp import find_llama_bench

    llama_bench = find_llama_bench(args.llama_bench)
    if (args.llama_bench or args.gguf_dir) and (llama_bench is None or not args.gguf_dir):
        raise BenchError("llama.cpp as a peer needs both --llama-bench PATH (an existing llama-bench binary) and "
                         "--gguf-dir DIR")
    if llama_bench is None or not args.gguf_dir:
        llama_bench = None
        progress("llama.cpp not run: no --llama-bench PATH (or NEXTTOKEN_LLAMA_BENCH) with --gguf-dir DIR")
    report = run_matrix(shapes, precisions, base, Path(args.cache_dir), with_transformers, progress, llama_bench,
                        Path(args.gguf_dir) if args.gguf_dir else None, args.dtype)
    print(matrix_table(report))
    out = write_report(report, Path(args.out).with_suffix(".json"))
    wrote_plot = plot_matrix(report, out.with_suffix(".png"))
    progress(f"wrote {out}" + (f" and {out.with_suffix('.png')}" if wrote_plot else " (no plot: no matplotlib)"))
    return 0


def _model_matrix(args: argparse.Namespace, models: list[str], progress) -> int:  # noqa: ANN001
    """Real model files beside llama.cpp on the same GGUF (model_matrix.py): table, JSON, markdown and plot."""
    from ..pretrained import resolve_source
    from .llamacpp import find_llama_bench
    from .model_matrix import (
        Options,
        model_matrix_table,
        parse_spec,
        plot_model_matrix,
        run_model_matrix,
    )

    if min(args.prefill_len, args.prompt_len) < 1 or args.new_tokens < 2:
        raise BenchError("--prefill-len and --prompt-len must be >= 1 and --new-tokens >= 2 (decode is timed between "
                         "tokens)")
    try:
        specs = [parse_spec(m, lambda text: resolve_source(text, args.revision, args.download_dir).path)
                 for m in models]
    except ValueError as e:
        raise BenchError(str(e)) from None
    llama_bench = find_llama_bench(args.llama_bench)
    if args.llama_bench and llama_bench is None:
        raise BenchError(f"--llama-bench {args.llama_bench}: no such file; pass a built llama.cpp llama-bench")
    if llama_bench is None:
        progress("llama.cpp not run: no --llama-bench PATH (or NEXTTOKEN_LLAMA_BENCH)")
    opts = Options(args.prefill_len, args.prompt_len, args.new_tokens, args.batch_sizes, args.rounds, args.threads,
                   llama_bench)
    report = run_model_matrix(specs, opts, progress)
    text = model_matrix_table(report)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_report(report, out.with_suffix(".json"))
    out.with_suffix(".md").write_text(text + "\n")
    wrote_plot = plot_model_matrix(report, out.with_suffix(".png"))
    progress(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')}" +
             (f" and {out.with_suffix('.png')}" if wrote_plot else " (no plot: no matplotlib)"))
    return 0


def _accuracy(args: argparse.Namespace, progress) -> int:  # noqa: ANN001
    from .accuracy import quantized_accuracy

    if not args.model:
        raise BenchError("--accuracy needs --model DIR with a tokenizer (e.g. shared/models/stories260k)")
    if str(args.model).endswith(".gguf"):  # the file's packed blocks (8-bit activations) vs its dequantized run
        from .accuracy import gguf_accuracy

        progress(f"packed vs dequantized float32 on {args.model} ...")
        report = gguf_accuracy(args.model)
        print(f"{report['blocks']} blocks (8-bit activations) vs the dequantized float32 model on {report['tokens']} "
              f"tokens of text: top-1 agreement {100 * report['top1_agreement']:.2f}%, mean KL "
              f"{report['kl_mean']:.2e} nats")
        write_report(report, Path(args.out).with_suffix(".json"))
        return 0
    variants = [v.strip() for v in args.quantize.split(",") if v.strip() not in ("", "none")] or ["int8"]
    bad = [v for v in variants if v not in ("int8", "int4", "bf16")]
    if bad:
        raise BenchError(f"--accuracy --quantize {args.quantize!r}: use int8, int4, bf16 or a list of them")
    reports = []
    for quantize in variants:
        progress(f"{quantize} vs float32 on {args.model} ...")
        report = quantized_accuracy(args.model, quantize)
        print(f"{quantize} weight-only vs float32 on {report['tokens']} tokens of text: top-1 agreement "
              f"{100 * report['top1_agreement']:.2f}%, mean KL {report['kl_mean']:.2e} nats")
        reports.append(report)
    out = write_report(reports[0] if len(reports) == 1 else reports, Path(args.out).with_suffix(".json"))
    progress(f"wrote {out}")
    return 0
