"""The tokenizer: text <-> ids through the `tokenizers` library, with the special tokens and chat templates of a
Hugging Face folder, behaving as transformers 5's `AutoTokenizer` does on a folder with a `tokenizer.json`.

What transformers 5 does on such a folder, and so what this module does:
* ids come from `tokenizer.json`'s own pipeline, post-processor included; `add_bos_token`/`add_eos_token` in
  tokenizer_config.json are dropped when a tokenizer.json exists, so they never change what `encode` returns.
* special tokens come from tokenizer_config.json; special_tokens_map.json is read only for configs without
  `added_tokens_decoder` (the legacy layout), and then its values win.
* a `chat_template.jinja` file (or the older `chat_template.json`) and `additional_chat_templates/*.jinja` replace
  the config's templates.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from .chat_template import RenderLimits, render_chat_template
from ..errors import ChatTemplateError, MissingFileError, TokenizerError

# transformers' named special tokens, in its order (which is the order of `all_special_ids`).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# transformers writes int(1e30) as model_max_length when a model sets none.
_UNSET_MAX_LENGTH = int(1e29)

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class Tokenizer:
    """Text <-> token ids for one model; build it with `Tokenizer.from_dir`."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str] | None = None,
        extra_special_tokens: Sequence[str] = (),
        chat_templates: Mapping[str, str] | None = None,
        model_max_length: int | None = None,
    ) -> None:
        self._tk = backend
        # name -> content for every named special token that is set, standard names first (template variables).
        self._special = dict(special_tokens or {})
        self._extra = list(extra_special_tokens)
        self._chat_templates = dict(chat_templates or {})
        self._model_max_length = model_max_length
        self._byte_fallback_ids: frozenset[int] | None = None

    # ---- loading -------------------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` (required) plus tokenizer_config.json, special_tokens_map.json and chat templates."""
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise MissingFileError(
                f"{file} does not exist: nexttoken reads tokenizers from a Hugging Face tokenizer.json. "
                "A model folder without tokenizer files can still be used with token ids instead of text"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises a bare Exception on any parse error
            raise TokenizerError(f"{file} cannot be loaded by the tokenizers library ({exc}); re-download it") from exc

        config = _read_json_object(folder / "tokenizer_config.json") or {}
        special, extra = _special_tokens(config, folder)
        _add_missing_tokens(backend, config, list(special.values()) + extra, folder)
        max_length = config.get("model_max_length")
        if not isinstance(max_length, (int, float)) or max_length >= _UNSET_MAX_LENGTH:
            max_length = None
        return cls(backend, special, extra, _chat_templates(config, folder), int(max_length) if max_length else None)

    @classmethod
    def maybe_from_dir(cls, path: str | Path) -> Tokenizer | None:
        """`from_dir`, or None when the folder has no tokenizer.json (a model used with ids only)."""
        if not (Path(path) / "tokenizer.json").is_file():
            return None
        return cls.from_dir(path)

    # ---- text <-> ids --------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies tokenizer.json's post-processor (e.g. BOS)."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, got {type(text).__name__}: {text!r}")
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def batch_encode(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` for each text, in one call into the (parallel) Rust tokenizer."""
        for text in texts:
            if not isinstance(text, str):
                raise TokenizerError(f"batch_encode takes a list of str, got a {type(text).__name__}: {text!r}")
        return [e.ids for e in self._tk.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`. Unlike the tokenizers library (and like transformers), special tokens are kept by default."""
        if hasattr(ids, "tolist"):  # tensors and arrays
            ids = ids.tolist()
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        """Vocabulary strings of `ids` (None for an id outside the vocabulary)."""
        if isinstance(ids, int):
            return self._tk.id_to_token(ids)
        return [self._tk.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        """Id of the vocabulary string `token`, or None when it is not in the vocabulary."""
        return self._tk.token_to_id(token)

    # ---- vocabulary and special tokens ---------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tk

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (transformers' `len(tokenizer)`)."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def model_max_length(self) -> int | None:
        """tokenizer_config.json's `model_max_length`, or None when unset."""
        return self._model_max_length

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens that are set, e.g. {"bos_token": "<s>"}; what chat templates receive as variables."""
        return dict(self._special)

    @property
    def bos_token(self) -> str | None:
        """The BOS token string, or None."""
        return self._special.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        """The EOS token string, or None (generation_config.json may list more stop ids)."""
        return self._special.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        """The padding token string, or None."""
        return self._special.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        """The unknown-token string, or None."""
        return self._special.get("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._id_of("unk_token")

    def _id_of(self, name: str) -> int | None:
        token = self._special.get(name)
        return None if token is None else self._tk.token_to_id(token)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the standard named special tokens, then the extra ones, without repeats (as transformers)."""
        tokens = [self._special[n] for n in SPECIAL_TOKEN_NAMES if n in self._special] + self._extra
        ids = (self._tk.token_to_id(t) for t in dict.fromkeys(tokens))
        return [i for i in ids if i is not None]

    @property
    def add_bos_token(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` starts with BOS (decided by tokenizer.json alone)."""
        bos = self.bos_token_id
        ids = self._tk.encode("a", add_special_tokens=True).ids
        return bos is not None and ids[:1] == [bos] and self._tk.encode("a", add_special_tokens=False).ids[:1] != [bos]

    @property
    def skipped_special_ids(self) -> frozenset[int]:
        """Ids `decode(..., skip_special_tokens=True)` drops: every added token flagged special (a wider set than
        `all_special_ids`, e.g. Llama 3's <|eot_id|> is one while not being a named token)."""
        return frozenset(i for i, t in self._tk.get_added_tokens_decoder().items() if t.special)

    @property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of SentencePiece byte tokens (`<0xE6>`) when the decoder merges runs of them into UTF-8, else empty."""
        if self._byte_fallback_ids is None:
            decoder = self._tk.decoder
            state = decoder.__getstate__().decode() if decoder is not None else ""
            found: frozenset[int] = frozenset()
            if '"ByteFallback"' in state:
                vocab = self._tk.get_vocab(with_added_tokens=False)
                found = frozenset(i for token, i in vocab.items() if _BYTE_TOKEN.fullmatch(token))
            self._byte_fallback_ids = found
        return self._byte_fallback_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` adds to a text, as the decoder writes them (`▁` as a space, `<0xE6>` as
        that byte, byte-level BPE's characters as the bytes they stand for); a special token gives its name."""
        cache = self.__dict__.setdefault("_token_bytes", {})
        if token_id not in cache:
            piece = self._tk.id_to_token(int(token_id)) or ""
            if int(token_id) in self._tk.get_added_tokens_decoder():
                raw = piece.encode("utf-8")
            elif self._byte_level:
                raw = bytes(_UNICODE_TO_BYTE.get(c, 0) for c in piece)
            elif int(token_id) in self.byte_fallback_ids:
                raw = bytes([int(piece[3:5], 16)])
            else:
                raw = piece.replace("▁", " ").encode("utf-8")
            cache[token_id] = raw
        return cache[token_id]

    def token_text(self, token_id: int) -> str:
        """`token_bytes` as text; a token that is part of a multi-byte character writes its bytes as \\xNN."""
        return self.token_bytes(token_id).decode("utf-8", errors="backslashreplace")

    @property
    def _byte_level(self) -> bool:
        decoder = self._tk.decoder
        return decoder is not None and '"ByteLevel"' in decoder.__getstate__().decode()

    # ---- chat ----------------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The template `apply_chat_template` uses by default (the one named "default"), or None."""
        return self._chat_templates.get("default")

    def use_chat_template(self, template: str) -> None:
        """Render chats with `template` (a Jinja chat template's text) instead of the model's own (a server's
        per-model preset, server/catalog.py)."""
        self._chat_templates["default"] = template

    @property
    def chat_templates(self) -> dict[str, str]:
        """Every template by name; a folder with a single template has it under "default"."""
        return dict(self._chat_templates)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool | str = False,
        limits: RenderLimits = RenderLimits(),
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation with the model's chat template, as transformers does; with `tokenize=True`, its ids.

        `chat_template` is a template name from `chat_templates` or a jinja source. Extra keyword arguments become
        template variables (e.g. `date_string=` for Llama 3), overriding the special tokens of the same name.
        The ids are `encode(text, add_special_tokens=False)`: templates write BOS themselves.
        """
        template = self._pick_template(chat_template, tools)
        text = render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            variables={**self._special, **template_kwargs},
            limits=limits,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def chat_template_for(self, tools: Any = None, chat_template: str | None = None) -> str | None:
        """The template `apply_chat_template` would render with (None if there is none to pick)."""
        try:
            return self._pick_template(chat_template, tools)
        except ChatTemplateError:
            return None

    def _pick_template(self, chat_template: str | None, tools: Any) -> str:
        if chat_template is not None:
            return self._chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" in self._chat_templates:
            return self._chat_templates["default"]
        if self._chat_templates:
            raise ChatTemplateError(
                f"this tokenizer has several chat templates {sorted(self._chat_templates)} and none named "
                "'default': pass chat_template=<one of those names>"
            )
        raise ChatTemplateError(
            "this tokenizer has no chat template: pass chat_template=... or use a model whose "
            "tokenizer_config.json has one"
        )

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, special_tokens={self._special})"


# ---- reading the folder ----------------------------------------------------------------------------------------


def _read_json_object(file: Path) -> dict[str, Any] | None:
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{file} is not valid JSON ({exc}); re-download it") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any, where: str) -> str | None:
    """A special token as written in the config: a string, an AddedToken dict {"content": ...}, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{where}: a special token must be a string or {{\"content\": ...}}, got {value!r}")


def _special_tokens(config: dict[str, Any], folder: Path) -> tuple[dict[str, str], list[str]]:
    """Named special tokens (standard names first, then model-specific ones like `image_token`) and extra ones."""
    where = str(folder / "tokenizer_config.json")
    raw = dict(config)
    if "added_tokens_decoder" not in raw:  # legacy layout: special_tokens_map.json overrides the config
        raw.update(_read_json_object(folder / "special_tokens_map.json") or {})
    named = {name: _token_content(raw.get(name), where) for name in SPECIAL_TOKEN_NAMES}
    # transformers 5 treats any other "*_token" string as a model-specific named token (e.g. image_token).
    named.update({k: v for k, v in raw.items() if k.endswith("_token") and k not in named and isinstance(v, str)})
    extra = raw.get("extra_special_tokens") or raw.get("additional_special_tokens") or []
    if isinstance(extra, dict):
        named.update({k: _token_content(v, where) for k, v in extra.items()})
        extra = []
    if not isinstance(extra, list):
        raise TokenizerError(f"{where}: additional_special_tokens must be a list of tokens, got {extra!r}")
    extra_tokens = [t for t in (_token_content(v, where) for v in extra) if t is not None]
    return {k: v for k, v in named.items() if v is not None}, extra_tokens


def _add_missing_tokens(
    backend: tokenizers.Tokenizer, config: dict[str, Any], special: list[str], folder: Path
) -> None:
    """Add tokens the config declares but tokenizer.json lacks, as transformers does when it loads the folder."""
    declared = config.get("added_tokens_decoder") or {}
    if not isinstance(declared, dict):
        raise TokenizerError(f"{folder / 'tokenizer_config.json'}: added_tokens_decoder must be an object")
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    flags = {}
    for index in sorted(declared, key=int):
        entry = declared[index]
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise TokenizerError(f"{folder / 'tokenizer_config.json'}: added token {index} is not an AddedToken")
        opts = {k: entry[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in entry}
        flags[entry["content"]] = opts
        if entry["content"] not in present:
            backend.add_tokens([tokenizers.AddedToken(entry["content"], **opts)])
            present.add(entry["content"])
    for content in dict.fromkeys(special):  # named and extra special tokens must exist, as special tokens
        if content not in present:
            opts = {**flags.get(content, {"normalized": False}), "special": True}
            backend.add_special_tokens([tokenizers.AddedToken(content, **opts)])
            present.add(content)


def _chat_templates(config: dict[str, Any], folder: Path) -> dict[str, str]:
    """Templates by name. Template files, when present, replace the config's templates (as in transformers)."""
    files = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "chat_template.json").is_file():  # the older file form: {"chat_template": "..."}
        raw = _read_json_object(folder / "chat_template.json") or {}
        if not isinstance(raw.get("chat_template"), str):
            raise TokenizerError(f"{folder / 'chat_template.json'}: needs a \"chat_template\" string")
        files["default"] = raw["chat_template"]
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            files[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if files:
        return files
    raw = config.get("chat_template")
    if raw is None:
        return {}
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in raw
    ):
        return {t["name"]: t["template"] for t in raw}
    raise TokenizerError(
        f"{folder / 'tokenizer_config.json'}: chat_template must be a string or a list of "
        f"{{\"name\": ..., \"template\": ...}} objects, got {type(raw).__name__}"
    )


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character (what byte-level BPE vocabularies store)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}
