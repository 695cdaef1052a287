"""The two engines the bench compares, behind one interface: load once, then `generate(ids, new_tokens)`."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..collector import paused


class StepClock:
    """Timestamps every generated token: as a pass-through logits processor (called once per forward pass, right
    after it: transformers' loop) or as a streamer (put() once per chosen token after the prompt: nexttoken's, whose
    loop then adds nothing per step and may run greedy steps natively in chains, as a user's plain call does)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock, self.times = clock, []
        self._prompt_seen = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(self.clock())
        return scores

    def put(self, tokens: torch.Tensor) -> None:  # the streamer protocol: the prompt first, then each step's tokens
        if self._prompt_seen:
            self.times.append(self.clock())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def _load_model(path: Path, dtype: str | None, quantize: str | None = None) -> torch.nn.Module:
    """The model as `nexttoken.load` loads it: the loading modules imported with the collector paused
    (nexttoken/__init__.py), then loading.load (which pauses it too)."""
    with paused():
        from ..loading import load
        from ..loadspec import LoadSpec

    return load(LoadSpec(model=path, dtype=dtype, quantize=quantize)).main.model


class NextTokenEngine:
    """nexttoken's padded decode loop on a model folder or a .gguf file (dtype None: the loader's default)."""

    def __init__(self, path: Path, dtype: str | None, quantize: str | None = None) -> None:
        self.name = "nexttoken" + (f"+{quantize}" if quantize not in (None, "none") else "")
        self.model = _load_model(path, dtype, quantize)

    def generate(self, ids: torch.Tensor, new_tokens: int, recorder: "StepClock | None" = None) -> torch.Tensor:
        from ..generation import generate

        return generate(self.model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                        do_sample=False, eos_token_id=None, pad_token_id=0, streamer=recorder)


class NextTokenServingEngine:
    """The continuous-batching engine (what LLM.generate on a list and the server run): the batch's rows as that
    many concurrent requests. The recorder is called after every step in which all of them decode, so decode
    tokens/s compare with the padded loop's at the same batch."""

    name = "nexttoken-engine"

    def __init__(self, path: Path, dtype: str) -> None:
        self.model = _load_model(path, dtype)

    def generate(self, ids: torch.Tensor, new_tokens: int, recorder: "StepClock | None" = None) -> list:
        from ..engine import EngineConfig, LLMEngine
        from ..generation.config import GenerationConfig

        B, P = ids.shape
        length = max(128, 1 << (P + new_tokens - 1).bit_length())
        engine = LLMEngine(self.model, None, EngineConfig(max_num_seqs=B, max_model_len=length, enable_prefix_caching=False,
                                                          max_num_batched_tokens=512))
        options = GenerationConfig(max_new_tokens=new_tokens, eos_token_id=None, top_k=None)
        seqs = [engine.add_request(row, options) for row in ids.tolist()]
        while engine.has_unfinished():
            engine.step()
            # Timed: the steps in which every request decodes (all prefilled, none finished), so each timed
            # interval produced exactly B tokens, as each step of the padded loop does.
            full = all(s.output_ids for s in seqs) and not any(s.finish_reason for s in seqs)
            if full and recorder is not None:
                recorder(None, None)  # type: ignore[arg-type]
        return [s.output_ids for s in seqs]


class TransformersEngine:
    name = "transformers"

    def __init__(self, path: Path, dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

    def generate(self, ids: torch.Tensor, new_tokens: int, recorder: "StepClock | None" = None) -> torch.Tensor:
        from transformers import LogitsProcessor, LogitsProcessorList

        class Record(LogitsProcessor):
            def __call__(self, input_ids, scores):  # noqa: ANN001, ANN204
                return recorder(input_ids, scores)

        extra = LogitsProcessorList([Record()]) if recorder else None
        with torch.inference_mode():
            return self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                       min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                                       logits_processor=extra)


def make_engine(kind: str, path: Path, dtype: str) -> NextTokenEngine | NextTokenServingEngine | TransformersEngine:
    """kind: "nexttoken", "nexttoken+int8", "nexttoken-engine" or "transformers"."""
    if kind == "transformers":
        return TransformersEngine(path, dtype)
    if kind == "nexttoken-engine":
        return NextTokenServingEngine(path, dtype)
    quantize = kind.split("+", 1)[1] if "+" in kind else None
    return NextTokenEngine(path, dtype, quantize)


def transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True
