"""The high-level API: `nexttoken.load(path)` -> LLM, with generate / stream / chat on text or token ids."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence, Union

import torch

from .errors import MissingFileError, TokenizerError
from .generation.config import GenerationConfig
from .generation.decode import StepOutput, decode_steps
from .generation.generate import plan_generation, resolve_config
from .generation.stopping import find_stop_string
from .model import Transformer, load_model
from .tokenizer import Tokenizer
from .detokenizer import IncrementalDetokenizer

Prompt = Union[str, Sequence[int]]
Message = dict[str, Any]

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"


@dataclass
class Completion:
    text: str  # generated text, special tokens skipped, cut before a matched stop string
    token_ids: list[int]  # generated ids, including the EOS id that ended it
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop string or criterion) or "length"
    logprobs: list[float]  # log-probability of each generated token under the model's raw distribution


def default_model_path() -> Path:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise MissingFileError(
            "nexttoken has no packaged default model in this installation: pass a model folder, "
            "e.g. nexttoken.load('path/to/model') or --model DIR"
        )
    return DEFAULT_MODEL_DIR


class LLM:
    """A loaded model with its tokenizer (None for token-id-only folders) and default generation options."""

    def __init__(
        self, model: Transformer, tokenizer: Tokenizer | None, generation_config: GenerationConfig, path: Path
    ) -> None:
        self.model, self.tokenizer, self.generation_config, self.path = model, tokenizer, generation_config, path
        model.generation_config = generation_config  # low-level generate(model, ...) uses the same defaults

    # ---- prompts -----------------------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self._need_tokenizer().encode(prompt)
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise TypeError(f"a prompt is a string or a list of token ids (ints), got {type(prompt).__name__}")
        return ids

    def chat_prompt(self, messages: Sequence[Message], **template_kwargs: Any) -> list[int]:
        tok = self._need_tokenizer()
        text = tok.apply_chat_template(list(messages), add_generation_prompt=True, **template_kwargs)
        return tok.encode(text, add_special_tokens=False)  # the template already wrote BOS where it wants one

    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise TokenizerError(
                f"{self.path} has no tokenizer.json, so text prompts cannot be encoded: pass token ids instead"
            )
        return self.tokenizer

    # ---- generation --------------------------------------------------------------------------------------------
    def generate(self, prompt: Prompt | Sequence[Prompt], **options: Any) -> Completion | list[Completion]:
        """Complete one prompt (-> Completion) or a list of prompts (-> list, batched together)."""
        single = isinstance(prompt, str) or (len(prompt) > 0 and isinstance(prompt[0], int))  # type: ignore[index]
        prompts = [prompt] if single else list(prompt)  # type: ignore[list-item]
        results = self._complete([self.encode(p) for p in prompts], options)
        return results[0] if single else results

    def chat(self, messages: Sequence[Message], **options: Any) -> Completion:
        """Answer a conversation ([{"role": ..., "content": ...}, ...]) through the model's chat template."""
        return self._complete([self.chat_prompt(messages)], options)[0]

    def stream(self, prompt: Prompt, **options: Any) -> Iterator[str]:
        """Yield text deltas as they are generated; they concatenate to `generate(prompt).text`."""
        yield from self._stream(self.encode(prompt), options)

    def stream_chat(self, messages: Sequence[Message], **options: Any) -> Iterator[str]:
        yield from self._stream(self.chat_prompt(messages), options)

    # ---- internals ---------------------------------------------------------------------------------------------
    def _run(self, prompts: list[list[int]], options: dict[str, Any]) -> tuple[GenerationConfig, Any, Iterator[StepOutput]]:
        options = dict(options)
        # User hooks travel beside the options: they are objects, not configuration values.
        processors, criteria = options.pop("logits_processor", None), options.pop("stopping_criteria", None)
        cfg = resolve_config(self.model, None, options)
        pad = self._pad_id(cfg)
        width = max(len(p) for p in prompts)
        # Left padding: every row's next token lands in the same column, so one forward serves the batch.
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        plan = plan_generation(self.model, ids, mask, cfg, processors, criteria, tokenizer=self.tokenizer)
        return cfg, plan, decode_steps(self.model, plan)

    def _pad_id(self, cfg: GenerationConfig) -> int:
        for candidate in (cfg.pad_token_id, self.tokenizer and self.tokenizer.pad_token_id, *cfg.eos_ids):
            if candidate is not None:
                return int(candidate)
        return 0

    def _complete(self, prompts: list[list[int]], options: dict[str, Any]) -> list[Completion]:
        if not prompts:
            return []
        cfg, plan, steps = self._run(prompts, options)
        B = len(prompts)
        tokens: list[list[int]] = [[] for _ in range(B)]
        logprobs: list[list[float]] = [[] for _ in range(B)]
        stopped = [False] * B
        for step in steps:
            chosen = step.tokens.tolist()
            lp = torch.log_softmax(step.logits, dim=-1).gather(1, step.tokens[:, None]).squeeze(1).tolist()
            for b in range(B):
                if not stopped[b]:
                    tokens[b].append(chosen[b])
                    logprobs[b].append(lp[b])
            for b in step.finished.nonzero().flatten().tolist():
                stopped[b] = True
        return [
            Completion(
                text=self._text(tokens[b], cfg),
                token_ids=tokens[b],
                prompt_token_ids=prompts[b],
                finish_reason="stop" if stopped[b] else "length",
                logprobs=logprobs[b],
            )
            for b in range(B)
        ]

    def _text(self, ids: list[int], cfg: GenerationConfig) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = find_stop_string(text, cfg.stop_string_list)
        return text if cut is None else text[:cut]

    def _stream(self, prompt: list[int], options: dict[str, Any]) -> Iterator[str]:
        cfg, _, steps = self._run([prompt], options)
        detok = IncrementalDetokenizer(self._need_tokenizer(), skip_special_tokens=True)
        stops = cfg.stop_string_list
        text, sent = "", 0  # all text so far, and how much of it was yielded
        for step in steps:
            text += detok.push(int(step.tokens[0]))
            cut = find_stop_string(text, stops)
            if cut is not None:
                if cut > sent:
                    yield text[sent:cut]
                return
            # Hold back a tail that could still grow into a stop string, so it is never shown and then retracted.
            safe = len(text) - _stop_prefix_overlap(text, stops)
            if safe > sent:
                yield text[sent:safe]
                sent = safe
        text += detok.flush()
        cut = find_stop_string(text, stops)
        end = len(text) if cut is None else cut
        if end > sent:
            yield text[sent:end]


def _stop_prefix_overlap(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def load(
    path: str | Path | None = None, dtype: str | torch.dtype | None = None, device: str | torch.device | None = None
) -> LLM:
    """Load a Hugging Face model folder (or the packaged default model when path is None)."""
    path = Path(path) if path is not None else default_model_path()
    model = load_model(path, dtype=dtype, device=device)
    tokenizer = Tokenizer.maybe_from_dir(path)
    mc = model.config
    gen = GenerationConfig(bos_token_id=mc.bos_token_id, eos_token_id=mc.eos_token_id, pad_token_id=mc.pad_token_id)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        gen = GenerationConfig.from_file(gen_file, base=gen)
    return LLM(model, tokenizer, gen, path)
