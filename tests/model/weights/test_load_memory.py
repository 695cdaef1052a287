"""Loading reads every weight straight into place: the peak resident memory of a load, in a fresh process, is the
file's size plus a small bound, for SmolLM2-135M stored float32 and bf16 (no transient second copy; before the
reader it was 2x the float32 file and 3x the bf16 one, widened)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BOUND_MIB = 32  # measured: +5 MiB over the file for both (the norms widened, the arena's alignment, allocator)

PROBE = """
import json, sys, torch
from pathlib import Path
import nexttoken.generation
from nexttoken.model import load_model

def kib(field):
    return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field))

torch.randn(64, 64) @ torch.randn(64, 64)
base = kib("VmRSS:")
Path("/proc/self/clear_refs").write_text("5")  # the high-water mark (VmHWM, ru_maxrss) reset to now
model = load_model(sys.argv[1])
print(json.dumps({"peak_mib": (kib("VmHWM:") - base) / 1024, "quantization": getattr(model, "quantization", None)}))
"""


@pytest.fixture(scope="module")
def smollm2_bf16_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SmolLM2 folder saved by transformers in bfloat16 (cached beside the float32 one)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = smollm2_dir.parent / "smollm2-135m-instruct-bf16"
    if not (out / "model.safetensors").is_file():
        AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).save_pretrained(out)
    return out


def load_peak(folder: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, str(folder)], capture_output=True, text=True, timeout=300,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak-RSS reset")
@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_load_peak_is_the_file_size(stored: str, smollm2_dir: Path, smollm2_bf16_dir: Path) -> None:
    folder = smollm2_dir if stored == "float32" else smollm2_bf16_dir
    file_mib = (folder / "model.safetensors").stat().st_size / 2**20
    got = load_peak(folder)
    assert got["quantization"] == (None if stored == "float32" else "bf16")
    assert got["peak_mib"] <= file_mib + BOUND_MIB, (got, file_mib)
