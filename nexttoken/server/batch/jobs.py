"""The server's batches (`/v1/batches`): a batch input file run through the server's own routes (runner.py, the
machinery of `nexttoken run-batch`) as a task on the server's loop, beside the live traffic; its answers become
an output file (2xx) and an error file (the rest), as OpenAI's batches do."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ..http.errors import APIError, bad_request
from .files import FileStore
from .lines import BatchError, parse_requests
from .runner import run_requests

log = logging.getLogger("nexttoken.server")
WINDOW = "24h"  # OpenAI's only completion window; a batch here runs at once, as fast as the engine goes


class BatchCreate(BaseModel):
    """POST /v1/batches' body."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None  # accepted; the files live until deleted or a restart


@dataclass
class BatchJob:
    """One batch: its request, its state and times (OpenAI's batch object), its task."""

    id: str
    body: BatchCreate
    total: int
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "in_progress"
    times: dict[str, int] = field(default_factory=dict)  # "in_progress_at", "completed_at", ...
    completed: int = 0
    failed: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    task: asyncio.Task | None = None

    def mark(self, status: str) -> None:
        self.status = status
        self.times[f"{status}_at"] = int(time.time())

    def object(self) -> dict[str, Any]:
        """OpenAI's batch object."""
        stamps = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
                  "cancelled_at")
        return {"id": self.id, "object": "batch", "endpoint": self.body.endpoint, "errors": None,
                "input_file_id": self.body.input_file_id, "completion_window": WINDOW, "status": self.status,
                "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": self.created_at, "expires_at": self.created_at + 24 * 3600,
                **{s: self.times.get(s) for s in stamps},
                "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
                "metadata": self.body.metadata}


class Batches:
    """The batches of one server, newest listed first; each runs through `app` (the server itself) with
    `headers` (its API key), `concurrency` requests in flight."""

    def __init__(self, files: FileStore, concurrency: int, headers: dict[str, str] | None = None) -> None:
        self.files, self.concurrency, self.headers = files, concurrency, headers
        self.jobs: dict[str, BatchJob] = {}

    def create(self, app: Any, body: BatchCreate) -> BatchJob:
        """Read the input file (a duplicate custom_id, or a file that is not text, is a 400 now) and start the
        run: the lines that are no request of the batch's endpoint are answered with their 400."""
        source = self.files.get(body.input_file_id, "input_file_id")
        try:
            requests = parse_requests(source.data.decode("utf-8").splitlines(), (body.endpoint,))
        except UnicodeDecodeError as e:
            raise bad_request(f"the input file {source.id!r} is not UTF-8 text: {e}", "input_file_id") from e
        except BatchError as e:
            raise bad_request(f"the input file {source.id!r}: {e}", "input_file_id") from e
        job = BatchJob(f"batch_{uuid.uuid4().hex}", body, len(requests))
        job.mark("in_progress")
        self.jobs[job.id] = job
        job.task = asyncio.create_task(self._run(app, job, requests))
        return job

    async def _run(self, app: Any, job: BatchJob, requests: list) -> None:
        answers: list[str] = []
        errors: list[str] = []

        def on_answer(line: dict[str, Any]) -> None:
            ok = 200 <= line["response"]["status_code"] < 300
            (answers if ok else errors).append(json.dumps(line, ensure_ascii=False) + "\n")
            job.completed, job.failed = job.completed + ok, job.failed + (not ok)

        try:
            await run_requests(app, requests, on_answer, self.concurrency, self.headers)
        except asyncio.CancelledError:
            self._finish(job, answers, errors, "cancelled")  # what was answered before the cancel is kept
            raise
        except Exception:  # noqa: BLE001 - this batch fails, the server goes on
            log.exception("batch %s failed", job.id)
            self._finish(job, answers, errors, "failed")
            return
        job.mark("finalizing")
        self._finish(job, answers, errors, "completed")

    def _finish(self, job: BatchJob, answers: list[str], errors: list[str], status: str) -> None:
        """The answers into the batch's output file (2xx) and error file (the rest); a full file store fails the
        batch (its log line says so)."""
        try:
            if answers:
                job.output_file_id = self.files.add(f"{job.id}_output.jsonl", "batch_output",
                                                    "".join(answers).encode()).id
            if errors:
                job.error_file_id = self.files.add(f"{job.id}_error.jsonl", "batch_output",
                                                   "".join(errors).encode()).id
        except APIError as e:
            log.error("batch %s: its answers could not be kept: %s", job.id, e.message)
            status = "failed"
        job.mark(status)

    def get(self, batch_id: str) -> BatchJob:
        if batch_id not in self.jobs:
            raise APIError(404, f"no batch {batch_id!r}: see GET /v1/batches", "batch_id", code="batch_not_found")
        return self.jobs[batch_id]

    async def cancel(self, batch_id: str) -> BatchJob:
        """Stop a running batch (its requests in flight are aborted); its answers so far are kept in its files."""
        job = self.get(batch_id)
        if job.task is not None and not job.task.done():
            job.mark("cancelling")
            job.task.cancel()
            await asyncio.gather(job.task, return_exceptions=True)
        return job

    def listing(self, after: str | None, limit: int) -> dict[str, Any]:
        jobs = list(reversed(self.jobs.values()))
        if after is not None:
            ids = [j.id for j in jobs]
            jobs = jobs[ids.index(after) + 1:] if after in ids else []
        page = [j.object() for j in jobs[:limit]]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(jobs) > limit}

    async def close(self) -> None:
        """The server stops: running batches are cancelled."""
        for job in list(self.jobs.values()):
            await self.cancel(job.id)
