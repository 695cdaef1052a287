"""Reasoning ("thinking") formats: where a model's answer writes its thinking, and the streaming parser that
splits it off the content.

Formats are named as vLLM's `--reasoning-parser` names them:
- `qwen3`: the answer may open with `<think>`; what comes before `</think>` is thinking. An answer that does not
  open with `<think>` is all content (Qwen3 with `enable_thinking: false`: the template closed the block already).
- `deepseek_r1`: the prompt opens the block (the template ends with `<think>\\n`), so the answer starts inside it:
  everything before `</think>` is thinking (a leading `<think>` is dropped), all of it when no `</think>` comes.
- `mistral`: Magistral's `[THINK]` ... `[/THINK]`, as `qwen3` reads `<think>`.
- `openai_gptoss`: gpt-oss's harmony channels (chat/harmony.py): the `analysis` channel is the thinking; the
  answer is read by harmony's own parser (channels, calls and the final answer together), and the effort is the
  system message's `Reasoning: low|medium|high`, not a budget.
With no name, the format is read off the chat template, as tool-call formats are.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    opened_by_prompt: bool  # the template writes `start` itself: the answer begins inside the thinking
    harmony: bool = False  # gpt-oss's channels: the answer is read by chat/harmony.py's parser

    def parser(self, opened: bool | None = None) -> "ReasoningParser":
        """A parser for one answer; `opened`: whether its prompt left a block open (see `opened_in`), where known
        (else the format's usual template decides)."""
        return ReasoningParser(self, self.opened_by_prompt if opened is None else opened)

    def opened_in(self, prompt: str) -> bool:
        """Whether `prompt` (the rendered template) leaves a thinking block open: its last marker is the start.
        Exact where a name's rule is not: DeepSeek-R1's template opens no block after a tool's output, Qwen3's
        closes one with enable_thinking false."""
        return prompt.rfind(self.start) > prompt.rfind(self.end)


# reasoning.effort (OpenAI's names) as a thinking budget in tokens.
EFFORT_BUDGETS = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768}


FORMATS = {f.name: f for f in (
    ReasoningFormat("qwen3", "<think>", "</think>", opened_by_prompt=False),
    ReasoningFormat("deepseek_r1", "<think>", "</think>", opened_by_prompt=True),
    ReasoningFormat("mistral", "[THINK]", "[/THINK]", opened_by_prompt=False),
    ReasoningFormat("openai_gptoss", "<|channel|>analysis<|message|>", "<|end|>", opened_by_prompt=False,
                    harmony=True),
)}


def format_named(name: str) -> ReasoningFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}: use one of {sorted(FORMATS)}")
    return FORMATS[name]


def detect_format(template: str | None) -> ReasoningFormat | None:
    """The format a chat template shows: harmony's channels (openai_gptoss), `</think>` in it (deepseek_r1 when
    its generation prompt opens the block, qwen3 otherwise), Magistral's `[/THINK]`; None for a template without
    thinking."""
    if not template:
        return None
    if "<|channel|>" in template and "<|message|>" in template:
        return FORMATS["openai_gptoss"]
    if "[/THINK]" in template:
        return FORMATS["mistral"]
    if "</think>" not in template:
        return None
    opened = any(s in template for s in ("<｜Assistant｜><think>\\n", "<|im_start|>assistant\\n<think>\\n'",
                                         "<｜Assistant｜><think>\n"))
    return FORMATS["deepseek_r1" if opened else "qwen3"]


class ReasoningParser:
    """Text in, `(thinking, text)` parts out, as it streams: a marker split across feeds is held back until it is
    decided. `reasoning` and `content` hold the whole of each so far."""

    def __init__(self, fmt: ReasoningFormat, opened: bool | None = None) -> None:
        opened = fmt.opened_by_prompt if opened is None else opened
        self.format = fmt
        self.state = "thinking" if opened else "opening"  # opening -> thinking -> content
        self.pending = ""  # text held back: a possible start of a marker
        self.reasoning = self.content = ""
        self._leading = opened  # a start marker may still come first, and is then dropped

    def feed(self, text: str) -> list[tuple[bool, str]]:
        self.pending += text
        out: list[tuple[bool, str]] = []
        while self.pending:
            if not self._step(out):
                break
        return self._record(out)

    def finish(self) -> list[tuple[bool, str]]:
        """The end of the answer: held-back text is what it is (an unfinished marker is text)."""
        rest, self.pending = self.pending, ""
        out: list[tuple[bool, str]] = []
        if rest:
            out.append((self.state == "thinking", rest))
        return self._record(out)

    def _step(self, out: list[tuple[bool, str]]) -> bool:
        """Move what can be decided out of `pending`; False when the rest must wait for more text."""
        start, end = self.format.start, self.format.end
        if self.state == "opening" or self._leading:
            if self.pending.startswith(start):
                self.pending = self.pending[len(start):]
                self.state, self._leading = "thinking", False
                return True
            if start.startswith(self.pending):
                return False  # maybe the marker, not all here yet
            self._leading = False
            if self.state == "opening":
                self.state = "content"
            return True
        if self.state == "content":
            out.append((False, self.pending))
            self.pending = ""
            return True
        at = self.pending.find(end)
        if at >= 0:
            if at:
                out.append((True, self.pending[:at]))
            self.pending = self.pending[at + len(end):]
            self.state = "content"
            return True
        keep = _partial_suffix(self.pending, end)
        if len(self.pending) > keep:
            out.append((True, self.pending[:len(self.pending) - keep]))
            self.pending = self.pending[len(self.pending) - keep:]
        return False

    def _record(self, out: list[tuple[bool, str]]) -> list[tuple[bool, str]]:
        for thinking, text in out:
            if thinking:
                self.reasoning += text
            else:
                self.content += text
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (held back: the marker may be arriving)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
