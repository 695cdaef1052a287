"""`nexttoken bench --structured`: what structured output costs, and the grammar engines compared on our workload.

1. Throughput: decode tokens/s under a JSON Schema against the same request unconstrained, through the engine (the
   path LLM.generate and the server take), batch sizes as given, rounds interleaved, medians.
2. Engines: llguidance (what nexttoken uses) and xgrammar (when installed: pip install xgrammar) on the schema
   corpus (bench/schemas.py): compile time, mask time per token along the same token sequence, how many schemas
   each compiles, and for the keywords llguidance refuses, whether the other refuses them too or compiles them and
   lets outputs through that break the schema (checked with `jsonschema` when it is installed).
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, Callable

import torch

from .schemas import SCHEMAS, UNSUPPORTED

# A schema whose output runs past any budget here (a story of at least 2000 characters in a string), so both runs
# decode exactly new_tokens tokens per request and the ratio compares the steps alone.
THROUGHPUT_SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                                      "story": {"type": "string", "minLength": 2000}},
                     "required": ["title", "story"], "additionalProperties": False}
PROMPT = "Once upon a time"


def throughput(llm: Any, batch_sizes: list[int], new_tokens: int, rounds: int, progress: Callable[[str], None]) -> dict:
    """tokens/s (generated tokens / wall time) with and without the schema, per batch size."""
    out: dict[str, Any] = {}
    for b in batch_sizes:
        prompts = [PROMPT] * b
        runs: dict[str, list[float]] = {"free": [], "json_schema": []}
        options = {"free": dict(ignore_eos=True), "json_schema": dict(json_schema=THROUGHPUT_SCHEMA)}
        llm.generate(prompts, max_new_tokens=4, do_sample=False)  # warm the engine at this size
        for r in range(rounds):
            for name, extra in options.items():
                start = time.perf_counter()
                done = llm.generate(prompts, max_new_tokens=new_tokens, do_sample=False, **extra)
                seconds = time.perf_counter() - start
                runs[name].append(sum(len(c.token_ids) for c in done) / seconds)
            progress(f"batch {b} round {r + 1}/{rounds}: free {runs['free'][-1]:.0f} tok/s, "
                     f"json_schema {runs['json_schema'][-1]:.0f} tok/s")
        free, constrained = statistics.median(runs["free"]), statistics.median(runs["json_schema"])
        out[str(b)] = {"free_tok_s": free, "json_schema_tok_s": constrained, "ratio": constrained / free}
    return out


# ---- the engines ----------------------------------------------------------------------------------------------------

class _Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int, eos: list[int]) -> None:
        from ..generation.processors.structured import GrammarCache

        self.cache, self.tok, self.vocab, self.eos = GrammarCache(), tokenizer, vocab, tuple(eos)

    def compile(self, schema: dict) -> Any:
        from ..generation.processors.structured import Constraint

        lltok = self.cache.tokenizer(self.tok, self.vocab, self.eos)
        return self.cache.compile(Constraint("json_schema", schema), lltok).template

    def matcher(self, compiled: Any) -> Any:
        return _LlgMatcher(compiled.deep_copy(), self.vocab)


class _LlgMatcher:
    def __init__(self, m: Any, vocab: int) -> None:
        self.m, self.mask = m, torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)

    def fill(self) -> torch.Tensor:
        self.m.unsafe_compute_mask_ptr(self.mask.data_ptr(), self.mask.shape[1] * 4)
        return self.mask

    def accept(self, token: int) -> bool:
        return self.m.consume_token(token)


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int, eos: list[int]) -> None:
        import transformers
        import xgrammar as xgr

        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        self.xgr, self.vocab = xgr, vocab
        self.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab,
                                                                               stop_token_ids=eos))

    def compile(self, schema: dict) -> Any:  # the same layout as ours: no free whitespace, ", " and ": "
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))

    def matcher(self, compiled: Any) -> Any:
        return _XgrMatcher(self.xgr, self.xgr.GrammarMatcher(compiled), self.vocab)


class _XgrMatcher:
    def __init__(self, xgr: Any, m: Any, vocab: int) -> None:
        self.m, self.mask = m, xgr.allocate_token_bitmask(1, vocab)

    def fill(self) -> torch.Tensor:
        self.m.fill_next_token_bitmask(self.mask)
        return self.mask

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)


def _engines(tokenizer: Any, vocab: int, eos: list[int], progress: Callable[[str], None]) -> list[Any]:
    engines: list[Any] = [_Llguidance(tokenizer, vocab, eos)]
    try:
        engines.append(_Xgrammar(tokenizer, vocab, eos))
    except ImportError as e:
        progress(f"xgrammar is not installed ({e}): pip install xgrammar to compare it")
    return engines


class _MaskedBy:
    """A logits processor applying another engine's matcher, so nexttoken.generate decodes under that engine's
    masks (to see what it lets through)."""

    def __init__(self, matcher: Any, prompt_length: int) -> None:
        self.matcher, self.prompt_length = matcher, prompt_length

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        from ..generation.processors.structured import allowed_tokens

        if ids.shape[1] > self.prompt_length:
            self.matcher.accept(int(ids[0, -1]))
        return scores.masked_fill(~allowed_tokens(self.matcher.fill(), scores.shape[1]), -torch.inf)


def _decode(llm: Any, engine: Any, compiled: Any, max_new: int) -> str:
    """Greedy text under `engine`'s masks."""
    from ..generation.generate import generate

    ids = torch.tensor([llm.encode(PROMPT)])
    out = generate(llm.model, ids, max_new_tokens=max_new, do_sample=False,
                   logits_processor=[_MaskedBy(engine.matcher(compiled), ids.shape[1])])
    return llm.tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


def compare_engines(llm: Any, progress: Callable[[str], None], max_new: int = 80) -> dict:
    tok, vocab, eos = llm.tokenizer, llm.model.config.vocab_size, llm.generation_config.eos_ids
    engines = _engines(tok, vocab, eos, progress)
    report: dict[str, Any] = {e.name: {"compile_ms": [], "mask_us": [], "compiled": 0, "failed": {},
                                       "unsupported": {}} for e in engines}
    for name, schema in SCHEMAS.items():
        # the token sequence both engines are timed along: our greedy output under the schema
        tokens = llm.generate(PROMPT, json_schema=schema, max_new_tokens=max_new, do_sample=False).token_ids
        for e in engines:
            r = report[e.name]
            start = time.perf_counter()
            try:
                compiled = e.compile(schema)
            except Exception as err:  # noqa: BLE001 - an engine's refusal is a result here
                r["failed"][name] = str(err)[:200]
                continue
            r["compile_ms"].append((time.perf_counter() - start) * 1e3)
            r["compiled"] += 1
            m = e.matcher(compiled)
            for t in tokens:
                start = time.perf_counter()
                m.fill()
                r["mask_us"].append((time.perf_counter() - start) * 1e6)
                if not m.accept(t):
                    break
        progress(f"schema {name}: done")
    for kw, schema in UNSUPPORTED.items():
        for e in engines:
            try:
                compiled = e.compile(schema)
            except Exception as err:  # noqa: BLE001
                report[e.name]["unsupported"][kw] = "refused: " + str(err).splitlines()[0][:120]
                continue
            text = _decode(llm, e, compiled, max_new)
            report[e.name]["unsupported"][kw] = "accepted silently; output " + _verdict(schema, text)
    for e in engines:
        r = report[e.name]
        r["compile_ms_median"] = statistics.median(r["compile_ms"]) if r["compile_ms"] else None
        r["compile_ms_max"] = max(r["compile_ms"]) if r["compile_ms"] else None
        r["mask_us_median"] = statistics.median(r["mask_us"]) if r["mask_us"] else None
        r["mask_us_p99"] = sorted(r["mask_us"])[int(0.99 * (len(r["mask_us"]) - 1))] if r["mask_us"] else None
        r["schemas"] = len(SCHEMAS)
        del r["compile_ms"], r["mask_us"]
    return report


def _verdict(schema: dict, text: str) -> str:
    try:
        import jsonschema
    except ImportError:
        return f"{text!r} (install jsonschema to check it)"
    try:
        jsonschema.validate(json.loads(text), schema)
        return f"{text!r} happens to validate"
    except json.JSONDecodeError:
        return f"{text!r} unfinished"
    except jsonschema.ValidationError as err:
        return f"{text!r} breaks the schema ({err.message})"
