"""The server's files (`/v1/files`): batch inputs uploaded by clients and the batches' output and error files, kept
in memory within a byte budget (a server restart forgets them, as it forgets its batches)."""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..http.errors import APIError, bad_request

# what a file here is for: an upload is a batch's input, or an image a Responses input_image names by file_id
PURPOSES = ("batch", "batch_output", "vision", "user_data")
DEFAULT_BUDGET_BYTES = 1 << 30  # every file's bytes together


@dataclass
class StoredFile:
    id: str
    filename: str
    purpose: str
    data: bytes
    created_at: int

    def object(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {"id": self.id, "object": "file", "bytes": len(self.data), "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


class FileStore:
    """Files by id, oldest first; adding one past the budget is refused (nothing is dropped behind a batch's
    back): delete files to make room."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.files: OrderedDict[str, StoredFile] = OrderedDict()

    @property
    def bytes(self) -> int:
        return sum(len(f.data) for f in self.files.values())

    def add(self, filename: str, purpose: str, data: bytes) -> StoredFile:
        if purpose not in PURPOSES:
            raise bad_request(f"purpose {purpose!r} is not one this server keeps files for: use \"batch\" (or "
                              "\"vision\" for an image)", "purpose")
        if self.bytes + len(data) > self.budget_bytes:
            raise bad_request(f"the file store is full ({self.bytes} of {self.budget_bytes} bytes): delete files "
                              "(DELETE /v1/files/{id}) to make room", "file")
        stored = StoredFile(f"file-{uuid.uuid4().hex}", filename, purpose, data, int(time.time()))
        self.files[stored.id] = stored
        return stored

    def get(self, file_id: str, param: str = "file_id") -> StoredFile:
        if file_id not in self.files:
            raise APIError(404, f"no file {file_id!r}: see GET /v1/files", param, code="file_not_found")
        return self.files[file_id]

    def delete(self, file_id: str) -> dict[str, Any]:
        self.get(file_id)
        del self.files[file_id]
        return {"id": file_id, "object": "file", "deleted": True}

    def listing(self, purpose: str | None = None) -> dict[str, Any]:
        data = [f.object() for f in reversed(self.files.values()) if purpose is None or f.purpose == purpose]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": False}
