"""Batch jobs in OpenAI's batch file format: `nexttoken run-batch` and the server's /v1/batches run a file of
requests through the server's own routes (lines.py: the format and resuming; runner.py: the run)."""

from .lines import ENDPOINTS, BatchError, BatchRequest, parse_requests, read_requests, resume
from .runner import run_requests, started

__all__ = ["ENDPOINTS", "BatchError", "BatchRequest", "parse_requests", "read_requests", "resume", "run_requests",
           "started"]
