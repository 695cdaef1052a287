"""The high-level API: `nexttoken.load(path)` -> LLM, with generate / stream / chat on text or token ids."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence, Union

import torch

from .errors import MissingFileError, TokenizerError
from .generation.config import GenerationConfig
from .generation.decode import StepOutput, decode_steps
from .generation.generate import left_pad, plan_generation, resolve_config
from .generation.modes import single_sequence_mode
from .generation.stopping import find_stop_string, stop_string_holdback
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
    # With top_logprobs=N: per generated token, its N most likely alternatives {id: log-prob}.
    top_logprobs: list[dict[int, float]] | None = None
    # With prompt_logprobs=True (or echo=True): log p(prompt token | the ones before); None for the first.
    prompt_logprobs: list[float | None] | None = None


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
        encoded = [self.encode(p) for p in prompts]
        results = self._complete(encoded, options) if single else self._complete_on_engine(encoded, options)
        return results[0] if single and len(results) == 1 else results  # num_return_sequences > 1: a list

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
        ids, mask = left_pad(prompts, pad)
        plan = plan_generation(self.model, ids, mask, cfg, processors, criteria, tokenizer=self.tokenizer)
        return cfg, plan, decode_steps(self.model, plan)

    def _pad_id(self, cfg: GenerationConfig) -> int:
        for candidate in (cfg.pad_token_id, self.tokenizer and self.tokenizer.pad_token_id, *cfg.eos_ids):
            if candidate is not None:
                return int(candidate)
        return 0

    def _complete_on_engine(self, prompts: list[list[int]], options: dict[str, Any]) -> list[Completion]:
        """A list of prompts runs on the continuous-batching engine (each row as it would alone); options the engine
        cannot honour (user hooks, beams, scores output, ...) keep the padded-batch decode loop."""
        from .engine.offline import plan_offline, run_offline

        if not prompts or "logits_processor" in options or "stopping_criteria" in options or "echo" in options:
            return self._complete(prompts, options)
        cfg = resolve_config(self.model, None, options)
        params = plan_offline(self.model, prompts, cfg)
        if params is None:
            return self._complete(prompts, options)
        seqs = run_offline(self.model, self.tokenizer, prompts, params)
        return [
            Completion(
                text=s.text,
                token_ids=s.output_ids,
                prompt_token_ids=s.prompt_ids,
                finish_reason="stop" if s.finish_reason == "stop" else "length",
                logprobs=s.logprobs,
            )
            for s in seqs
        ]

    def _complete(self, prompts: list[list[int]], options: dict[str, Any]) -> list[Completion]:
        if not prompts:
            return []
        options = dict(options)
        echo = bool(options.pop("echo", False))  # llama3-style: the prompt and its log-probs come back too
        if echo:
            options["prompt_logprobs"] = True
        values = {k: v for k, v in options.items() if k not in ("logits_processor", "stopping_criteria")}
        if not single_sequence_mode(resolve_config(self.model, None, values)):
            from .generation.completions import searched_completions  # beams, n samples, contrastive search

            return [self._echoed(c) if echo else c for c in searched_completions(self, prompts, options, Completion)]
        cfg, plan, steps = self._run(prompts, options)
        B = len(prompts)
        tokens: list[list[int]] = [[] for _ in range(B)]
        logprobs: list[list[float]] = [[] for _ in range(B)]
        tops: list[list[dict[int, float]]] = [[] for _ in range(B)]
        prompt_lp: torch.Tensor | None = None
        stopped = [False] * B
        for step in steps:
            chosen = step.tokens.tolist()
            logp = torch.log_softmax(step.logits, dim=-1)
            lp = logp.gather(1, step.tokens[:, None]).squeeze(1).tolist()
            top = logp.topk(cfg.top_logprobs, dim=-1) if cfg.top_logprobs else None
            if prompt_lp is None and step.state is not None:
                prompt_lp = step.state.prompt_logprobs
            for b in range(B):
                if not stopped[b]:
                    tokens[b].append(chosen[b])
                    logprobs[b].append(lp[b])
                    if top is not None:
                        tops[b].append(dict(zip(top.indices[b].tolist(), top.values[b].tolist())))
            for b in step.finished.nonzero().flatten().tolist():
                stopped[b] = True
        completions = [
            Completion(
                text=self._text(prompts[b], tokens[b], cfg),
                token_ids=tokens[b],
                prompt_token_ids=prompts[b],
                finish_reason="stop" if stopped[b] else "length",
                logprobs=logprobs[b],
                top_logprobs=tops[b] if cfg.top_logprobs else None,
                prompt_logprobs=_row_prompt_logprobs(prompt_lp, b, len(prompts[b])) if prompt_lp is not None else None,
            )
            for b in range(B)
        ]
        return [self._echoed(c) for c in completions] if echo else completions

    def _echoed(self, c: Completion) -> Completion:
        """echo=True: the prompt's text, ids and log-probs lead the completion's (NaN for the first token)."""
        prompt_text = self.tokenizer.decode(c.prompt_token_ids, skip_special_tokens=True) if self.tokenizer else ""
        head = [float("nan") if x is None else x for x in (c.prompt_logprobs or [None] * len(c.prompt_token_ids))]
        return dataclasses.replace(
            c, text=prompt_text + c.text, token_ids=c.prompt_token_ids + c.token_ids, logprobs=head + c.logprobs
        )

    def _text(self, prompt: list[int], ids: list[int], cfg: GenerationConfig) -> str:
        if self.tokenizer is None:
            return ""
        text = continuation_text(self.tokenizer, prompt, ids)
        cut = find_stop_string(text, cfg.stop_string_list)
        return text if cut is None else text[:cut]

    def _stream(self, prompt: list[int], options: dict[str, Any]) -> Iterator[str]:
        cfg, _, steps = self._run([prompt], options)
        detok = IncrementalDetokenizer(self._need_tokenizer(), skip_special_tokens=True, prompt_ids=prompt)
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
            safe = len(text) - stop_string_holdback(text, stops)
            if safe > sent:
                yield text[sent:safe]
                sent = safe
        text += detok.flush()
        cut = find_stop_string(text, stops)
        end = len(text) if cut is None else cut
        if end > sent:
            yield text[sent:end]


def continuation_text(tokenizer: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The text `ids` add after the prompt, so that prompt text + this == the decode of both.

    Decoding `ids` alone would lose a leading space: SentencePiece decoders strip the first one of a text.
    """
    head = tokenizer.decode(prompt, skip_special_tokens=True)
    full = tokenizer.decode(prompt + ids, skip_special_tokens=True)
    if full.startswith(head) and not head.endswith("\ufffd"):
        return full[len(head) :]
    return tokenizer.decode(ids, skip_special_tokens=True)  # the prompt ends inside a character


def _row_prompt_logprobs(lp: torch.Tensor, row: int, n: int) -> list[float | None]:
    """Row `row` of the left-padded (B, P) prompt log-probs, for its n real tokens (NaN -> None)."""
    values = lp[row, lp.shape[1] - n :].tolist()
    return [None if v != v else v for v in values]


def load(
    path: str | Path | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    quantize: str | None = None,
) -> LLM:
    """Load a Hugging Face model folder (or the packaged default model when path is None).

    quantize="int8": weight-only int8 (per-row scales), about half of bf16's bytes read per token.
    """
    from .model.quant import apply_quantization

    path = Path(path) if path is not None else default_model_path()
    model = apply_quantization(load_model(path, dtype=dtype, device=device), quantize)
    tokenizer = Tokenizer.maybe_from_dir(path)
    mc = model.config
    gen = GenerationConfig(bos_token_id=mc.bos_token_id, eos_token_id=mc.eos_token_id, pad_token_id=mc.pad_token_id)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        gen = GenerationConfig.from_file(gen_file, base=gen)
    return LLM(model, tokenizer, gen, path)
