"""Reading safetensors tensors straight into their final place, with no second copy of the checkpoint.

A safetensors file is an 8-byte little-endian header length, a JSON header naming every tensor's dtype, shape
and byte range, then the bytes. The header (checked first by safetensors' own `safe_open`) says where each
tensor lies, so every weight is read with pread() into its slot of the model's one weight arena (memory.py):
q/k/v and gate/up are read one after another into the rows of their fused matrix, and a tensor stored in the
dtype it is wanted in lands in place with no temporary at all. A dtype change (a bf16 file loaded as float32, a
float32 file as bf16 weights) goes through a small bounded buffer (CAST_CHUNK_BYTES). Load peak: the weights
as built plus that buffer.

Why not keep the tensors memory-mapped from the file (what llama.cpp does, and what safetensors' mmap would
allow for the unfused ones)? The mapped pages count in the process's resident memory just as the arena does,
so it saves no memory once the weights have been read; it saves the copy at load (about 0.1 s per GB from the
page cache) but costs decode speed (4 KiB file pages instead of the arena's 2 MiB huge pages: 9% slower
streaming, memory.py), the fused matrices would still need their own memory, and a mapping of a file that is
truncated or rewritten in place (a re-download into the same path) turns later reads into SIGBUS crashes.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ...errors import ModelLoadError

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
CAST_CHUNK_BYTES = 8 << 20  # the buffer a dtype-changing read goes through, a piece at a time


@dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes lie in a safetensors file."""

    file: Path
    dtype: torch.dtype  # (the safetensors name, e.g. "I64", for a dtype the loader does not read)
    shape: tuple[int, ...]
    start: int  # absolute byte offset of its first byte in the file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_headers(files: list[Path]) -> dict[str, Entry]:
    """Every tensor of the checkpoint's files by name (headers only: no tensor bytes are read)."""
    entries: dict[str, Entry] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu"):  # safetensors' own header checks
                pass
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{f} is not a readable safetensors file ({e}); re-download or re-export it") from e
        for name, info in header.items():
            if name == "__metadata__":
                continue
            entries[name] = Entry(f, DTYPES.get(info["dtype"], info["dtype"]), tuple(info["shape"]),
                                  8 + size + info["data_offsets"][0])
    return entries


def check_dtypes(entries: dict[str, Entry]) -> None:
    """Every tensor is of a float dtype the loader reads (others, e.g. integer buffers, are named)."""
    for name, e in entries.items():
        if not isinstance(e.dtype, torch.dtype):
            raise ModelLoadError(f"{e.file}: tensor {name} is stored as {e.dtype}; nexttoken reads weights stored as "
                                 f"{', '.join(DTYPES)}")


def stored_dtype(entries: dict[str, Entry]) -> torch.dtype:
    """The dtype that holds most of the checkpoint's bytes (its matrices'): what "a bf16 checkpoint" means."""
    total: dict[torch.dtype, int] = {}
    for e in entries.values():
        total[e.dtype] = total.get(e.dtype, 0) + e.numel * e.dtype.itemsize
    return max(total, key=total.__getitem__)


class Reader:
    """Open files of a checkpoint, read from by pread (no shared file position; no mapping kept)."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def fill(self, dest: torch.Tensor, parts: list[Entry]) -> None:
        """dest (a contiguous CPU tensor) <- the parts concatenated along dim 0, cast to dest's dtype."""
        assert dest.is_contiguous() and dest.device.type == "cpu"
        flat = dest.view(-1)
        assert flat.numel() == sum(p.numel for p in parts), (dest.shape, [p.shape for p in parts])
        offset = 0
        for part in parts:
            self._read(flat[offset : offset + part.numel], part)
            offset += part.numel

    def _read(self, dest: torch.Tensor, part: Entry) -> None:  # dest: (numel,) of any float dtype
        fd = self._fds.get(part.file)
        if fd is None:
            fd = self._fds[part.file] = os.open(part.file, os.O_RDONLY)
        if part.dtype == dest.dtype:  # the bytes as they are: read into place
            self._pread(fd, dest, part.start, part.file)
            return
        step = max(1, CAST_CHUNK_BYTES // part.dtype.itemsize)
        buffer = torch.empty(min(step, part.numel), dtype=part.dtype)
        for i in range(0, part.numel, step):
            n = min(step, part.numel - i)
            self._pread(fd, buffer[:n], part.start + i * part.dtype.itemsize, part.file)
            dest[i : i + n].copy_(buffer[:n])  # bf16 <-> float32 as torch rounds: to nearest, ties to even

    @staticmethod
    def _pread(fd: int, dest: torch.Tensor, offset: int, path: Path) -> None:
        if dest.numel() == 0:
            return
        view = memoryview(dest.view(torch.uint8).numpy())  # (nbytes,) writable view of dest's memory
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)  # the kernel may return fewer bytes (>2 GiB reads)
            if got == 0:
                raise ModelLoadError(f"{path} ends before the tensors its header lists: the file is truncated; "
                                     "re-download it")
            done += got
