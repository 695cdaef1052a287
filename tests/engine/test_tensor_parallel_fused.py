"""The fused native decode step on tensor-parallel ranks (model/fused.py's part-by-part step, csrc/decode.cpp's
nt_decode_part): 2 gloo ranks on loopback, this process rank 0, the other spawned by nexttoken.

The reference is the same folder in one process: greedy tokens equal. Both ranks must really take the native
path: rank 0's calls are counted here, the worker's by a `sitecustomize` (imported by every Python at start-up)
that wraps its fused.decode_rows and writes one line per call to a file.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import nexttoken
from nexttoken.model import fused, kernels
from support.fused import MODULES_ONLY
from support.tiny_models import PROMPTS, RECURRENT, VARIANTS, declared, save_variant

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernel unavailable (no g++ or no AVX-512)")

# The tiny models the single-process fused step takes, but OLMo 2 and 3: their sharded whole-projection q/k norm
# all-reduces inside the attention, so its ranks run the modules.
RANK_MODULES_ONLY = {"olmo2-post-norm", "olmo3-sliding"}
# (gpt-oss's declaration refuses tensor parallelism by name: test_gpt_oss.py checks the refusal)
FUSED_VARIANTS = sorted(n for n in set(VARIANTS) - MODULES_ONLY - RANK_MODULES_ONLY - RECURRENT
                        if declared(n).tensor_parallel)
GREEDY = dict(max_new_tokens=16, do_sample=False)

WORKER_COUNTER = '''
import os
if os.environ.get("NT_FUSED_CALLS"):
    from nexttoken.model import fused

    real = fused.decode_rows

    def counting(*args):
        out = real(*args)
        with open(os.environ["NT_FUSED_CALLS"], "a") as f:
            f.write("native\\n" if out is not None else "refused\\n")
        return out

    fused.decode_rows = counting
'''


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """(rank 0's calls, path of the worker's call log) of fused.decode_rows; the worker is counted from start-up."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(WORKER_COUNTER)
    log = tmp_path / "worker_calls.txt"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("NT_FUSED_CALLS", str(log))
    calls: list[bool] = []
    real = fused.decode_rows

    def counting(*args):  # noqa: ANN002, ANN202
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(fused, "decode_rows", counting)
    return calls, log


def _tokens(llm, prompts, **options) -> list[list[int]]:  # noqa: ANN001
    return [c.token_ids for c in llm.generate(prompts, **options)]


def _check(path: Path, prompts, counted, quantize: str | None = None) -> None:  # noqa: ANN001
    calls, log = counted
    one = nexttoken.load(path, quantize=quantize)
    want = _tokens(one, prompts, **GREEDY)
    tp = nexttoken.load(path, quantize=quantize, tensor_parallel_size=2)
    try:
        calls.clear()
        assert _tokens(tp, prompts, **GREEDY) == want
    finally:
        tp.close()
    # every decode step of this run went native on rank 0 (16 tokens: 15 decode steps, rows batched) ...
    assert len(calls) >= 15 and all(calls)
    # ... and on the worker, which runs the same steps
    worker = log.read_text().split()
    assert len(worker) >= len(calls) and set(worker) == {"native"}


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_stories260k_ranks_take_the_native_step(shared_dir, counted, quantize) -> None:
    _check(shared_dir / "models" / "stories260k", ["Once upon a time", "Tom had a dog", "The sun"], counted, quantize)


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("name", FUSED_VARIANTS)
def test_tiny_models_ranks_take_the_native_step(name, tmp_path, counted, quantize) -> None:
    save_variant(name, tmp_path / name)
    _check(tmp_path / name, PROMPTS, counted, quantize)


def test_modules_reference_on_ranks(shared_dir, counted, monkeypatch) -> None:
    """With the fused step switched off (NEXTTOKEN_FUSED=0 reaches the worker too) the ranks run the modules:
    the same tokens, and no native call on either rank."""
    calls, log = counted
    path = shared_dir / "models" / "stories260k"
    native = _tokens(nexttoken.load(path), ["Lily saw"], **GREEDY)
    calls.clear()
    monkeypatch.setenv("NEXTTOKEN_FUSED", "0")  # read by the worker at import
    tp = nexttoken.load(path, tensor_parallel_size=2)
    try:
        with fused.disabled():
            assert _tokens(tp, ["Lily saw"], **GREEDY) == native
    finally:
        tp.close()
    assert not calls and not log.exists()


def test_row_parallel_biases_and_padded_vocab(tmp_path, counted) -> None:
    """o and down biases (added once, after the all-reduce), one KV head copied on both ranks, vocab 95 split
    48 + 47 (the second rank's head padded by a row)."""
    import torch

    from support.tiny_models import build_hf_model

    hf = build_hf_model("llama", attention_bias=True, mlp_bias=True, num_key_value_heads=1, vocab_size=95)
    with torch.no_grad():  # random-init biases are zero; make them matter
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
    hf.save_pretrained(tmp_path)
    _check(tmp_path, PROMPTS, counted)


RANK_FORWARD = '''
import json, os, sys, torch, torch.distributed as dist
from nexttoken.model import fused
from nexttoken.model.weights.shard import load_model_shard
from nexttoken.model.parallel import RankGroup
from support.fused import step_logits

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
model = load_model_shard(sys.argv[1], RankGroup(0, 1, active=True), dtype=torch.float32)
calls = []
real = fused.decode_step
def counting(*args):
    out = real(*args)
    calls.append(out is not None)
    return out
fused.decode_step = counting
fast = step_logits(model, rows=3)
with fused.disabled():
    reference = step_logits(model, rows=3)
print(json.dumps(dict(sharded=model.parallel is not None, calls=calls, diff=(fast - reference).abs().max().item(),
                      same_argmax=torch.equal(fast.argmax(-1), reference.argmax(-1)))))
'''


def test_transformer_forward_decode_step_on_a_rank(shared_dir, tmp_path) -> None:
    """Transformer.forward's plain decode step (fused.decode_step) on a sharded model takes the part-by-part native
    step too: a one-rank group in a fresh process (the model still has its row-parallel wrappers and vocab-split
    head), logits against the same rank's modules."""
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tests = str(Path(__file__).resolve().parents[1])  # tests/: support/ imports from there
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-c", RANK_FORWARD, str(shared_dir / "models" / "stories260k"), str(port)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["sharded"] and got["calls"] == [True] and got["same_argmax"]
    assert got["diff"] < 1e-4
