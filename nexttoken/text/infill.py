"""Fill-in-the-middle prompts: the code before and after a hole, laid out with the tokenizer's FIM tokens as the
model family was trained to read them (prefix-suffix-middle), so the model writes the middle.

Spellings, found by looking the tokens up in the vocabulary (each must be one token):
- Qwen2.5-Coder: `<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>` (repository context:
  `<|repo_name|>`, `<|file_sep|>`);
- StarCoder / StarCoder2: `<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>` (`<repo_name>`, `<file_sep>`);
- DeepSeek-Coder: `<｜fim▁begin｜>{prefix}<｜fim▁hole｜>{suffix}<｜fim▁end｜>`, after BOS;
- CodeLlama: `<s>▁<PRE> {prefix}▁<SUF>{suffix}▁<MID>`: Meta's reference layout, where the prefix is encoded
  with SentencePiece's leading space and the suffix without it.

Extra context files (llama.cpp's `input_extra`) come first, as llama.cpp's /infill writes them: the repository
marker with "myproject", each file as `<file_sep>{filename}\\n{text}`, then `<file_sep>filename\\n` for the file
being edited; a family without a file separator gets each file after "\\n\\n--- snippet ---\\n\\n".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import NextTokenError


class InfillError(NextTokenError):
    """A fill-in-the-middle request this tokenizer cannot serve (it has no FIM tokens)."""


@dataclass(frozen=True)
class FimFormat:
    name: str
    prefix: str
    suffix: str
    middle: str
    repo: str | None = None  # the repository-name marker, where the family has one
    file_sep: str | None = None  # the file separator, where the family has one
    bos: bool = False  # the layout starts with BOS
    bare_suffix: bool = False  # the suffix is encoded without SentencePiece's leading space (CodeLlama)


FORMATS = (
    FimFormat("qwen2.5-coder", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"),
    FimFormat("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<repo_name>", "<file_sep>"),
    FimFormat("deepseek-coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", bos=True),
    FimFormat("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", bos=True, bare_suffix=True),
)
SNIPPET = "\n\n--- snippet ---\n\n"  # llama.cpp's separator for families without a file separator
REPO_NAME, CURRENT_FILE = "myproject", "filename"  # what llama.cpp's /infill writes for them


def fim_format(tokenizer: Any) -> FimFormat | None:
    """The tokenizer's FIM format: the first family whose three markers are each one token of the vocabulary."""
    if tokenizer is None:
        return None
    for fmt in FORMATS:
        if all(tokenizer.token_to_id(m) is not None for m in (fmt.prefix, fmt.suffix, fmt.middle)):
            return fmt
    return None


def fim_prompt(tokenizer: Any, prefix: str, suffix: str, extra: Sequence[tuple[str, str]] = (),
               after: str = "") -> list[int]:
    """The token ids of a fill-in-the-middle prompt; `extra`: (filename, text) context files; `after`: text that
    follows the middle marker (llama.cpp's `prompt`: the start of the middle, already written)."""
    fmt = fim_format(tokenizer)
    if fmt is None:
        names = ", ".join(f"{f.name} ({f.prefix} {f.suffix} {f.middle})" for f in FORMATS)
        raise InfillError(f"this model's tokenizer has no fill-in-the-middle tokens (looked for {names}): use a "
                          "code model trained for infilling, or send the prompt without a suffix")
    tid = tokenizer.token_to_id

    def text(s: str) -> list[int]:
        return tokenizer.encode(s, add_special_tokens=False) if s else []

    ids: list[int] = [tokenizer.bos_token_id] if fmt.bos and tokenizer.bos_token_id is not None else []
    if extra:
        if fmt.repo is not None:
            ids += [tid(fmt.repo)] + text(REPO_NAME + "\n")
        for filename, body in extra:
            ids += ([tid(fmt.file_sep)] + text(filename + "\n")) if fmt.file_sep is not None else text(SNIPPET)
            ids += text(body)
        if fmt.file_sep is not None:
            ids += [tid(fmt.file_sep)] + text(CURRENT_FILE + "\n")
    ids += [tid(fmt.prefix)] + text(prefix) + [tid(fmt.suffix)]
    ids += _bare(tokenizer, suffix) if fmt.bare_suffix else text(suffix)
    return ids + [tid(fmt.middle)] + text(after)


def _bare(tokenizer: Any, s: str) -> list[int]:
    """`s` without SentencePiece's leading space (Meta's encode_infilling: encode "☺" + s, drop "▁☺")."""
    if not s:
        return []
    return tokenizer.encode("☺" + s, add_special_tokens=False)[2:]
