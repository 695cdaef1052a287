"""Loading a GGUF file without its map (llama.cpp's --no-mmap; issue 39, item 9): truncating the file after the
load does not crash generation, where the mapped load dies of SIGBUS at the next read of a packed matrix. Both in
subprocesses, on a copy of the real SmolLM2 GGUF."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import pytest

SCRIPT = r"""
import os, sys, torch
torch.set_num_threads(1)
from nexttoken.pretrained import load_pretrained
from nexttoken.llm import LLM
path, mmap = sys.argv[1], sys.argv[2] == "1"
loaded = load_pretrained(path, mmap=mmap)
os.truncate(path, 4096)  # the file cut short under the running process
ids = loaded.tokenizer.encode("Once upon a time")
from nexttoken.engine import EngineConfig, LLMEngine
engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(max_num_seqs=1, kv_cache_memory=64 << 20))
seq = engine.generate([ids], loaded.generation_config.updated(max_new_tokens=4, eos_token_id=None))[0]
print("generated", len(seq.output_ids))
"""


@pytest.fixture
def gguf_copy(shared_dir, tmp_path):
    src = shared_dir / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return shutil.copy(src, tmp_path / "model.gguf")


def _run(path, mmap: bool) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(path), "1" if mmap else "0"], capture_output=True,
                          text=True, timeout=600)


def test_without_the_map_a_truncated_file_does_not_crash_generation(gguf_copy) -> None:
    out = _run(gguf_copy, mmap=False)
    assert out.returncode == 0 and "generated 4" in out.stdout, out.stderr[-2000:]


def test_with_the_map_a_truncated_file_is_sigbus(gguf_copy) -> None:
    """The hazard the option exists for (documented in docs/serving.md)."""
    assert _run(gguf_copy, mmap=True).returncode == -signal.SIGBUS
