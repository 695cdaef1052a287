"""Peak memory of one engine, in a fresh process: `python -m nexttoken.bench.memprobe '<json>'` prints JSON.

Reported: load_s, from the start of loading to the first token of a one-token prompt (weights resident,
kernels ready; the interpreter's and torch's import before it not counted); process_peak_mib, the whole
process's peak resident memory (ru_maxrss: what a peer process is compared with); and the process's peak
resident memory while generating minus its resident memory before the model was loaded (after a warm-up of the math libraries), both without the pages of shared libraries: so weights (also
when they stay memory-mapped from the checkpoint, as transformers keeps them) + KV cache + runtime buffers,
without the interpreter and library code. Linux keeps a peak only for all resident memory (VmHWM, reset after
loading), which includes library code pages that become resident the first time an operation runs (~8 MiB for
a first generation); those stay resident, so the peak is VmHWM minus the resident pages of `.so` mappings
(/proc/self/smaps) at the end.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _library_kib() -> int:
    """Resident KiB of shared-library mappings (code and read-only data of *.so files)."""
    total, in_library = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header: range perms offset dev inode [path]
            path = fields[5] if len(fields) > 5 else ""
            in_library = ".so" in Path(path).name
        elif in_library and fields and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def _data_kib(field: str = "VmRSS") -> int:
    return _status_kib(field) - _library_kib()


def probe(spec: dict) -> dict:
    from .engines import make_engine, transformers_available

    torch.set_num_threads(spec["threads"])
    if spec["engine"] == "transformers" and transformers_available():
        import transformers  # noqa: F401  (imported before the baseline, like nexttoken's own modules)
    import nexttoken.generation  # noqa: F401

    # Touch the math libraries first: their code pages (MKL, oneDNN: ~50-100 MiB) become resident on first use
    # and are the same for any model, so they belong to the baseline, not to the generation.
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(1, 1, 256, 64).to(dtype)
        torch.nn.functional.scaled_dot_product_attention(a, a, a)
        a[0, 0] @ a[0, 0].T
        torch.nn.functional.linear(a[0, 0, :1], a[0, 0])
    base = _data_kib()
    start = time.perf_counter()
    engine = make_engine(spec["engine"], Path(spec["path"]), spec["dtype"])
    engine.generate(torch.tensor([[1]]), 1)  # the first token: loaded, resident, kernels ready
    load_s = time.perf_counter() - start
    vocab = spec.get("vocab") or engine.model.config.vocab_size
    ids = torch.randint(3, vocab, (spec["batch"], spec["prompt_len"]), generator=torch.Generator().manual_seed(0))
    engine.generate(ids, 2)  # warm: lazy allocations, kernel build
    load_peak = _data_kib("VmHWM")
    whole_load_peak = _status_kib("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak to the current resident size
    engine.generate(ids, spec["new_tokens"])
    peak = _data_kib("VmHWM")
    # The whole process's peak (interpreter, torch and libraries included): what ru_maxrss reports, and what
    # llama.cpp's own process peak is compared with.
    process_peak = max(whole_load_peak, _status_kib("VmHWM"))
    return {"peak_mib": (peak - base) / 1024, "load_peak_mib": (load_peak - base) / 1024, "load_s": load_s,
            "process_peak_mib": process_peak / 1024}


if __name__ == "__main__":
    print(json.dumps(probe(json.loads(sys.argv[1]))))
