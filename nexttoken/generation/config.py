"""GenerationConfig: transformers' field names and defaults, validated once, at the edge.

Options arrive from three places, merged in this order: the model's `generation_config.json`, a
`GenerationConfig` passed by the caller, then keyword options. An unknown name or a bad value raises a
GenerationConfigError that names it and says what is allowed; nothing is silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import GenerationConfigError

# Keys transformers writes into generation_config.json that describe the file, not the generation.
_FILE_METADATA = {"transformers_version", "_from_model_config", "use_cache", "trust_remote_code"}


@dataclass(frozen=True)
class GenerationConfig:
    # Length. When neither is set, 20 new tokens (transformers' default `max_length=20` counts new tokens then).
    max_new_tokens: int | None = None
    max_length: int | None = None
    # Strategy.
    do_sample: bool = False
    seed: int | None = None
    # Processors (applied in transformers' order: repetition_penalty, user processors, then warpers if sampling).
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    # Stopping.
    eos_token_id: int | list[int] | None = None
    stop_strings: str | list[str] | None = None
    # Special tokens.
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # Outputs of the low-level generate().
    return_dict_in_generate: bool = False
    output_scores: bool = False
    output_logits: bool = False

    @classmethod
    def from_file(cls, path: str | Path, base: "GenerationConfig | None" = None) -> "GenerationConfig":
        """Read a generation_config.json over `base`; metadata keys are skipped, unknown options raise."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise GenerationConfigError(f"{path} is not valid JSON: {e}") from e
        options = {k: v for k, v in raw.items() if k not in _FILE_METADATA}
        return (base or cls()).updated(_source=str(path), **options)

    def updated(self, _source: str = "option", **options: Any) -> "GenerationConfig":
        """A copy with `options` applied, every value checked."""
        names = {f.name for f in dataclasses.fields(self)}
        for name, value in options.items():
            if name not in names:
                raise GenerationConfigError(
                    f"unknown generation option {name!r} ({_source}); known options: {', '.join(sorted(names))}"
                )
            _CHECKS[name](name, value)
        return dataclasses.replace(self, **options)

    @property
    def greedy(self) -> bool:
        # temperature 0 means greedy, as in OpenAI-style APIs (transformers would raise).
        return not self.do_sample or self.temperature == 0

    @property
    def eos_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    @property
    def stop_string_list(self) -> list[str]:
        if self.stop_strings is None:
            return []
        return [self.stop_strings] if isinstance(self.stop_strings, str) else list(self.stop_strings)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _fail(name: str, value: Any, allowed: str) -> None:
    raise GenerationConfigError(f"invalid value {value!r} for {name}: {allowed}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int_at_least(lo: int, optional: bool = True) -> Callable[[str, Any], None]:
    def check(name: str, v: Any) -> None:
        if v is None and optional:
            return
        if not _is_int(v) or v < lo:
            _fail(name, v, f"must be an integer >= {lo}" + (" or None" if optional else ""))

    return check


def _number(lo: float, hi: float, lo_open: bool = False, optional: bool = False) -> Callable[[str, Any], None]:
    def check(name: str, v: Any) -> None:
        if v is None and optional:
            return
        ok = _is_number(v) and (v > lo if lo_open else v >= lo) and v <= hi
        if not ok:
            left = "(" if lo_open else "["
            _fail(name, v, f"must be a number in {left}{lo}, {hi}]" + (" or None" if optional else ""))

    return check


def _boolean(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        _fail(name, v, "must be true or false")


def _token_ids(name: str, v: Any) -> None:
    if v is None or (_is_int(v) and v >= 0):
        return
    if isinstance(v, (list, tuple)) and v and all(_is_int(t) and t >= 0 for t in v):
        return
    _fail(name, v, "must be a token id (integer >= 0), a non-empty list of them, or None")


def _token_id(name: str, v: Any) -> None:
    if v is not None and not (_is_int(v) and v >= 0):
        _fail(name, v, "must be a token id (integer >= 0) or None")


def _stop_strings(name: str, v: Any) -> None:
    if v is None or (isinstance(v, str) and v):
        return
    if isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v):
        return
    _fail(name, v, "must be a non-empty string or a list of non-empty strings")


def _seed(name: str, v: Any) -> None:
    if v is not None and not (_is_int(v) and 0 <= v < 2**63):
        _fail(name, v, "must be an integer in [0, 2**63) or None")


_CHECKS: dict[str, Callable[[str, Any], None]] = {
    "max_new_tokens": _int_at_least(0),
    "max_length": _int_at_least(1),
    "do_sample": _boolean,
    "seed": _seed,
    "temperature": _number(0.0, math.inf),
    "top_k": _int_at_least(0),
    "top_p": _number(0.0, 1.0, lo_open=True),
    "min_p": _number(0.0, 1.0, optional=True),
    "repetition_penalty": _number(0.0, math.inf, lo_open=True),
    "eos_token_id": _token_ids,
    "stop_strings": _stop_strings,
    "bos_token_id": _token_id,
    "pad_token_id": _token_id,
    "return_dict_in_generate": _boolean,
    "output_scores": _boolean,
    "output_logits": _boolean,
}
assert set(_CHECKS) == {f.name for f in dataclasses.fields(GenerationConfig)}
