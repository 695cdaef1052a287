"""Optional packages: a feature that needs one says which install command brings it, in one line."""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingExtraError


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import `module`, or raise MissingExtraError naming `pip install 'nexttoken[extra]'`."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(
            f"{feature} needs the '{module}' package, which the base install does not carry: "
            f"pip install 'nexttoken[{extra}]'  (or: make test, which installs every extra)"
        ) from e
