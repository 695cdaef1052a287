"""The served models before loading (server/catalog.py): --model NAME=PATH, a --models-dir folder, the Hugging Face
cache's layout on disk, and a presets file's settings by name; each mistake refused at start-up with what to fix.
No model is loaded: the folders hold the files the catalog looks at."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nexttoken.errors import ModelLoadError
from nexttoken.loadspec import LoadSpec
from nexttoken.server.catalog import PresetError, build_catalog, cached_models, models_in, named, size_bytes


def _folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"\0" * 1000)
    return path


def test_model_flags_are_named_or_named_after_their_files(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "stories")
    (tmp_path / "tiny.Q4_K_M.gguf").write_bytes(b"GGUF" + b"\0" * 96)
    assert named(f"chat={folder}") == ("chat", str(folder))
    assert named(str(folder)) == (None, str(folder))
    assert named("Qwen/Qwen3-0.6B:Q4_K_M") == (None, "Qwen/Qwen3-0.6B:Q4_K_M")
    choices = build_catalog([str(folder), f"small={tmp_path / 'tiny.Q4_K_M.gguf'}", "org/model"])
    assert [c.name for c in choices] == ["stories", "small", "org/model"]
    assert [c.weight_bytes() for c in choices] == [1000, 100, 0]  # a Hub id not on disk: unknown until loaded
    assert build_catalog([])[0].spec.model is None  # nothing named: the packaged model, as before


def test_a_models_dir_lists_folders_and_gguf_files(tmp_path: Path) -> None:
    _folder(tmp_path / "models" / "a-folder")
    (tmp_path / "models" / "b.gguf").write_bytes(b"GGUF")
    split = tmp_path / "models" / "c-split"
    split.mkdir()
    for name in ("mmproj-c.gguf", "c-00001-of-00002.gguf", "c-00002-of-00002.gguf"):
        (split / name).write_bytes(b"GGUF")
    (tmp_path / "models" / "notes.txt").write_text("not a model")
    found = models_in(tmp_path / "models")
    assert [(n, p.name) for n, p in found] == [("a-folder", "a-folder"), ("b", "b.gguf"),
                                               ("c-split", "c-00001-of-00002.gguf")]
    with pytest.raises(PresetError, match="not a folder"):
        models_in(tmp_path / "missing")


def test_the_hugging_face_cache_as_it_lies_on_disk(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--org--chat"
    old, new = repo / "snapshots" / "aaa", repo / "snapshots" / "bbb"
    _folder(old), _folder(new)
    (new / "chat-Q8_0.gguf").write_bytes(b"GGUF")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("bbb")
    (tmp_path / "hub" / "datasets--org--data" / "snapshots" / "ccc").mkdir(parents=True)
    assert [(n, p) for n, p in cached_models(tmp_path / "hub")] == [("org/chat", new),
                                                                    ("org/chat:chat-Q8_0", new / "chat-Q8_0.gguf")]
    choices = build_catalog([], hf_cache=True, base=LoadSpec(download_dir=str(tmp_path / "hub")))
    assert [c.name for c in choices] == ["org/chat", "org/chat:chat-Q8_0"]


def test_presets_give_each_model_its_settings(tmp_path: Path) -> None:
    a, b = _folder(tmp_path / "a"), _folder(tmp_path / "presets" / "b")
    (tmp_path / "presets" / "chat.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    presets = tmp_path / "presets" / "models.toml"
    presets.write_text('[defaults]\nmax_num_seqs = 8\ntool_call_parser = "hermes"\n\n'
                       '[models.a]\naliases = ["small"]\nkv_cache_memory = "64MiB"\ndtype = "bfloat16"\n'
                       'chat_template = "chat.jinja"\n\n'
                       '[models.b]\nmodel = "b"\nmax_num_seqs = 2\nmax_model_len = 256\n')
    first, second = build_catalog([f"a={a}"], presets=presets, base=LoadSpec(threads=1))
    assert (first.name, first.aliases, first.spec.dtype, first.spec.threads) == ("a", ("small",), "bfloat16", 1)
    assert first.engine == {"max_num_seqs": 8, "kv_cache_memory": 64 << 20, "num_kv_blocks": None}
    assert first.server == {"tool_call_parser": "hermes"} and first.chat_template.startswith("{% for m")
    assert (second.name, second.spec.model) == ("b", str(b))  # the presets' own model, relative to the file
    assert second.engine == {"max_num_seqs": 2, "max_model_len": 256}
    as_json = tmp_path / "presets" / "models.json"
    as_json.write_text(json.dumps({"models": {"b": {"model": "b", "pooling": "mean"}}}))
    assert build_catalog([], presets=as_json)[0].server == {"pooling": "mean"}


@pytest.mark.parametrize("text, message", [
    ('[models.a]\nmax_num_seq = 8\n', "unknown setting"),
    ('[models.a]\npooling = "max"\n', "use one of last, mean, cls"),
    ('[models.a]\nkv_cache_memory = "lots"\n', "not a size in bytes"),
    ('[models.a]\ndtype = "float8"\n', "dtype='float8' is not supported"),
    ('[models.ghost]\nmax_model_len = 64\n', "names no served model"),
    ('[models.a\n', "not valid TOML"),
    ('[server]\nport = 1\n', "a \\[defaults\\] table and \\[models.NAME\\] tables"),
])
def test_preset_mistakes_are_refused_with_what_to_fix(tmp_path: Path, text: str, message: str) -> None:
    a = _folder(tmp_path / "a")
    presets = tmp_path / "p.toml"
    presets.write_text(text)
    with pytest.raises(ModelLoadError, match=message):
        build_catalog([f"a={a}"], presets=presets)


def test_names_are_unique_and_served_names_name_one_model(tmp_path: Path) -> None:
    a, b = _folder(tmp_path / "x" / "m"), _folder(tmp_path / "y" / "m")
    with pytest.raises(PresetError, match="two models answer to the name 'm'"):
        build_catalog([str(a), str(b)])
    assert build_catalog([str(a)], aliases=("main", "alias"))[0].names == ("main", "alias")
    with pytest.raises(PresetError, match="--served-model-name names one model"):
        build_catalog([str(a), f"other={b}"], aliases=("main",))
    assert size_bytes("512MiB") == 512 << 20 and size_bytes(7) == 7
