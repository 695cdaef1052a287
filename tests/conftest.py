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
