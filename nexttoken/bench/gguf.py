"""`nexttoken bench gguf FILE.gguf ...`: batch-1 decode tokens/s, load time and peak RSS of nexttoken on GGUF files
(their blocks kept packed; `--dequantize` adds the float32 model) beside llama.cpp's `llama-bench` on the same
files, interleaved round by round (docs/performance.md).

Each nexttoken round runs in a fresh process, its peak RSS the whole process's (Python and torch included); the
llama-bench rounds too, each peak read the same way (llamacpp.run_child). llama.cpp is not built by nexttoken:
without `--llama-bench PATH` (or $NEXTTOKEN_LLAMA_BENCH) the report has nexttoken's rows alone and says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from .llamacpp import find_llama_bench, parse_tests, run_child
from .output import BenchError, progress_printer, write_report

# The fresh process of one nexttoken round: argv = [root, file, dequantize, activations, threads, new_tokens].
_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
from nexttoken.bench.gguf import child_round
child_round(sys.argv[2], sys.argv[3] == "1", sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
"""


def child_round(path: str, dequantize: bool, activations: str, threads: int, new_tokens: int) -> None:
    """In the fresh process: load the file, warm up, then the best of two greedy runs; prints one JSON line."""
    import time

    import torch

    torch.set_num_threads(threads)
    start = time.perf_counter()
    import nexttoken

    llm = nexttoken.load(path, dequantize=dequantize, gguf_activations=activations)
    load_s = time.perf_counter() - start
    ids = llm.tokenizer.encode("Once upon a time") if llm.tokenizer is not None else [1, 2, 3, 4]
    llm.generate(ids, max_new_tokens=min(8, new_tokens), do_sample=False, ignore_eos=True)  # warm-up
    best = 0.0
    for _ in range(2):
        t = time.perf_counter()
        llm.generate(ids, max_new_tokens=new_tokens, do_sample=False, ignore_eos=True)
        best = max(best, new_tokens / (time.perf_counter() - t))
    print("RESULT " + json.dumps({"decode_tok_s": best, "load_s": load_s}))


def ours(path: Path, dequantize: bool, activations: str, threads: int, new_tokens: int) -> dict:
    """One nexttoken round in a fresh process: {"decode_tok_s", "load_s", "peak_rss_mib"}."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding this nexttoken package
    done = run_child([sys.executable, "-c", _CHILD, root, str(path), "1" if dequantize else "0", activations,
                      str(threads), str(new_tokens)])
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise BenchError(f"nexttoken on {path} printed no result: {done.stderr.strip()[-400:]}")
    return {**json.loads(line[7:]), "peak_rss_mib": done.peak_rss_mib}


def llama(binary: Path, path: Path, threads: int, new_tokens: int) -> dict:
    """One llama-bench round (tg new_tokens, no prompt): {"decode_tok_s", "peak_rss_mib"}."""
    done = run_child([str(binary), "-m", str(path), "-p", "0", "-n", str(new_tokens), "-t", str(threads), "-r", "1",
                      "-o", "json"])
    (test,) = parse_tests(done.stdout)
    return {"decode_tok_s": test["avg_ts"], "peak_rss_mib": done.peak_rss_mib}


def _medians(rounds: list[dict]) -> dict:
    """Medians of each figure over the rounds (peak RSS: the largest), the rounds kept."""
    keys = rounds[0].keys()
    out = {k: (max if k == "peak_rss_mib" else statistics.median)([r[k] for r in rounds]) for k in keys}
    return {**out, "rounds": rounds}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gguf", help="GGUF files: decode tok/s, load time and peak RSS beside llama.cpp's llama-bench")
    p.add_argument("files", nargs="+", metavar="FILE.gguf")
    p.add_argument("--llama-bench", help="a built llama.cpp llama-bench (or $NEXTTOKEN_LLAMA_BENCH) to run on the same "
                                        "files; without one the report has nexttoken's rows alone")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="interleaved repetitions; medians are reported")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run (batch 1)")
    p.add_argument("--activations", choices=["float32", "int16", "int8"], default="float32",
                   help="the packed blocks' activations: float32 (exact, nexttoken's default) or llama.cpp's int8")
    p.add_argument("--dequantize", action="store_true", help="also the file dequantized to a float32 model")
    p.add_argument("--out", default="bench-gguf", help="output prefix: writes OUT.json")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    files = [Path(f) for f in args.files]
    missing = [str(f) for f in files if not f.is_file() or f.suffix != ".gguf"]
    if missing:
        raise BenchError(f"no such .gguf file: {', '.join(missing)}")
    if min(args.rounds, args.new_tokens, args.threads) < 1:
        raise BenchError("--rounds, --new-tokens and --threads must be >= 1")
    binary = find_llama_bench(args.llama_bench)
    if args.llama_bench and binary is None:
        raise BenchError(f"--llama-bench {args.llama_bench}: no such file; pass a built llama.cpp llama-bench")
    progress = progress_printer()
    note = None if binary else "llama.cpp not run: no --llama-bench PATH (or NEXTTOKEN_LLAMA_BENCH); nexttoken does " \
                               "not build llama.cpp (docs/performance.md says how)"
    if note:
        progress(note)
    rows = []
    for path in files:
        got: dict[str, list[dict]] = {"nexttoken": [], "nexttoken_dequantized": [], "llama_cpp": []}
        for r in range(args.rounds):
            got["nexttoken"].append(ours(path, False, args.activations, args.threads, args.new_tokens))
            if args.dequantize:
                got["nexttoken_dequantized"].append(ours(path, True, args.activations, args.threads, args.new_tokens))
            if binary:
                got["llama_cpp"].append(llama(binary, path, args.threads, args.new_tokens))
            figures = [f"{k} {v[-1]['decode_tok_s']:.1f} tok/s, peak RSS {v[-1]['peak_rss_mib']:.0f} MiB"
                       for k, v in got.items() if v]
            progress(f"{path.name} round {r}: " + " | ".join(figures))
        row = {"file": str(path), **{k: _medians(v) if v else None for k, v in got.items()}}
        rows.append(row)
        for k in ("nexttoken", "nexttoken_dequantized", "llama_cpp"):
            if row[k]:
                load = f", load {row[k]['load_s']:.2f} s" if "load_s" in row[k] else ""
                print(f"{path.name} {k}: {row[k]['decode_tok_s']:.1f} tok/s{load}, peak RSS "
                      f"{row[k]['peak_rss_mib']:.0f} MiB")
    report = {"threads": args.threads, "new_tokens": args.new_tokens, "activations": args.activations,
              "rounds": args.rounds, "llama_bench": str(binary) if binary else None, "llama_cpp_note": note,
              "files": rows}
    progress(f"wrote {write_report(report, Path(args.out).with_suffix('.json'))}")
    return 0
