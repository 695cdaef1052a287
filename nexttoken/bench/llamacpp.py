"""llama.cpp as a peer in `nexttoken bench --matrix`: its own `llama-bench` on GGUF files of the same weights.

Nothing here builds llama.cpp or converts checkpoints (docs/performance.md says how). Given a built `llama-bench`
(--llama-bench PATH or $NEXTTOKEN_LLAMA_BENCH) and a folder of GGUF files named `{shape}-{type}.gguf` (type f32,
bf16, q8_0, q4_0), the matrix runs each one once after every round of its own engines of that shape (Peer), with
the same prompt length, new tokens and threads: prompt processing (pp) and token generation (tg) at batch 1, as
llama-bench measures them (wall clock: its figures are comparable only in wall-clock runs). Batch sizes above 1 come from
`llama-batched-bench` beside llama-bench (the same build's tool for B parallel sequences decoding together): its
token-generation rate with -npl B, each sequence with its own prompt, as the matrix's batch-B rows have.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .output import median

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


def parse_batched(output: str) -> dict[int, float]:
    """llama-batched-bench's `--output-format jsonl` lines -> {parallel sequences: token-generation tok/s}."""
    out = {}
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            test = json.loads(line)
            out[int(test["pl"])] = float(test["speed_tg"])
    return out


def batched_bench_beside(binary: Path) -> Path | None:
    """The llama-batched-bench built beside llama-bench, or None."""
    path = binary.parent / "llama-batched-bench"
    return path if path.is_file() else None


def run_batched(binary: Path, gguf: Path, prompt_len: int, new_tokens: int, threads: int, batch: int) -> float:
    """llama-batched-bench's decode tok/s for `batch` sequences, each with its own prompt of prompt_len tokens (not
    shared), generated together (-npl batch): one run."""
    ctx = batch * (prompt_len + new_tokens) + 16
    cmd = [str(binary), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt_len),
           "-ntg", str(new_tokens), "-npl", str(batch), "-t", str(threads), "--output-format", "jsonl"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
    return parse_batched(done.stdout + done.stderr)[batch]


class Peer:
    """llama.cpp on one shape's GGUF files, measured a round at a time so that its rounds interleave with the
    engines' (runner.run's between_rounds): on a shared machine, load that comes and goes then skews both sides
    alike instead of whichever ran during it."""

    def __init__(self, binary: Path, gguf_dir: Path, shape: str, prompt_len: int, new_tokens: int, threads: int,
                 batch_sizes: list[int], progress) -> None:  # noqa: ANN001
        self.binary, self.batched = binary, batched_bench_beside(binary)
        self.ggufs = {k: gguf_dir / f"{shape}-{k}.gguf" for k in GGUF_TYPES if (gguf_dir / f"{shape}-{k}.gguf").is_file()}
        self.prompt_len, self.new_tokens, self.threads, self.progress = prompt_len, new_tokens, threads, progress
        self.batch_sizes = [b for b in batch_sizes if b == 1 or self.batched is not None]
        self.prefill: dict[str, list[float]] = {k: [] for k in self.ggufs}  # tok/s per round
        self.decode: dict[tuple[str, int], list[float]] = {(k, b): [] for k in self.ggufs for b in self.batch_sizes}

    def measure_round(self, r: int) -> None:
        for kind, gguf in self.ggufs.items():
            for b in self.batch_sizes:
                if b == 1:
                    got = run(self.binary, gguf, self.prompt_len, self.new_tokens, self.threads, 1)
                    if "prefill_tok_s" in got:
                        self.prefill[kind].append(got["prefill_tok_s"])
                    rate = got.get("decode_tok_s")
                else:
                    rate = run_batched(self.batched, gguf, self.prompt_len, self.new_tokens, self.threads, b)
                if rate is not None:
                    self.decode[(kind, b)].append(rate)
                self.progress(f"round {r + 1} batch {b} llama.cpp {kind}: decode {rate or 0:.1f} tok/s")

    def rows(self) -> list[dict]:
        """Per GGUF type: a batch-1 row (prefill ms, decode tok/s: llama-bench) and a row per larger batch
        (decode tok/s: llama-batched-bench), medians of the rounds."""
        rows = []
        for kind in self.ggufs:
            pre = median(self.prefill[kind])
            for b in self.batch_sizes:
                rows.append({"engine": f"llama.cpp {kind}", "precision": f"{kind} (llama.cpp)", "batch": b,
                             "decode_tok_s": median(self.decode[(kind, b)]),
                             "prefill_ms": 1e3 * self.prompt_len / pre if b == 1 and pre else None})
        return rows


@dataclass
class ChildRun:
    """A finished llama.cpp process: its output and its own peak resident memory (the kernel's rusage of it)."""

    stdout: str
    stderr: str
    peak_rss_mib: float


# Runs argv[2:] as a grandchild and writes its ru_maxrss (KiB) to the file argv[1]. Why a launcher: Linux keeps
# a process's peak RSS across exec, so a child spawned straight from this process (which holds a model) would
# report this process's peak as its own; a grandchild forked from a bare interpreter (~10 MiB) starts clean.
_LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


def run_child(cmd: list[str], timeout: float = 1800) -> ChildRun:
    """Run `cmd` to the end; its own peak RSS from wait4's rusage (ru_maxrss), read by a bare launcher process."""
    with tempfile.TemporaryDirectory() as tmp:
        rss = Path(tmp) / "maxrss"
        done = subprocess.run([sys.executable, "-I", "-S", "-c", _LAUNCHER, str(rss), *cmd], capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
        return ChildRun(done.stdout, done.stderr, int(rss.read_text()) / 1024)


def parse_tests(output: str) -> list[dict]:
    """llama-bench's `-o json` tests, each as {n_prompt, n_gen, n_depth, avg_ts, model_type, model_size}."""
    keys = ("n_prompt", "n_gen", "n_depth", "avg_ts", "model_type", "model_size")
    return [{k: t.get(k) for k in keys} for t in json.loads(output)]


class FilePeer:
    """llama.cpp on one GGUF file, a round at a time (the model matrix interleaves its rounds with nexttoken's):
    llama-bench's pp{prefill_len} (prefill) and tg{new_tokens} at depth {decode_prompt} (batch-1 decode after a
    prompt, as nexttoken's decode rows are measured), and llama-batched-bench's decode of each larger batch, every
    sequence with its own prompt of decode_prompt tokens. Peak RSS: the llama-bench runs' (batch 1). Load time:
    the wall time of a llama-bench process that loads the file and computes one token of a one-token prompt, no
    warm-up: the time until the weights are resident and a token is out (llama.cpp maps the file and faults its
    pages in during that first token)."""

    def __init__(self, bench: Path, gguf: Path, prefill_len: int, decode_prompt: int, new_tokens: int, threads: int,
                 batch_sizes: list[int]) -> None:
        self.bench, self.batched, self.gguf = bench, batched_bench_beside(bench), gguf
        self.prefill_len, self.decode_prompt, self.new_tokens, self.threads = prefill_len, decode_prompt, new_tokens, threads
        self.batch_sizes = [b for b in batch_sizes if b == 1 or self.batched is not None]
        self.prefill: list[float] = []
        self.decode: dict[int, list[float]] = {b: [] for b in self.batch_sizes}
        self.load_ms: list[float] = []
        self.peak_rss_mib: list[float] = []
        self.model_type: str | None = None

    def _bench(self, prompt: int, gen: int, depth: int) -> dict:
        run = run_child([str(self.bench), "-m", str(self.gguf), "-p", str(prompt), "-n", str(gen), "-d", str(depth),
                         "-t", str(self.threads), "-r", "1", "-o", "json"])
        self.peak_rss_mib.append(run.peak_rss_mib)
        (test,) = parse_tests(run.stdout)
        self.model_type = test["model_type"]
        return test

    def measure_round(self) -> dict:
        """One round of every figure; returns this round's {"prefill_tok_s", "decode_tok_s": {batch: rate}}."""
        start = time.perf_counter()
        run_child([str(self.bench), "-m", str(self.gguf), "-p", "1", "-n", "0", "-r", "1", "--no-warmup", "-t",
                   str(self.threads), "-o", "json"])
        self.load_ms.append(1e3 * (time.perf_counter() - start))
        self.prefill.append(self._bench(self.prefill_len, 0, 0)["avg_ts"])
        got = {"prefill_tok_s": self.prefill[-1], "decode_tok_s": {}}
        for b in self.batch_sizes:
            if b == 1:
                rate = self._bench(0, self.new_tokens, self.decode_prompt)["avg_ts"]
            else:
                ctx = b * (self.decode_prompt + self.new_tokens) + 16
                run = run_child([str(self.batched), "-m", str(self.gguf), "-c", str(ctx), "-b", "2048", "-ub", "512",
                                 "-npp", str(self.decode_prompt), "-ntg", str(self.new_tokens), "-npl", str(b), "-t",
                                 str(self.threads), "--output-format", "jsonl"])
                rate = parse_batched(run.stdout + run.stderr)[b]
            self.decode[b].append(rate)
            got["decode_tok_s"][b] = rate
        return got

    def result(self) -> dict:
        """Medians over the rounds (peak RSS: the largest)."""
        return {"gguf": str(self.gguf), "model_type": self.model_type, "prefill_tok_s": median(self.prefill),
                "decode_tok_s": {b: median(v) for b, v in self.decode.items()},
                "load_s": median(self.load_ms) / 1e3 if self.load_ms else None,
                "peak_rss_mib": max(self.peak_rss_mib, default=None),
                "rounds": {"prefill_tok_s": self.prefill, "decode_tok_s": self.decode, "load_s": [
                    ms / 1e3 for ms in self.load_ms]}}
