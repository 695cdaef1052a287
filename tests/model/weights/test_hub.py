"""Hub ids resolved from a Hugging Face cache the test lays out in huggingface_hub's own layout (refs/, snapshots/,
blobs/), offline: org/name (a folder), org/name:TAG and --gguf-file (a GGUF file of the repository), --revision,
--download-dir on the command line, and the error for a model that is not there. Folders as transformers 5 writes
them (chat_template.jinja / .json, additional_chat_templates/)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.tiny_models import build_hf_model

import nexttoken
from nexttoken.errors import MissingFileError
from nexttoken.model.weights.hub import resolve_model

gguf = pytest.importorskip("gguf")
huggingface_hub = pytest.importorskip("huggingface_hub")

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD = "fedcba9876543210fedcba9876543210fedcba98"


def _lay_out(cache: Path, repo: str, files: dict[str, Path], commit: str = COMMIT, ref: str = "main") -> Path:
    """One snapshot in huggingface_hub's cache layout: blobs named by content hash, snapshot entries linking to
    them, refs/<ref> holding the commit."""
    root = cache / f"models--{repo.replace('/', '--')}"
    for name, src in files.items():
        data = src.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = root / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return root / "snapshots" / commit


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    from support.gguf_writer import write_model

    work = tmp_path_factory.mktemp("hub")
    hf = build_hf_model("llama")
    folder = work / "folder"
    hf.save_pretrained(folder)
    (folder / "pytorch_model.bin").write_bytes(b"a pickle nexttoken must never read")
    cache = work / "cache"
    _lay_out(cache, "tiny-org/tiny-llama", {f.name: f for f in folder.iterdir()})
    older = build_hf_model("llama", seed=1)
    older.save_pretrained(work / "older")
    _lay_out(cache, "tiny-org/tiny-llama", {f.name: f for f in (work / "older").iterdir()}, commit=OLD, ref="v0")
    write_model(work / "g" / "tiny-llama-q8_0.gguf", "llama", hf, "Q8_0")
    write_model(work / "g2" / "tiny-llama-f32.gguf", "llama", hf)
    _lay_out(cache, "tiny-org/tiny-llama-GGUF", {"tiny-llama-q8_0.gguf": work / "g" / "tiny-llama-q8_0.gguf",
                                                 "tiny-llama-F32.gguf": work / "g2" / "tiny-llama-f32.gguf"})
    return cache


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_hub_ids_resolve_from_the_cache(cache: Path, offline) -> None:
    src = resolve_model("tiny-org/tiny-llama", download_dir=cache)
    assert src.path.name == COMMIT and src.name == "tiny-org/tiny-llama"
    assert resolve_model("tiny-org/tiny-llama", revision="v0", download_dir=cache).path.name == OLD
    q8 = resolve_model("tiny-org/tiny-llama-GGUF:Q8_0", download_dir=cache)  # any letter case, as Ollama's tags
    assert q8.path.name == "tiny-llama-q8_0.gguf" and q8.name == "tiny-llama-q8_0" and q8.is_gguf
    f32 = resolve_model("tiny-org/tiny-llama-GGUF", gguf_file="tiny-llama-F32.gguf", download_dir=cache)
    assert f32.path.name == "tiny-llama-F32.gguf"
    ids = [3, 9, 27, 4]
    want = nexttoken.load(src.path).generate(ids, max_new_tokens=6, ignore_eos=True).token_ids
    llm = nexttoken.load("tiny-org/tiny-llama", download_dir=cache)
    assert llm.name == "tiny-org/tiny-llama"
    assert llm.generate(ids, max_new_tokens=6, ignore_eos=True).token_ids == want
    by_file = nexttoken.load("tiny-org/tiny-llama-GGUF", gguf_file="tiny-llama-F32.gguf", download_dir=cache)
    assert by_file.generate(ids, max_new_tokens=6, ignore_eos=True).token_ids == want


def test_a_missing_model_names_the_repo_the_cache_and_the_fix(cache: Path, offline) -> None:
    with pytest.raises(MissingFileError) as e:
        nexttoken.load("tiny-org/not-there", download_dir=cache)
    text = str(e.value)
    assert "tiny-org/not-there" in text and str(cache) in text and "HF_HUB_OFFLINE=1" in text
    assert f"hf download tiny-org/not-there --cache-dir {cache}" in text
    with pytest.raises(MissingFileError, match="no GGUF file matching"):
        resolve_model("tiny-org/tiny-llama-GGUF:Q4_K_M", download_dir=cache)
    with pytest.raises(MissingFileError, match="is not a Hugging Face Hub id"):
        nexttoken.load("./no/such/folder")


def test_the_command_line_names_a_missing_hub_model(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    missing = subprocess.run([sys.executable, "-m", "nexttoken", "generate", "--model", "tiny-org/gone",
                              "--download-dir", str(tmp_path), "hi"], capture_output=True, text=True, env=env,
                             timeout=300)
    assert missing.returncode == 2
    assert "nexttoken: error: model tiny-org/gone is not in the Hugging Face cache" in missing.stderr
    assert "Traceback" not in missing.stderr


# ---- folders as transformers 5 writes them ----------------------------------------------------------------------


def test_transformers5_template_files(tmp_path: Path) -> None:
    from nexttoken.text.tokenizer import Tokenizer

    src = Path(__file__).resolve().parents[3] / "nexttoken" / "default_model"
    folder = tmp_path / "m"
    shutil.copytree(src, folder)
    (folder / "chat_template.json").write_text('{"chat_template": "{{ messages[0][\'content\'] }}!"}')
    assert Tokenizer.from_dir(folder).apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}?")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("tools")
    tok = Tokenizer.from_dir(folder)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi?"
    assert tok.chat_templates["tool_use"] == "tools"


def test_tokenizer_override(cache: Path, tmp_path: Path, offline) -> None:
    from support.gguf_writer import write_model

    from nexttoken.errors import ModelLoadError
    from nexttoken.pretrained import DEFAULT_MODEL_DIR
    from nexttoken.text.tokenizer import Tokenizer

    with pytest.raises(ModelLoadError, match="its 2048 ids do not fit the model's vocabulary of 96"):
        nexttoken.load("tiny-org/tiny-llama-GGUF:Q8_0", download_dir=cache, tokenizer=DEFAULT_MODEL_DIR)
    write_model(tmp_path / "g" / "wide.gguf", "llama", build_hf_model("llama", vocab_size=2048))
    llm = nexttoken.load(tmp_path / "g" / "wide.gguf", tokenizer=DEFAULT_MODEL_DIR)
    assert llm.tokenizer.encode("Once upon a time") == Tokenizer.from_dir(DEFAULT_MODEL_DIR).encode("Once upon a time")
    assert llm.generate("Once upon a time", max_new_tokens=3, ignore_eos=True).token_ids


def test_lora_adapters_given_as_hub_ids_resolve_from_the_cache(cache: Path, offline, tmp_path: Path) -> None:
    """lora={name: "org/adapter"} (and the run-time load) reads a PEFT adapter from the Hub cache, as a folder
    would be read; one not in the cache is named with the command that fetches it."""
    pytest.importorskip("peft")
    from support.lora import make_adapter

    hf = build_hf_model("llama")
    base = tmp_path / "base"
    hf.save_pretrained(base)
    adapter = make_adapter(hf, tmp_path / "adapter", seed=3, r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"])
    (adapter / "adapter_model.bin").write_bytes(b"a pickle nexttoken must never read")
    _lay_out(cache, "tiny-org/tiny-lora", {f.name: f for f in adapter.iterdir()})
    ids = [3, 9, 27, 4]
    want = nexttoken.load(base, lora={"a": adapter}).generate(ids, max_new_tokens=6, ignore_eos=True,
                                                              lora="a").token_ids
    by_id = nexttoken.load(base, lora={"a": "tiny-org/tiny-lora"}, download_dir=cache)
    assert by_id.generate(ids, max_new_tokens=6, ignore_eos=True, lora="a").token_ids == want
    plain = nexttoken.load(base, max_loras=2).generate(ids, max_new_tokens=6, ignore_eos=True).token_ids
    assert want != plain  # the adapter changes the tokens, so the equality above says it was applied
    with pytest.raises(MissingFileError) as e:
        nexttoken.load(base, lora={"b": "tiny-org/no-such-lora"}, download_dir=cache)
    assert "tiny-org/no-such-lora" in str(e.value) and "hf download tiny-org/no-such-lora" in str(e.value)
