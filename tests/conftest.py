"""Shared fixtures: where the `shared/` data folder is (and how tests skip without it), the real SmolLM2 as a
folder, and the stories260K server every server test drives. Helpers that are not fixtures live in `support/`."""

import gc
import json
from pathlib import Path

import pytest
import torch

import nexttoken
from support.server import CHAT_TEMPLATE, start_server, stop_server

# The `shared` folder beside the repository root (tokenizers, tiny models, reference outputs).
SHARED_DIR = (Path(__file__).resolve().parents[1] / ".." / "shared").resolve()

requires_shared = pytest.mark.skipif(
    not SHARED_DIR.is_dir(), reason=f"needs the shared data folder at {SHARED_DIR} (beside the repository root)"
)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Freeze the heap for the exit: the interpreter's last collection would walk every object of the session
    (torch, transformers, the models: ~10^6 objects, seconds on a busy machine) only to free memory the OS takes
    back anyway (as nexttoken's own command does: cli.exit_without_collecting)."""
    gc.freeze()


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


@pytest.fixture(scope="session")
def smollm2_server(shared_dir: Path):
    """The URL of the real SmolLM2 GGUF served with the default flags (its template renders no tools: requests with
    tools get Hermes' tools preamble), one per session for the modules that only send it requests
    (test_schema_defaults.py, test_anthropic_fields.py): a SmolLM2 server costs seconds to start."""
    proc, url = start_server(SMOLLM2_GGUF)
    yield url
    stop_server(proc)


# ---- the stories260K server (a chat template added) and the same model in this process ----------------------

@pytest.fixture(scope="session")
def model_dir(shared_dir, tmp_path_factory) -> Path:
    """stories260k with a chat template: the weights are symlinked, tokenizer_config.json gets the template (read
    only: one folder per session)."""
    src = shared_dir / "models" / "stories260k"
    folder = tmp_path_factory.mktemp("stories-chat")
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).symlink_to(src / name)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def server(model_dir):
    """One plain stories260K server for the session: the modules that use it only send it requests (each starts a
    server of its own where it needs other flags or stops it)."""
    proc, url = start_server(model_dir)
    yield url
    stop_server(proc)


@pytest.fixture(scope="session")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(model_dir):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield nexttoken.load(model_dir)
    torch.set_num_threads(before)
