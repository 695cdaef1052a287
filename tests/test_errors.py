"""Every typed error nexttoken defines derives from `nexttoken.errors.NextTokenError`, so one `except
NextTokenError` catches whatever the package raises on purpose (each keeps the builtin its callers catch)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import nexttoken
from nexttoken.errors import NextTokenError


def _modules() -> list:
    """Every module of the package, imported (`__main__` aside: importing it runs the command line)."""
    names = [m.name for m in pkgutil.walk_packages(nexttoken.__path__, "nexttoken.") if not m.name.endswith("__main__")]
    return [importlib.import_module(name) for name in names]


def test_every_exception_class_derives_from_the_base_error() -> None:
    defined = {(cls.__module__, cls.__qualname__): cls for module in _modules()
               for _, cls in inspect.getmembers(module, inspect.isclass)
               if issubclass(cls, BaseException) and cls.__module__.startswith("nexttoken")}
    assert len(defined) > 15, sorted(defined)  # the walk found the package's errors
    stray = sorted(f"{m}.{q}" for (m, q), cls in defined.items() if not issubclass(cls, NextTokenError))
    assert not stray, f"exception classes outside NextTokenError: {stray}"


def test_errors_keep_the_builtins_their_callers_catch() -> None:
    from nexttoken.engine.async_engine import EngineClosedError, EngineDeadError
    from nexttoken.model.kernels import NativeKernelError

    for cls in (NativeKernelError, EngineDeadError, EngineClosedError):
        assert issubclass(cls, RuntimeError) and issubclass(cls, NextTokenError), cls
