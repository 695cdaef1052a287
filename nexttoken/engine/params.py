"""SamplingParams: everything one request asks of the engine, validated once when the request is made.

The token-choice options (temperature, top_p, penalties, logit_bias, seed, ...) are a GenerationConfig, the
project's validated option set, so a request runs exactly the processor chain `build_processors` makes for the
Python API. The fields here are the serving-side ones: length, stop conditions, what to report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import GenerationConfigError
from ..generation.config import GenerationConfig

# Options of GenerationConfig that need more than one forward per token or a non-sampling search: the engine
# (one row per request, one token per step) cannot honour them, so a request carrying them is refused.
_UNSUPPORTED = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "penalty_alpha": None,
    "guidance_scale": None,
    "num_return_sequences": 1,
    "mirostat_tau": None,
    "max_time": None,
    "return_dict_in_generate": False,
}


@dataclass(frozen=True)
class SamplingParams:
    """One request's options. `generation` carries the token-choice options; the rest are the engine's own."""

    generation: GenerationConfig = field(default_factory=GenerationConfig)
    max_tokens: int = 16  # new tokens at most (the engine also stops at its max_model_len)
    stop: tuple[str, ...] = ()  # stop strings: the text is cut before the first one found
    stop_token_ids: tuple[int, ...] = ()  # ids that end the request (kept in token_ids, not in text)
    ignore_eos: bool = False  # keep going past EOS
    min_tokens: int = 0  # EOS and stop_token_ids are banned (and stop strings ignored) before this many tokens
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's and the k most likely
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name, off in _UNSUPPORTED.items():
            if getattr(self.generation, name, off) != off:
                raise GenerationConfigError(
                    f"the serving engine does not support {name}={getattr(self.generation, name)!r}: "
                    f"leave it at {off!r} (use nexttoken.generation.generate for it)"
                )
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise GenerationConfigError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if not all(isinstance(s, str) and s for s in self.stop):
            raise GenerationConfigError(f"stop must be non-empty strings, got {self.stop!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[]", t, 0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0)

    @property
    def greedy(self) -> bool:
        return self.generation.greedy

    @property
    def stop_prefix_window(self) -> int:
        """Characters of text that could still be the start of a stop string (held back while streaming)."""
        return max((len(s) for s in self.stop), default=0)


def _check_int(name: str, value: object, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise GenerationConfigError(f"{name} must be an integer >= {lo}, got {value!r}")
