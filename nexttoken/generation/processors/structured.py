"""Structured output: JSON Schema, JSON object, regex, choice or a Lark / GBNF grammar, enforced as a token mask.

A constraint is an option of GenerationConfig (`json_schema`, `json_object`, `regex`, `choice`, `grammar`, with
`structured_best_effort`). The grammar engine is llguidance (docs/structured_output.md has the measurements that
chose it over xgrammar): it compiles the constraint against the tokenizer once (cached by constraint, here), and
per step its matcher gives the set of tokens that keep the output inside the grammar, EOS only where the grammar
is complete. `GrammarMask` is that set as a processor: one matcher per row, fed the row's new tokens.

Loud, not silent: a schema keyword or grammar feature llguidance does not enforce fails compilation with its name
(`StructuredOutputError`), unless `structured_best_effort=True` (llguidance's "lenient" mode) asks to go on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..values import CONSTRAINTS, StructuredOutputError, Thinking, bounded_schema, check_choice, check_combination, json_schema_value  # noqa: F401 (re-exported)

# JSON's layout, by `structured_whitespace`. "compact" is json.dumps' ('{"a": 1, "b": [2, 3]}'). "flexible" is
# JSON's own whitespace where JSON allows it, as OpenAI, vLLM (xgrammar's any_whitespace) and llama.cpp accept it,
# but bounded per gap between two tokens of JSON, so a model cannot loop on blanks until max_tokens: one space, or
# one or two newlines and up to 20 spaces or tabs of indentation (llama.cpp's json-schema-to-grammar SPACE_RULE,
# `| " " | "\n"{1,2} [ \t]{0,20}`). Small models write a newline and indentation after "{" by habit (SmolLM2:
# 79% of its probability); the compact layout forces them off it (docs/structured_output.md has the figures).
JSON_LAYOUTS = {
    "compact": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    "flexible": {"whitespace_flexible": True, "item_separator": ",", "key_separator": ":",
                 "whitespace_pattern": r"(\x20|\n{1,2}[\x20\x09]{0,20})?"},
}
CACHE_SIZE = 256  # compiled grammars kept (per process), least recently used dropped first
CACHE_BYTES = 256 << 20  # and their estimated memory at most (the newest entry is always kept)
# A compiled matcher's resident memory per character of its llguidance grammar (JSON): measured 12-27 bytes on
# enum schemas of 1k-50k values (stories260k's and Qwen2.5's vocabularies); the estimate takes the high end.
BYTES_PER_GRAMMAR_CHAR = 32
ENTRY_BYTES = 64 << 10  # an entry's fixed cost (a refusal: its message and this)


# ---- options ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Constraint:
    """One request's constraint, in a canonical form: the cache key is its JSON."""

    kind: str  # one of CONSTRAINTS
    spec: Any  # dict (json_schema), str (regex, grammar), tuple of str (choice), None (json_object)
    best_effort: bool = False
    whitespace: str = "flexible"  # JSON's layout: a key of JSON_LAYOUTS
    strict: bool = True  # json_schema as clients write it (values.bounded_schema); False: literally

    @property
    def key(self) -> str:
        return json.dumps([self.kind, self.spec, self.best_effort, self.whitespace, self.strict], sort_keys=True,
                          default=list)

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) for this constraint."""
        import llguidance

        M = llguidance.LLMatcher
        layout = dict(JSON_LAYOUTS[self.whitespace], lenient=self.best_effort)
        if self.kind == "json_schema":
            return M.grammar_from_json_schema(bounded_schema(self.spec) if self.strict else self.spec,
                                              overrides=layout)
        if self.kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"}, overrides=layout)
        if self.kind == "regex":
            return M.grammar_from_regex(self.spec)
        if self.kind == "choice":  # one Lark rule with each choice a string literal (JSON escapes are Lark's)
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.spec))
        from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

        try:  # GBNF (llama.cpp's) is translated to Lark, llguidance's own syntax
            gbnf = "::=" in self.spec and not self.spec.lstrip().startswith("%llguidance")
            lark = gbnf_to_lark(self.spec) if gbnf else self.spec
        except (GbnfToLarkError, Exception) as e:  # noqa: BLE001 - the converter raises bare Exception too
            raise StructuredOutputError(f"grammar is not valid GBNF: {e}") from e
        return M.grammar_from_lark(lark)


def constraint_of(cfg: Any) -> Constraint | None:
    """The constraint a GenerationConfig sets, or None."""
    if cfg.json_schema is not None:
        return Constraint("json_schema", cfg.json_schema, cfg.structured_best_effort, cfg.structured_whitespace,
                          cfg.strict_json_schema)
    if cfg.json_object:
        return Constraint("json_object", None, cfg.structured_best_effort, cfg.structured_whitespace)
    if cfg.regex is not None:
        return Constraint("regex", cfg.regex, cfg.structured_best_effort)
    if cfg.choice is not None:
        return Constraint("choice", tuple(cfg.choice), cfg.structured_best_effort)
    if cfg.grammar is not None:
        return Constraint("grammar", cfg.grammar, cfg.structured_best_effort)
    return None


# ---- compiling, cached ---------------------------------------------------------------------------------------

@dataclass
class CompileStats:
    """What the cache has done, for /metrics: compiles (misses) with their seconds, and hits."""

    compiles: int = 0
    hits: int = 0
    seconds_total: float = 0.0
    durations: list[float] = field(default_factory=list)  # each compile's seconds, drained by whoever reports them


@dataclass(frozen=True)
class Compiled:
    template: Any  # an llguidance LLMatcher at the start state; each request deep-copies it
    ends: frozenset[int]  # the ids that end a sequence (its EOS to the grammar engine)
    seconds: float  # what compiling took (0.0 on a cache hit)
    cached: bool


@dataclass(frozen=True)
class _Entry:
    """A cache entry: a compiled matcher, or the refusal a constraint got (refused again at once), with its
    estimated bytes."""

    template: Any  # an llguidance LLMatcher, or None for a refusal
    refusal: StructuredOutputError | None
    bytes: int


class GrammarCache:
    """Compiled grammars, and refusals, by (tokenizer, constraint); least recently used dropped past `size`
    entries or `budget_bytes` of estimated memory; thread-safe (the server compiles off the event loop while the
    engine thread runs)."""

    def __init__(self, size: int = CACHE_SIZE, budget_bytes: int = CACHE_BYTES) -> None:
        self.size, self.budget_bytes = size, budget_bytes
        self._entries: OrderedDict[tuple[int, str], _Entry] = OrderedDict()
        self.bytes = 0  # the entries' estimated memory
        self._tokenizers: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self.stats = CompileStats()

    def tokenizer(self, tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> Any:
        """llguidance's view of `tokenizer` (a nexttoken Tokenizer): its tokens over the model's `vocab_size` rows,
        with the ids that end a sequence as its EOS (allowed exactly where the grammar is complete)."""
        import llguidance

        if not stop_ids:
            raise StructuredOutputError("a constrained output needs a token that ends it: the model defines no "
                                        "eos_token_id, so pass eos_token_id or stop_token_ids")
        with self._lock:
            per = self._tokenizers.setdefault(tokenizer, {})
            key = (vocab_size, stop_ids)
            if key not in per:
                per[key] = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                  eos_token=list(stop_ids))
            return per[key]

    def built_tokenizer(self, tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> Any | None:
        """`tokenizer(...)` when it was built already, else None (building one takes up to a second)."""
        with self._lock:
            return self._tokenizers.get(tokenizer, {}).get((vocab_size, stop_ids))

    def lookup(self, constraint: Constraint, lltokenizer: Any) -> Compiled | None:
        """The cached compile of `constraint` (None: not cached); a cached refusal is raised again."""
        key = (id(lltokenizer), constraint.key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
        if entry.refusal is not None:
            raise StructuredOutputError(str(entry.refusal))
        return Compiled(entry.template, frozenset(lltokenizer.eos_tokens), 0.0, True)

    def refuse(self, constraint: Constraint, lltokenizer: Any, refusal: StructuredOutputError,
               replace: bool = True) -> None:
        """Remember that `constraint` is refused. replace=False keeps an entry already there: a compile that ran
        past a caller's budget is refused until it finishes, when its own result replaces the refusal (and a
        result that came first stays)."""
        self._keep((id(lltokenizer), constraint.key), _Entry(None, refusal, ENTRY_BYTES + len(str(refusal))), replace)

    def compile(self, constraint: Constraint, lltokenizer: Any) -> Compiled:
        hit = self.lookup(constraint, lltokenizer)
        if hit is not None:
            return hit
        start = time.perf_counter()
        try:
            template, grammar = _compile(constraint, lltokenizer)
        except StructuredOutputError as e:  # refused: kept, so the same constraint is refused again at once
            self.refuse(constraint, lltokenizer, e)
            raise
        seconds = time.perf_counter() - start
        self._keep((id(lltokenizer), constraint.key),
                   _Entry(template, None, ENTRY_BYTES + BYTES_PER_GRAMMAR_CHAR * len(grammar)))
        with self._lock:
            self.stats.compiles += 1
            self.stats.seconds_total += seconds
            self.stats.durations.append(seconds)
        return Compiled(template, frozenset(lltokenizer.eos_tokens), seconds, False)

    def _keep(self, key: tuple[int, str], entry: _Entry, replace: bool = True) -> None:
        with self._lock:
            if not replace and key in self._entries:
                return
            old = self._entries.pop(key, None)
            self.bytes -= old.bytes if old is not None else 0
            self._entries[key] = entry
            self.bytes += entry.bytes
            while len(self._entries) > 1 and (len(self._entries) > self.size or self.bytes > self.budget_bytes):
                self.bytes -= self._entries.popitem(last=False)[1].bytes

    def __len__(self) -> int:
        return len(self._entries)


def _compile(constraint: Constraint, lltokenizer: Any) -> tuple[Any, str]:
    """llguidance's matcher for `constraint` at its start state, and the grammar it compiled; a constraint it
    cannot enforce raises StructuredOutputError naming why. The matcher's own error and warnings are what
    `validate_grammar_with_warnings` reports, without compiling the grammar twice."""
    import llguidance

    try:
        grammar = constraint.grammar()
    except ValueError as e:  # llguidance: the schema is not a JSON object
        raise StructuredOutputError(f"{constraint.kind}: {e}") from e
    template = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
    if template.is_error():
        raise StructuredOutputError(_explain(constraint, [template.get_error()]))
    warnings = template.get_grammar_warnings()
    if warnings and not constraint.best_effort:
        raise StructuredOutputError(_explain(constraint, warnings))
    # The trial walks the compact layout: JSON's free whitespace would let the walk spend its tokens on blanks
    # before it reaches what is past the limits (the same constraint, one space per gap at most).
    trial = template
    if constraint.whitespace != "compact" and constraint.kind in ("json_schema", "json_object"):
        trial = llguidance.LLMatcher(lltokenizer, dataclasses.replace(constraint, whitespace="compact").grammar(),
                                     log_level=0)
    _trial(constraint, trial, frozenset(lltokenizer.eos_tokens), lltokenizer.vocab_size)
    return template, grammar


TRIAL_STEPS = 8  # tokens a compiled grammar is walked before it is accepted (each: one mask, one token)


def _trial(constraint: Constraint, template: Any, ends: frozenset[int], vocab_size: int) -> None:
    """Walk a copy of the matcher TRIAL_STEPS tokens (each time the lowest-id token its mask allows that does not
    end the output) so that a grammar past the engine's limits (too many alternatives in one rule, a required
    recursion: llguidance stops with "too many items") fails here, as a StructuredOutputError for the request that
    sent it, not at its first token inside the engine."""
    m = template.deep_copy()
    words = (vocab_size + 31) // 32
    bitmask = torch.zeros(1, words, dtype=torch.int32)
    for _ in range(TRIAL_STEPS):
        m.unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
        if m.is_error():
            break
        allowed = allowed_tokens(bitmask, vocab_size)[0]
        if ends:
            allowed[[e for e in ends if e < vocab_size]] = False
        if not bool(allowed.any()):
            return  # only the end is left (or nothing: the mask check at run time names that)
        if not m.consume_token(int(allowed.nonzero()[0, 0])):
            break
    if m.is_error():
        raise StructuredOutputError(
            f"{constraint.kind} exceeds the grammar engine's limits: {first_line(m.get_error())}; simplify it "
            "(fewer alternatives in one rule, no recursion that is required at every level)")


def first_line(message: str) -> str:
    """llguidance's error messages carry the parser state and the whole grammar after the first line."""
    return message.strip().split("\n", 1)[0][:500]


def _explain(constraint: Constraint, messages: list[str]) -> str:
    text = "; ".join(m.strip() for m in messages) or "rejected by the grammar engine"
    hint = ""
    if "Unimplemented keys" in text or "Unknown format" in text or "only supported" in text:
        hint = (": these are not enforced by the grammar engine; remove them, or set structured_best_effort "
                "(true) to enforce the rest and let them go unchecked")
    return f"{constraint.kind} cannot be enforced: {text}{hint}"


GRAMMARS = GrammarCache()  # the process's cache: the library, the engine and the server share compiled grammars


def compile_for(cfg: Any, tokenizer: Any, vocab_size: int, cache: GrammarCache = GRAMMARS) -> Compiled | None:
    """Compile (or find) the constraint `cfg` sets, for `tokenizer` over `vocab_size` logits; None without one."""
    constraint = constraint_of(cfg)
    if constraint is None:
        return None
    if tokenizer is None:
        raise StructuredOutputError(f"{constraint.kind} needs the tokenizer: pass tokenizer=... (or use LLM)")
    return cache.compile(constraint, cache.tokenizer(tokenizer, vocab_size, tuple(sorted(cfg.stop_ids))))


def cached_for(cfg: Any, tokenizer: Any, vocab_size: int, cache: GrammarCache = GRAMMARS) -> Compiled | None:
    """The cached compile of the constraint `cfg` sets, or None (none set, or not compiled yet); a cached
    refusal is raised again. Cheap: for a caller that must not wait on a compile."""
    constraint = constraint_of(cfg)
    lltokenizer = None if constraint is None or tokenizer is None else cache.built_tokenizer(
        tokenizer, vocab_size, tuple(sorted(cfg.stop_ids)))
    return None if lltokenizer is None else cache.lookup(constraint, lltokenizer)  # type: ignore[arg-type]


# ---- the processor -------------------------------------------------------------------------------------------

# byte value -> its 8 bits, least significant first: one gather unpacks a bitmask
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # (256, 8)


def _bit(j: int) -> int:
    """Bit j of an int32 word, as the signed value torch stores."""
    return (1 << j) - (1 << 32) if j == 31 else 1 << j


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, ceil(V/32)) int32 bitmask (bit j of word w: token 32w + j, little-endian words) -> (B, V) bool."""
    return _BYTE_BITS[bitmask.view(torch.uint8).long()].flatten(1)[:, :vocab_size]


class GrammarMask:
    """(B, L) ids, (B, V) scores -> scores with every token the grammar forbids at -inf.

    Row r's generated tokens are ids[r, prompt_length:]; each call feeds the matcher the ones it has not seen, then
    asks for the next mask. `mask_for` does the same ahead of time (the engine runs it while the forward pass
    runs), so the call only applies the mask. A row whose matcher has ended (EOS taken) or that was finished by
    something else (a stop string: the loop then appends padding, which the mask never allowed) is left alone.
    """

    def __init__(self, compiled: Compiled, prompt_length: int, vocab_size: int, kind: str = "grammar",
                 thinking: Thinking | None = None, prompt: Sequence[int] = ()) -> None:
        self.compiled, self.prompt_length, self.vocab_size, self.kind = compiled, prompt_length, vocab_size, kind
        # A reasoning model thinks first, unconstrained: the grammar applies to the answer after the block.
        self.thinking, self.prompt = thinking, list(prompt)
        self.opened: list[bool] = []  # per row: the prompt left a thinking block open
        self.matchers: list[Any] = []
        self.seen: list[int] = []  # answer tokens fed to each row's matcher
        self.masked_at: list[int] = []  # generated tokens when the row's bitmask was computed (-1: never)
        self.mask_seen: list[int] = []  # `seen` when it was computed (-1: an all-allowing mask, while thinking)
        self.done: list[bool] = []
        self.bitmask = torch.empty(0, 0, dtype=torch.int32)

    def _rows(self, batch: int) -> None:
        if len(self.matchers) == batch:
            return
        if self.matchers:
            raise StructuredOutputError(f"{self.kind}: the batch changed from {len(self.matchers)} to {batch} rows "
                                        "mid-generation, which a per-row grammar state cannot follow")
        self.matchers = [self.compiled.template.deep_copy() for _ in range(batch)]
        self.seen, self.masked_at, self.done = [0] * batch, [-1] * batch, [False] * batch
        self.mask_seen = [-1] * batch
        opened = self.thinking is not None and self.thinking.open_after(self.prompt)
        self.opened = self.opened or [opened] * batch
        self.bitmask = torch.zeros(batch, (self.vocab_size + 31) // 32, dtype=torch.int32)

    def mask_for(self, generated: list[int]) -> torch.Tensor:
        """One row's (ceil(V/32),) int32 bitmask after `generated`: computed now, or found ready when the engine
        called this ahead of time, during the forward pass."""
        self._rows(1)
        self.prepare(0, generated)
        return self.bitmask[0]

    def prepare(self, row: int, generated: list[int]) -> None:
        """Feed row's matcher the generated tokens it has not seen and compute its next mask (GIL released)."""
        if self.done[row]:
            return
        made, opening = len(generated), False
        if self.thinking is not None:
            begun, after = self.thinking.span(self.opened[row], generated)
            if after is None:  # still thinking: every token is allowed
                if self.mask_seen[row] != -1 or self.masked_at[row] == -1:
                    self.bitmask[row].fill_(-1)
                self.masked_at[row], self.mask_seen[row] = made, -1
                return
            opening = begun is None and made == 0  # the answer's first token may open a block instead
            generated = generated[after:]
        m = self.matchers[row]
        for token in generated[self.seen[row]:]:
            if not m.consume_token(token):
                if self.mask_seen[row] == self.seen[row] and self._allowed(row, token):
                    # the grammar engine refused a token its own mask allowed: never let that pass
                    raise StructuredOutputError(f"{self.kind}: the grammar engine refused token {token}, which "
                                                f"its mask allowed ({first_line(m.get_error())})")
                self.done[row] = True  # padding after the row finished: the mask never allowed it
                return
            self.seen[row] += 1
            if token in self.compiled.ends:  # EOS taken where the grammar allowed it: the row is over
                self.done[row] = True
                return
        if self.masked_at[row] != made or self.mask_seen[row] != self.seen[row]:
            m.unsafe_compute_mask_ptr(self.bitmask[row].data_ptr(), self.bitmask.shape[1] * 4)
            if opening:
                start = self.thinking.start_id  # type: ignore[union-attr]
                self.bitmask[row, start // 32] |= _bit(start % 32)
            self.masked_at[row], self.mask_seen[row] = made, self.seen[row]

    def _allowed(self, row: int, token: int) -> bool:
        return token < self.vocab_size and bool((int(self.bitmask[row, token // 32]) >> (token % 32)) & 1)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        B = scores.shape[0]
        P = self.prompt_length
        if not self.matchers and self.thinking is not None:  # each row's own prompt says whether it opened a block
            self.opened = [self.thinking.open_after(input_ids[r, :P].tolist()) for r in range(B)]
        self._rows(B)
        for row in range(B):
            if not self.done[row] and self.masked_at[row] != input_ids.shape[1] - P:  # not prefetched
                self.prepare(row, input_ids[row, P:].tolist())
        allowed = allowed_tokens(self.bitmask, scores.shape[1]).to(scores.device)
        if any(self.done):  # rows that have ended keep their scores
            allowed |= torch.tensor(self.done, device=scores.device)[:, None]
        out = scores.masked_fill(~allowed, -math.inf)
        if not bool(torch.isfinite(out).any(dim=-1).all()):
            raise StructuredOutputError(
                f"{self.kind}: every token the grammar allows next is ruled out by another option (min_new_tokens, "
                "forced_eos_token_id, bad_words_ids, suppress_tokens, a logits processor...): drop the conflicting "
                "option"
            )
        return out
