"""llama.cpp's GGUF converter (convert_hf_to_gguf.py), the reference writer of GGUF files for the families it knows.

`scripts/setup.sh test` puts it in .venv/share/llama.cpp (scripts/llama_cpp_converter.sh: Python files from the
pinned llama-cpp-python source release; nothing built). `convert` runs it in a subprocess with its own gguf-py, as a
user would run it, on a Hugging Face folder (which needs a tokenizer the converter recognises: `with_tokenizer`
copies one of the shared real tokenizers into a tiny model's folder).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONVERTER_DIR = Path(os.environ.get("NEXTTOKEN_LLAMA_CPP_CONVERTER", ROOT / ".venv" / "share" / "llama.cpp"))


class ConverterMissing(RuntimeError):
    pass


def converter() -> Path:
    """The converter script; a clear error naming the setup step when it is not there."""
    script = CONVERTER_DIR / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise ConverterMissing(f"llama.cpp's convert_hf_to_gguf.py is not at {script}: run "
                               "`bash scripts/llama_cpp_converter.sh` (part of `make setup-test`)")
    return script


def template(name: str) -> str:
    """A real chat template from llama.cpp's models/templates (e.g. "Qwen3.5-4B")."""
    return (CONVERTER_DIR / "models" / "templates" / f"{name}.jinja").read_text()


def with_tokenizer(folder: Path, tokenizer_dir: Path) -> Path:
    """Copy a real tokenizer's files into a model folder, so that the converter can write its vocabulary. The
    model's vocab_size must cover the tokenizer's ids (the converter pads a larger embedding table)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "vocab.json", "merges.txt"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def convert(folder: Path, out: Path, outtype: str = "f32", extra: tuple[str, ...] = ()) -> Path:
    """Convert a Hugging Face folder to GGUF with llama.cpp's converter; `outtype` is one of its --outtype values
    (f32, f16, bf16, q8_0, ...). Raises with the converter's own output when it fails."""
    env = dict(os.environ, PYTHONPATH=str(CONVERTER_DIR / "gguf-py"), NO_LOCAL_GGUF="")
    done = subprocess.run([sys.executable, str(converter()), str(folder), "--outfile", str(out), "--outtype",
                           outtype, *extra], capture_output=True, text=True, env=env, cwd=CONVERTER_DIR)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {folder} ({done.returncode}):\n"
                           f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return out


def config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())
