"""Resident memory follows the tokens the KV pool holds (issue 39, item 9): when a burst is over, the pages of the
blocks it wrote go back to the system (madvise DONTNEED), so RSS returns near the idle figure instead of staying at
the burst's peak. Measured in a fresh subprocess on the real SmolLM2 GGUF (its pool: 46 KB per token)."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, sys, torch
torch.set_num_threads(1)
import nexttoken
from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.generation.config import GenerationConfig

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

llm = nexttoken.load(sys.argv[1])
engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(max_num_seqs=8, kv_cache_memory=1 << 30,
                                                          enable_prefix_caching=sys.argv[2] == "1"))
words = "the cat dog girl boy sun ball tree ran saw big red happy park".split()
prompts = [llm.encode(" ".join(words[(i + j) % 14] for j in range(250))) for i in range(8)]
engine.generate(prompts[:1], GenerationConfig(eos_token_id=None, max_new_tokens=1, top_k=None))  # warm
idle = rss()
written = []
engine.blocks.release, release = (lambda blocks: (written.append(len(blocks)), release(blocks))), engine.blocks.release
engine.generate(prompts, GenerationConfig(eos_token_id=None, max_new_tokens=2, top_k=None))
print(json.dumps({"idle": idle, "after": rss(), "pool_bytes": engine.stats().kv_cache_bytes,
                  "released_blocks": sum(written), "tokens": sum(len(p) + 2 for p in prompts),
                  "bytes_per_block": engine.runner.cache.nbytes // engine.blocks.num_blocks,
                  "block_size": engine.blocks.block_size}))
"""


def _run(gguf, prefix_caching: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(gguf), "1" if prefix_caching else "0"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_rss_returns_near_idle_after_a_burst(shared_dir) -> None:
    gguf = shared_dir / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    m = _run(gguf, prefix_caching=False)
    written = m["tokens"] * m["bytes_per_block"] // m["block_size"]  # the burst's K/V: ~2,000 tokens, ~90 MB
    assert written > 64 << 20 and m["released_blocks"] > 0  # (blocks are reused within the burst: fewer)
    assert m["after"] - m["idle"] < written // 3, (m["after"] - m["idle"], written)  # most of it given back
