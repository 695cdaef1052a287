"""Where a `--model` lives: a local folder or GGUF file, or a Hugging Face Hub id resolved in the Hub cache with
`huggingface_hub` (downloading only the files nexttoken reads; never pickles).

    path/to/folder            a Hugging Face model folder
    path/to/model.gguf        a GGUF file
    org/name                  a Hub repository: config, safetensors, tokenizer and chat-template files
    org/name:Q4_K_M           the repository's GGUF file of that quantization (as Ollama and llama.cpp's -hf do)
    org/name + gguf_file=F    that GGUF file of the repository

A LoRA adapter given as a Hub id (resolve_adapter) is fetched the same way: its PEFT config and safetensors only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ...errors import MissingFileError, ModelLoadError

# The files of a model folder nexttoken reads (snapshot_download's allow_patterns): never *.bin / *.pt pickles.
FOLDER_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                "chat_template.json", "additional_chat_templates/*.jinja"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "additional_chat_templates/*.jinja"]
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]  # PEFT's save_pretrained, never adapter_model.bin
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    """A model resolved to local files: a folder or a .gguf file, and the name it is served and traced under."""

    path: Path
    name: str

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix.lower() == ".gguf" and self.path.is_file()


def resolve_model(model: str | Path, revision: str | None = None, download_dir: str | Path | None = None,
                  gguf_file: str | None = None, files: list[str] | None = None) -> ModelSource:
    """A local folder / .gguf file as it is, else a Hub id from the Hub cache (downloaded when allowed).
    `files`: the folder patterns to fetch (FOLDER_FILES by default). Missing models raise MissingFileError naming
    what is missing and the command that fetches it."""
    local = Path(model).expanduser()
    if local.exists():
        if gguf_file is not None:
            local = local / gguf_file
            if not local.is_file():
                raise MissingFileError(f"GGUF file {local} does not exist")
        return ModelSource(local, local.stem if local.is_file() else local.resolve().name)
    text = str(model)
    repo, _, tag = text.partition(":")
    if text.lower().endswith(".gguf"):  # a file path (Hub repositories are not named *.gguf)
        raise MissingFileError(f"GGUF file {local} does not exist")
    if not _REPO_ID.match(repo) or text.startswith((".", "/", "~")):
        raise MissingFileError(f"model folder {local} does not exist (and {text!r} is not a Hugging Face Hub id "
                               "like org/name); pass a model folder, a .gguf file or a Hub id")
    if tag and gguf_file:
        raise ModelLoadError(f"--model {text} names a quantization and --gguf-file {gguf_file} a file: pass one")
    if tag or gguf_file:
        pattern = gguf_file or f"*{_any_case(tag)}*.gguf"
        folder = _snapshot(repo, revision, download_dir, [pattern])
        found = sorted(folder.glob(pattern)) if not gguf_file else [folder / gguf_file]
        found = [f for f in found if f.is_file()]
        if len(found) != 1:
            what = f"no GGUF file matching {pattern!r}" if not found else \
                f"several GGUF files matching {tag!r}: {', '.join(f.name for f in found)}"
            raise MissingFileError(f"{repo} (in {folder}) has {what}; name one with --gguf-file FILE")
        return ModelSource(found[0], found[0].stem)
    return ModelSource(_snapshot(repo, revision, download_dir, files or FOLDER_FILES), repo)


def resolve_adapter(source: str, revision: str | None = None, download_dir: str | Path | None = None) -> Path:
    """The folder of a LoRA adapter named by a Hub id (org/name), from the Hub cache (downloaded when allowed):
    lora/adapter.py's `read_adapter(..., resolve=)` calls it for a source that is not a local folder."""
    text = str(source)
    if not _REPO_ID.match(text) or text.startswith((".", "/", "~")):
        raise MissingFileError(f"LoRA adapter folder {source} does not exist (and {text!r} is not a Hugging Face Hub "
                               "id like org/name); give the folder PEFT's save_pretrained wrote, or a Hub id")
    return _snapshot(text, revision, download_dir, ADAPTER_FILES)


def _fetch_command(repo: str, revision: str | None, download_dir: str | Path | None, patterns: list[str]) -> str:
    """The `hf download` command that fetches what nexttoken reads: the repository (a folder's files), or only the
    GGUF file asked for (its name, or the pattern of its quantization tag), not the repository's other files."""
    what = ""
    if len(patterns) == 1 and patterns[0].lower().endswith(".gguf"):
        pattern = patterns[0]
        what = f" {pattern}" if not any(c in pattern for c in "*?[") else f" --include '{pattern}'"
    return (f"hf download {repo}{what}" + (f" --revision {revision}" if revision else "")
            + (f" --cache-dir {download_dir}" if download_dir is not None else ""))


def _any_case(tag: str) -> str:
    """A glob matching `tag` in any letter case (Q4_K_M and q4_k_m are both written)."""
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in tag)


def _snapshot(repo: str, revision: str | None, download_dir: str | Path | None, patterns: list[str]) -> Path:
    """The repository's snapshot folder in the Hub cache (download_dir, or huggingface_hub's own), holding the
    files matching `patterns`; downloaded unless HF_HUB_OFFLINE=1 or there is no network."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.constants import HF_HUB_CACHE
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError as e:  # pragma: no cover - a base dependency
        raise ModelLoadError("Hub ids need the huggingface_hub package: pip install huggingface_hub") from e
    cache = Path(download_dir) if download_dir is not None else Path(HF_HUB_CACHE)
    at = f" at revision {revision}" if revision else ""
    fetch = _fetch_command(repo, revision, download_dir, patterns)
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    how = (f"download it with `{fetch}`, or run without "
           "HF_HUB_OFFLINE=1 so that nexttoken downloads it") if offline else f"download it with `{fetch}`"
    try:
        from huggingface_hub.errors import IncompleteSnapshotError
    except ImportError:  # older huggingface_hub: no tree listing to check a cached snapshot against
        IncompleteSnapshotError = LocalEntryNotFoundError  # noqa: N806
    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=str(cache), allow_patterns=patterns))
    except IncompleteSnapshotError as e:  # a listing of the repository is cached, and files of it are missing
        why = "HF_HUB_OFFLINE=1 forbids downloading them" if offline else "the Hub could not be reached"
        raise MissingFileError(f"model {repo}{at} is not in the Hugging Face cache {cache}: files it needs are "
                               f"missing there and {why} ({e}); {how}") from e
    except LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE=1 forbids downloading it" if offline else "it cannot be downloaded (no network?)"
        raise MissingFileError(f"model {repo}{at} is not in the Hugging Face cache {cache} and {why}: {how}") from e
    except RevisionNotFoundError as e:
        raise MissingFileError(f"model {repo} has no revision {revision!r}: pass an existing branch, tag or "
                               "commit with --revision") from e
    except GatedRepoError as e:
        raise MissingFileError(f"model {repo} is gated: accept its license on huggingface.co and log in "
                               f"(`hf auth login`), then `{fetch}`") from e
    except RepositoryNotFoundError as e:
        raise MissingFileError(f"model {repo} does not exist on the Hugging Face Hub (or is private: log in with "
                               "`hf auth login`); check the id, or pass a local folder or .gguf file") from e
    except (HfHubHTTPError, OSError) as e:
        raise MissingFileError(f"model {repo}{at} could not be fetched into {cache} ({e}); fetch it with "
                               f"`{fetch}`") from e
