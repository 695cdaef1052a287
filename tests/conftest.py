"""Shared test helpers: where the `shared/` data folder is, and how tests skip without it."""

from pathlib import Path

import pytest
import torch

# The `shared` folder beside the repository root (tokenizers, tiny models, reference outputs).
SHARED_DIR = (Path(__file__).resolve().parents[1] / ".." / "shared").resolve()

requires_shared = pytest.mark.skipif(
    not SHARED_DIR.is_dir(), reason=f"needs the shared data folder at {SHARED_DIR} (beside the repository root)"
)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The shared data folder; skips the test when it is absent."""
    if not SHARED_DIR.is_dir():
        pytest.skip(f"needs the shared data folder at {SHARED_DIR} (beside the repository root)")
    return SHARED_DIR


@pytest.fixture
def one_thread():
    """torch on one thread for the test: tiny models are overhead-bound, and one thread avoids spin-waiting on a
    shared 2-core machine. A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SMOLLM2_GGUF = SHARED_DIR / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_dir(shared_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct (a real instruction model) as a Hugging Face folder: float32 safetensors, tokenizer and
    chat template, dequantized from the shared Q4_1 GGUF by transformers' own GGUF loader (the shared
    make_folder.py, ~30 s). Written once per session; `NEXTTOKEN_TEST_CACHE` keeps it across sessions."""
    import os
    import subprocess
    import sys

    cache = os.environ.get("NEXTTOKEN_TEST_CACHE")
    out = Path(cache) / "smollm2-135m-instruct" if cache else tmp_path_factory.mktemp("smollm2") / "model"
    if not (out / "model.safetensors").is_file():
        script = SMOLLM2_GGUF.parent / "make_folder.py"
        subprocess.run([sys.executable, str(script), str(out)], check=True, capture_output=True, timeout=600)
    return out
