"""The layout is the architecture (docs/architecture.md): every import points down the layers, never up."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nexttoken"

# Each part of the package and the parts it may import (besides itself). Lower layers first.
BASE = {"errors", "config"}
TEXT = {"tokenizer", "chat_template", "detokenizer"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "extras": {"errors"},
    "config": {"errors"},
    "model": BASE,
    "tokenizer": {"errors", "chat_template"},
    "chat_template": {"errors"},
    "detokenizer": {"errors", "tokenizer"},
    "generation": BASE | TEXT | {"model"},
    "engine": BASE | TEXT | {"model", "generation"},
    "pretrained": BASE | TEXT | {"model", "generation"},
    "tools": BASE | TEXT | {"generation"},
    "llm": BASE | TEXT | {"model", "generation", "engine", "pretrained", "tools"},
    "server": BASE | TEXT | {"model", "generation", "engine", "pretrained", "tools"},
}
# The shells on top may use everything: the CLI, benchmarks, the load generator, the training recipe.
TOP = {"cli", "__main__", "__init__", "bench", "loadtest", "training"}


def _part(module: str) -> str:
    """'nexttoken.engine.llm_engine' -> 'engine'; 'nexttoken.llm' -> 'llm'."""
    return module.split(".")[1] if module.count(".") >= 1 else module


def _imports(path: Path) -> set[str]:
    """Absolute names of the nexttoken modules a file imports (relative imports resolved)."""
    module = "nexttoken." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
                names = [target] if node.module else [f"{base}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith("nexttoken."))
    return found


FILES = sorted(p for p in PACKAGE.rglob("*.py") if _part("nexttoken." + ".".join(p.relative_to(PACKAGE).parts)
                                                           .removesuffix(".py")) not in TOP)


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(PACKAGE)) for p in FILES])
def test_imports_point_down(path: Path) -> None:
    part = _part("nexttoken." + ".".join(path.relative_to(PACKAGE).parts).removesuffix(".py"))
    assert part in ALLOWED, f"{path}: a new part of the package; place it in a layer (docs/architecture.md)"
    upward = sorted(m for m in _imports(path) if _part(m) != part and _part(m) not in ALLOWED[part])
    assert not upward, f"{path.relative_to(PACKAGE)} ({part}) imports {upward}: an import up the layers"


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The rule can fail: a generation module importing the engine is caught."""
    bad = PACKAGE / "generation" / "_probe_upward.py"
    bad.write_text("from ..engine import LLMEngine\n")
    try:
        assert "nexttoken.engine" in _imports(bad)
        assert "engine" not in ALLOWED["generation"]
    finally:
        bad.unlink()
