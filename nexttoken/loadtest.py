"""`nexttoken loadtest`: the older name of `nexttoken bench load` (nexttoken/bench/load.py), kept as an alias for
the command line and for imports from `nexttoken.loadtest`."""

from __future__ import annotations

import argparse

from .bench.load import RequestResult, RunReport, ServerWatch, make_prompts, one_request, plot, run, run_load, summarize
from .bench.load import add_parser as _add_load_parser

__all__ = ["RequestResult", "RunReport", "ServerWatch", "add_parser", "make_prompts", "one_request", "plot", "run",
           "run_load", "summarize"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `nexttoken loadtest`, the same command as `nexttoken bench load`."""
    _add_load_parser(sub, name="loadtest")
