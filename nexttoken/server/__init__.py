"""`nexttoken serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

`build_app` and `ServerSettings` are imported on first use (PEP 562), so that `serve --help` (server/cli.py's
parser) does not import FastAPI, the engine and torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import build_app
    from .settings import ServerSettings

_LAZY = {"build_app": ".app", "ServerSettings": ".settings"}

__all__ = ["ServerSettings", "build_app"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
