"""The models a server serves, before any is loaded: each with its name, its LoadSpec and its own settings.

They come from `--model` flags (`--model PATH`, or `--model NAME=PATH` to name it), from `--models-dir DIR` (each
model folder and GGUF file in it), from the Hugging Face cache (`--hf-cache`), and from a presets file
(`--presets FILE.toml` or `.json`) that gives each model's settings by name and may add models of its own:

    [defaults]                  # every model's, under its own section
    max_num_seqs = 8

    [models.stories]
    model = "models/stories260k"  # relative to the presets file; adds the model when no flag names it
    aliases = ["tiny"]
    max_model_len = 256
    kv_cache_memory = "64MiB"
    tool_call_parser = "hermes"
    chat_template = "templates/chat.jinja"

A model's setting is its section's, else the presets' defaults, else the command line's flag. The keys: every
LoadSpec field (loadspec.py), the engine's (ENGINE_FIELDS), the per-model server settings (SERVER_FIELDS) and
OTHER_FIELDS. No torch here: the catalog is read, and checked, before a model is loaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..errors import ModelLoadError
from ..loadspec import LoadSpec

# Ollama names a model `name:tag`; a served name without a tag is `name:latest` too (on every API, as Ollama's)
TAG = "latest"

ENGINE_FIELDS = ("max_num_seqs", "max_model_len", "chunk_size", "max_num_batched_tokens", "enable_prefix_caching",
                 "block_size", "kv_cache_memory", "num_kv_blocks", "kv_cache_dtype", "scheduling_policy")
SERVER_FIELDS = ("tool_call_parser", "reasoning_parser", "reasoning_budget", "default_chat_template_kwargs",
                 "pooling", "structured_whitespace", "generation_config", "strict_json_schema",
                 "special_tokens_in_content")
OTHER_FIELDS = ("aliases", "chat_template", "speculative_ngram", "num_speculative_tokens")
LOAD_FIELDS = tuple(f.name for f in dataclasses.fields(LoadSpec))
PACKAGED_NAME = "default_model"  # the packaged model's name (pretrained.DEFAULT_MODEL_DIR's), read without torch
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


class PresetError(ModelLoadError):
    """A presets file, --model or --models-dir value that cannot be read: names the file, model and key."""


@dataclass(frozen=True)
class ModelChoice:
    """One served model, unloaded: what to load (`spec`), what it answers to, and its own settings over the
    command line's (`engine`: EngineConfig fields, `server`: ServerSettings fields)."""

    name: str
    spec: LoadSpec
    aliases: tuple[str, ...] = ()
    engine: Mapping[str, Any] = field(default_factory=dict)
    server: Mapping[str, Any] = field(default_factory=dict)
    chat_template: str | None = None  # the template text that replaces the model's own
    speculative: Mapping[str, Any] = field(default_factory=dict)  # speculative_ngram, num_speculative_tokens

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a request's `model` may give it, the reported one first."""
        return (self.name, *self.aliases)

    def weight_bytes(self) -> int:
        """The bytes of its weight files on disk (0 when not local, a Hub id not fetched yet): the estimate a load
        makes room for before the model's own size is known."""
        if self.spec.model is None:
            return 0
        path = Path(self.spec.model).expanduser()
        if path.is_file():
            return path.stat().st_size
        if not path.is_dir():
            return 0
        return sum(p.stat().st_size for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def size_bytes(text: str | int) -> int:
    """'2GiB', '512M', '1000000' or an int -> bytes; ValueError naming the forms."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    s = str(text).strip().upper().removesuffix("B")
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if u and s.endswith(u)), "")
    try:
        return int(float(s[: len(s) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"{text!r} is not a size in bytes (e.g. 2GiB, 512M, 1000000)") from None


def named(value: str) -> tuple[str | None, str]:
    """`--model NAME=PATH` -> (NAME, PATH); a value without '=', or an existing path with one, -> (None, value)."""
    name, sep, path = value.partition("=")
    if not sep or Path(value).expanduser().exists() or not name or "/" in name or os.sep in name:
        return None, value
    return name, path


def default_name(model: str | os.PathLike) -> str:
    """What a model is called when not named: a folder's name, a GGUF file's stem, a Hub id as given."""
    path = Path(model).expanduser()
    if path.exists():
        return path.stem if path.is_file() else path.resolve().name
    return str(model)


def models_in(folder: str | os.PathLike) -> list[tuple[str, Path]]:
    """The models of a --models-dir folder, by name: each model folder (a config.json) by its name, each GGUF file
    by its stem, each folder holding GGUF files (llama.cpp's layout for split files) by its name, with its first
    file (multimodal projectors, mmproj*.gguf, left out)."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise PresetError(f"--models-dir {folder}: not a folder")
    found = []
    for entry in sorted(root.iterdir()):
        if entry.is_dir() and (entry / "config.json").is_file():
            found.append((entry.name, entry))
        elif entry.is_dir():
            files = sorted(p for p in entry.glob("*.gguf") if not p.name.lower().startswith("mmproj"))
            if files:
                found.append((entry.name, files[0]))
        elif entry.suffix.lower() == ".gguf" and not entry.name.lower().startswith("mmproj"):
            found.append((entry.stem, entry))
    return found


def cached_models(download_dir: str | os.PathLike | None = None) -> list[tuple[str, Path]]:
    """The models in the Hugging Face cache (`download_dir`, else $HF_HUB_CACHE, $HF_HOME/hub or
    ~/.cache/huggingface/hub): each model repository whose snapshot (refs/main's, else the newest) holds a
    config.json, by its id; each GGUF file of a repository as `id:stem`. The cache's layout (models--org--name/
    snapshots/<commit>/, refs/main) is read as it is on disk: huggingface_hub is optional."""
    root = Path(download_dir or os.environ.get("HF_HUB_CACHE") or
                Path(os.environ.get("HF_HOME", "~/.cache/huggingface")) / "hub").expanduser()
    if not root.is_dir():
        raise PresetError(f"--hf-cache: no Hugging Face cache at {root} (set --download-dir or HF_HUB_CACHE)")
    found = []
    for repo in sorted(root.glob("models--*")):
        snapshot = _snapshot(repo)
        if snapshot is None:
            continue
        repo_id = repo.name.removeprefix("models--").replace("--", "/")
        if (snapshot / "config.json").is_file():
            found.append((repo_id, snapshot))
        for gguf in sorted(snapshot.glob("*.gguf")):
            if not gguf.name.lower().startswith("mmproj"):
                found.append((f"{repo_id}:{gguf.stem}", gguf))
    return found


def _snapshot(repo: Path) -> Path | None:
    """A cached repository's snapshot folder: refs/main's commit, else the newest snapshot; None without one."""
    ref = repo / "refs" / "main"
    if ref.is_file() and (repo / "snapshots" / ref.read_text().strip()).is_dir():
        return repo / "snapshots" / ref.read_text().strip()
    snapshots = [p for p in (repo / "snapshots").glob("*") if p.is_dir()]
    return max(snapshots, key=lambda p: p.stat().st_mtime) if snapshots else None


def read_presets(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(defaults, {name: settings}) of a presets file (TOML or JSON, by its suffix); its paths (model, tokenizer,
    draft_model, download_dir, chat_template files) made relative to the file's folder."""
    file = Path(path).expanduser()
    try:
        text = file.read_text()
    except OSError as e:
        raise PresetError(f"--presets {path}: {e.strerror or e}") from e
    try:
        if file.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import tomllib

            data = tomllib.loads(text)
    except ValueError as e:  # json.JSONDecodeError and tomllib.TOMLDecodeError are ValueErrors
        raise PresetError(f"--presets {path}: not valid {'JSON' if file.suffix.lower() == '.json' else 'TOML'}: "
                          f"{e}") from e
    if not isinstance(data, dict) or set(data) - {"defaults", "models"}:
        raise PresetError(f"--presets {path}: the file holds a [defaults] table and [models.NAME] tables, got "
                          f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
    defaults, models = data.get("defaults", {}), data.get("models", {})
    if not isinstance(defaults, dict) or not isinstance(models, dict) or not all(
            isinstance(v, dict) for v in models.values()):
        raise PresetError(f"--presets {path}: [defaults] and each [models.NAME] must be tables of settings")
    base = file.parent
    return _settings(defaults, base, f"{path} [defaults]"), {
        name: _settings(values, base, f"{path} [models.{name}]") for name, values in models.items()}


_PATHS = ("model", "tokenizer", "draft_model", "download_dir")
_CHOICES = {"pooling": ("last", "mean", "cls"), "structured_whitespace": ("compact", "flexible"),
            "generation_config": ("auto", "vllm")}
_FLAGS = ("strict_json_schema", "special_tokens_in_content", "speculative_ngram", "enable_prefix_caching")


def _settings(values: Mapping[str, Any], base: Path, where: str) -> dict[str, Any]:
    """One section's settings, checked by key; paths resolved against `base` where they exist there."""
    known = (*LOAD_FIELDS, *ENGINE_FIELDS, *SERVER_FIELDS, *OTHER_FIELDS)
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise PresetError(f"{where}: unknown setting(s) {unknown}; the settings are {', '.join(known)}")
    out = dict(values)
    for key in _PATHS:
        if isinstance(out.get(key), str) and (base / out[key]).expanduser().exists():
            out[key] = str((base / out[key]).expanduser())
    for key, allowed in _CHOICES.items():
        if key in out and out[key] not in allowed:
            raise PresetError(f"{where}: {key} = {out[key]!r}; use one of {', '.join(allowed)}")
    for key in _FLAGS:
        if key in out and not isinstance(out[key], bool):
            raise PresetError(f"{where}: {key} is true or false, got {out[key]!r}")
    for key in ("kv_cache_memory",):
        if key in out:
            try:
                out[key] = size_bytes(out[key])
            except ValueError as e:
                raise PresetError(f"{where}: {key}: {e}") from None
    if "aliases" in out and not (isinstance(out["aliases"], list) and all(isinstance(a, str) and a for a in
                                                                           out["aliases"])):
        raise PresetError(f"{where}: aliases is a list of names, got {out['aliases']!r}")
    if "default_chat_template_kwargs" in out and not isinstance(out["default_chat_template_kwargs"], dict):
        raise PresetError(f"{where}: default_chat_template_kwargs is a table of template variables")
    if "chat_template" in out:
        out["chat_template"] = _template(out["chat_template"], base, where)
    return out


def _template(value: Any, base: Path, where: str) -> str:
    """A chat_template setting: the template's text, or a file of it (relative to the presets file)."""
    if not isinstance(value, str) or not value:
        raise PresetError(f"{where}: chat_template is a Jinja template or the path of a .jinja file")
    if "{{" in value or "{%" in value:
        return value
    file = (base / value).expanduser()
    if not file.is_file():
        raise PresetError(f"{where}: chat_template {value!r} is neither a template nor a file")
    return file.read_text()


def build_catalog(models: Iterable[str], dirs: Iterable[str | os.PathLike] = (), hf_cache: bool = False,
                  presets: str | os.PathLike | None = None, base: LoadSpec | None = None,
                  aliases: Iterable[str] = ()) -> list[ModelChoice]:
    """The served models, in order: the --model flags', each --models-dir's, the cache's, then the presets file's
    own; each with its preset settings. `base`: the command line's load flags (model unset); `aliases`: more
    names of a single --model (--served-model-name's others). Names must be unique."""
    base = base or LoadSpec()
    defaults, sections = read_presets(presets) if presets is not None else ({}, {})
    found: list[tuple[str, str | None]] = []  # (name, model); None: the presets' own `model`
    for value in models:
        name, model = named(value)
        found.append((name or default_name(model), model))
    for folder in dirs:
        found.extend((name, str(path)) for name, path in models_in(folder))
    if hf_cache:
        found.extend((name, str(path)) for name, path in cached_models(base.download_dir))
    given = {name for name, _ in found}
    found.extend((name, None) for name, section in sections.items() if name not in given and "model" in section)
    if not found:  # no model named anywhere: the packaged one, as `nexttoken serve` alone serves
        found.append((PACKAGED_NAME, None))
    unused = sorted(set(sections) - {name for name, _ in found})
    if unused:
        raise PresetError(f"--presets {presets}: [models.{unused[0]}] names no served model and gives no `model` "
                          f"to load; the served models are {', '.join(n for n, _ in found) or 'none'}")
    choices = [_choice(name, model, {**defaults, **sections.get(name, {})}, base) for name, model in found]
    choices = _with_aliases(choices, tuple(aliases))
    _check_unique(choices)
    return choices


def _choice(name: str, model: str | None, settings: Mapping[str, Any], base: LoadSpec) -> ModelChoice:
    load = {k: v for k, v in settings.items() if k in LOAD_FIELDS}
    if model is not None:
        load["model"] = model
    try:
        spec = base.replace(**load)
    except (TypeError, ModelLoadError) as e:
        raise PresetError(f"model {name!r}: {e}") from None
    engine = {k: v for k, v in settings.items() if k in ENGINE_FIELDS}
    for size, other in (("kv_cache_memory", "num_kv_blocks"), ("num_kv_blocks", "kv_cache_memory")):
        if size in engine:  # its own pool size replaces the command line's, whichever flag that was
            engine.setdefault(other, None)
    return ModelChoice(name, spec, tuple(settings.get("aliases", ())), engine,
                       {k: v for k, v in settings.items() if k in SERVER_FIELDS}, settings.get("chat_template"),
                       {k: v for k, v in settings.items() if k in ("speculative_ngram", "num_speculative_tokens")})


def _with_aliases(choices: list[ModelChoice], aliases: tuple[str, ...]) -> list[ModelChoice]:
    if not aliases:
        return choices
    if len(choices) != 1:
        raise PresetError("--served-model-name names one model: with several, name each with --model NAME=PATH "
                          "or give its aliases in the presets file")
    first, *more = aliases
    return [dataclasses.replace(choices[0], name=first, aliases=(*more, *choices[0].aliases))]


def _check_unique(choices: list[ModelChoice]) -> None:
    seen: dict[str, str] = {}
    for choice in choices:
        for name in choice.names:
            if name in seen:
                raise PresetError(f"two models answer to the name {name!r} ({seen[name]} and "
                                  f"{choice.spec.model}): name them apart with --model NAME=PATH")
            seen[name] = str(choice.spec.model)
