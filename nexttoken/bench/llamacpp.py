"""llama.cpp as a peer in `nexttoken bench --matrix`: its own `llama-bench` on GGUF files of the same weights.

Nothing here builds llama.cpp or converts checkpoints (docs/performance.md says how). Given a built `llama-bench`
(--llama-bench PATH or $NEXTTOKEN_LLAMA_BENCH) and a folder of GGUF files named `{shape}-{type}.gguf` (type f32,
bf16, q8_0, q4_0), the matrix runs each one right after its own engines of that shape, with the same prompt
length, new tokens and threads: prompt processing (pp) and token generation (tg) at batch 1, as llama-bench
measures them (wall clock: its figures are comparable only in wall-clock runs).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

GGUF_TYPES = ("f32", "bf16", "q8_0", "q4_0")


def find_llama_bench(option: str | None) -> Path | None:
    """The llama-bench binary from the option or $NEXTTOKEN_LLAMA_BENCH, or None when neither names a file."""
    path = option or os.environ.get("NEXTTOKEN_LLAMA_BENCH")
    return Path(path) if path and Path(path).is_file() else None


def parse(output: str) -> dict[str, float]:
    """llama-bench's `-o json` output -> {"prefill_tok_s": pp, "decode_tok_s": tg} (avg_ts of each test)."""
    out = {}
    for test in json.loads(output):
        if test.get("n_gen", 0) > 0 and test.get("n_prompt", 0) == 0:
            out["decode_tok_s"] = float(test["avg_ts"])
        elif test.get("n_prompt", 0) > 0 and test.get("n_gen", 0) == 0:
            out["prefill_tok_s"] = float(test["avg_ts"])
    return out


def run(binary: Path, gguf: Path, prompt_len: int, new_tokens: int, threads: int, rounds: int) -> dict[str, float]:
    """Run llama-bench on one GGUF file (pp prompt_len, tg new_tokens, `rounds` repetitions, no AMX, mmap)."""
    cmd = [str(binary), "-m", str(gguf), "-p", str(prompt_len), "-n", str(new_tokens), "-t", str(threads),
           "-r", str(rounds), "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
    return parse(done.stdout)


def peer_rows(binary: Path, gguf_dir: Path, shape: str, prompt_len: int, new_tokens: int, threads: int,
              rounds: int, progress) -> list[dict]:  # noqa: ANN001
    """One row per GGUF type found for the shape: precision, prefill ms and decode tok/s at batch 1."""
    rows = []
    for kind in GGUF_TYPES:
        gguf = gguf_dir / f"{shape}-{kind}.gguf"
        if not gguf.is_file():
            continue
        progress(f"llama.cpp {kind} ({gguf.name}) ...")
        r = run(binary, gguf, prompt_len, new_tokens, threads, rounds)
        rows.append({"engine": f"llama.cpp {kind}", "precision": f"{kind} (llama.cpp)", "batch": 1,
                     "decode_tok_s": r.get("decode_tok_s"),
                     "prefill_ms": 1e3 * prompt_len / r["prefill_tok_s"] if r.get("prefill_tok_s") else None})
    return rows
