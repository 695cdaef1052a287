"""A GGUF file's header read in one pass: its metadata as Python values and its tensors as views of one memory map.

The `gguf` package's GGUFReader builds a numpy view per header field and per string, which is fine for
hyperparameters but not for a tokenizer's vocabulary: a 151,936-token Qwen3 file takes it 8-25 s (~3 million
numpy views), where llama.cpp opens the file in well under a second. This reader walks the same layout
(ggml's gguf.md: magic, version, counts, key/value pairs, tensor infos, aligned data) with `struct` over the mapped
bytes, decoding string arrays in one native pass (`strings`) and numeric arrays with one `np.frombuffer` each,
and returns what GGUFReader returns for the parts nexttoken reads: `field.contents()`'s values and `ReaderTensor`s
whose `data` are the same views of a copy-on-write map (tests/model/weights/test_gguf_reader.py holds it to
GGUFReader on real files). A big-endian file, which this reader does not decode, is handed to GGUFReader.
"""

from __future__ import annotations

import ctypes
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import NextTokenError

# GGUF value types (gguf.md): id -> struct format of a scalar, numpy dtype of an array of them
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}  # tensor types GGUFReader returns as elements; the others as (..., row bytes) uint8


class BigEndian(NextTokenError):
    """The file is big-endian: read it with the gguf package instead."""


def read_gguf(path: Path, mmap_file: bool = True) -> tuple[dict[str, Any], list[Any], np.ndarray]:
    """(metadata key -> value, [gguf.ReaderTensor], the file's copy-on-write map) of the file. Raises ValueError / struct.error / EOFError /
    UnicodeDecodeError on a damaged file, BigEndian for a file of the other byte order. mmap_file=False reads the
    whole file into anonymous memory instead of mapping it (llama.cpp's --no-mmap): the tensors no longer depend
    on the file, so truncating or replacing it cannot crash the process (SIGBUS on a mapped page past its end)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor
    from gguf.quants import quant_shape_to_byte_shape

    with path.open("rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        header = _Header(buf)
        metadata, infos = header.parse()
        alignment = int(metadata.get("general.alignment", 32))
        start = -(-header.at // alignment) * alignment  # the data section begins at the next aligned offset
    finally:
        buf.close()
    # copy-on-write: writable views, the file untouched (as GGUFReader's mode="c"); or a copy in anonymous memory
    data = np.memmap(path, mode="c") if mmap_file else np.fromfile(path, dtype=np.uint8)
    tensors, names = [], set()
    for name, dims, raw_type, offset in infos:
        if name in names:
            raise ValueError(f"Found duplicated tensor with name {name}")
        names.add(name)
        kind = GGMLQuantizationType(raw_type)
        n_elems = int(np.prod(dims))
        block, size = GGML_QUANT_SIZES[kind]
        n_bytes = n_elems * size // block
        at = start + offset
        shape = tuple(reversed(dims.tolist()))
        item = _PLAIN.get(kind.name)
        if item is None:
            item, count, shape = np.uint8, n_bytes, quant_shape_to_byte_shape(shape, kind)
        else:
            count = n_elems
        end = at + count * np.dtype(item).itemsize
        if end > data.shape[0]:
            raise EOFError(f"tensor {name} ends at byte {end}, past the file's {data.shape[0]}")
        view = data[at:end].view(item).reshape(shape)
        tensors.append(ReaderTensor(name=name, tensor_type=kind, shape=dims, n_elements=n_elems, n_bytes=n_bytes,
                                    data_offset=at, data=view, field=None))
    return metadata, tensors, data


def strings(buf: Any, at: int, n: int) -> tuple[list[str], int]:
    """The n strings of a GGUF string array whose first count is at byte `at` of `buf`, and the offset after them.
    One native pass (csrc/ggml.cpp's nt_gguf_strings: the counts walked and the strings joined by NUL bytes, then one
    decode and one split) where the kernel library is here: 49,152 tokens in ~5 ms where the loop below takes ~16.
    The loop where it is not, or where a string holds a NUL byte of its own."""
    lib = _library()
    if lib is not None:
        data = np.frombuffer(buf, dtype=np.uint8)
        try:
            end = lib.nt_gguf_strings(data.ctypes.data, data.size, at, n, None, None, None)
            if end < 0:
                raise EOFError("a string runs past the end of the file")
            joined, length, nul = np.empty(max(end - at, 1), np.uint8), ctypes.c_int64(), ctypes.c_int()
            lib.nt_gguf_strings(data.ctypes.data, data.size, at, n, joined.ctypes.data, ctypes.byref(length),
                                ctypes.byref(nul))
        finally:
            del data  # the map can be closed only once no view of it is left (an exception's frame included)
        if not nul.value:
            return (str(memoryview(joined)[:length.value], "utf-8").split("\0") if n else []), end
    out, unpack = [], struct.Struct("<Q").unpack_from
    for _ in range(n):
        (size,) = unpack(buf, at)
        at += 8
        if at + size > len(buf):
            raise EOFError("a string runs past the end of the file")
        out.append(buf[at:at + size].decode("utf-8"))
        at += size
    return out, at


def _library() -> Any:
    """The native kernel library, or None (model/kernels.py: not built here, or switched off)."""
    from ..kernels import library

    return library()


class _Header:
    """A cursor over the header's bytes."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.at = buf, 0

    def parse(self) -> tuple[dict[str, Any], list[tuple[str, np.ndarray, int, int]]]:
        magic, version = struct.unpack_from("<4sI", self.buf, 0)
        if magic != b"GGUF":
            raise ValueError(f"not a GGUF file (magic {magic!r})")
        if version & 0xFFFF == 0:  # the version read in the wrong byte order
            raise BigEndian
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")
        self.at = 8
        n_tensors, n_kv = self.scalar("Q"), self.scalar("Q")
        # GGUFReader lists the header's counts as fields too
        metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        for _ in range(n_kv):
            key = self.string()
            metadata[key] = self.value(self.scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name = self.string()
            n_dims = self.scalar("I")
            dims = np.array(struct.unpack_from(f"<{n_dims}Q", self.buf, self.at), dtype=np.uint64)
            self.at += 8 * n_dims
            infos.append((name, dims, self.scalar("I"), self.scalar("Q")))
        return metadata, infos

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        end = self.at + n
        if end > len(self.buf):
            raise EOFError("a string runs past the end of the file")
        text = self.buf[self.at:end].decode("utf-8")
        self.at = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            sub, n = self.scalar("I"), self.scalar("Q")
            if sub == _STRING:  # a vocabulary, or merges
                out, self.at = strings(self.buf, self.at, n)
                return out
            if sub == _ARRAY:
                return [self.value(_ARRAY) for _ in range(n)]
            dtype = np.dtype(_NUMPY[sub]).newbyteorder("<")
            values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.at)
            self.at += n * dtype.itemsize
            return values.tolist()
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.scalar(_SCALARS[kind])
