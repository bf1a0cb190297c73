"""safetensors files, written as a stream with their checksum, and read a slice at a time.

The safetensors format is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw little-endian bytes. We write it
ourselves so that each tensor goes from memory to the file without an intermediate copy of
the whole file, and the SHA-256 of the file is computed over the same bytes on the way (no
second read; the hashing runs on a thread beside the writing). Reading maps a file into memory
and views the elements asked for, so only their pages are read and the one copy is into the
tensor being filled.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import struct
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
NAMES = {name: dtype for dtype, name in DTYPES.items()}
CHUNK = 8 << 20


def _bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().reshape(-1).contiguous().cpu()
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _safetensors_header(entries: list, metadata: dict[str, str] | None) -> tuple[bytes, int]:
    """The JSON header of a safetensors file of `entries` (padded to 8 bytes), and the bytes
    of its tensors."""
    header, offset = {}, 0
    for key, dtype, shape, *_ in entries:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8), offset  # the padding aligns the tensors' bytes


def safetensors_size(entries: list, metadata: dict[str, str] | None = None) -> int:
    """The bytes `write_safetensors(path, entries, metadata)` writes."""
    raw, data = _safetensors_header(entries, metadata)
    return 8 + len(raw) + data


def write_safetensors(path: Path, entries: list[tuple[str, torch.dtype, tuple, Callable[[], torch.Tensor]]],
                      metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Write `entries` (key, dtype, shape, fetch), fetching one tensor at a time, and fsync
    the file; returns its size in bytes and its SHA-256."""
    raw, _ = _safetensors_header(entries, metadata)
    digest, size = hashlib.sha256(), 0
    pending: queue.Queue = queue.Queue(maxsize=4)

    def hash_in_order():  # hashlib and file writes release the GIL: the two overlap
        while (buf := pending.get()) is not None:
            digest.update(buf)

    hasher = threading.Thread(target=hash_in_order, daemon=True)
    hasher.start()
    try:
        with open(path, "wb") as f:
            def put(buf: memoryview) -> None:
                nonlocal size
                pending.put(buf)
                f.write(buf)
                size += buf.nbytes

            put(memoryview(struct.pack("<Q", len(raw)) + raw))
            for key, dtype, shape, fetch in entries:
                t = fetch()
                if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                    raise ValueError(f"{key}: announced {dtype} {tuple(shape)}, got {t.dtype} {tuple(t.shape)}")
                put(_bytes(t))
            f.flush()
            os.fsync(f.fileno())  # on the disk before anyone renames the folder that holds it
    finally:
        pending.put(None)
        hasher.join()
    return size, digest.hexdigest()


def write_durably(path: Path, text: str) -> None:
    """Write a small text file and fsync it."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make the entries of a directory (files created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


MAX_HEADER = 100 << 20  # what the safetensors library itself accepts


class SafetensorsError(ValueError):
    """A file that is not a readable safetensors file: `reason` says why, `str` adds its name."""

    def __init__(self, path: Path, reason: str):
        self.reason = reason
        super().__init__(f"{Path(path).name}: {reason}")


def header_of(path: Path) -> dict:
    """The JSON header of a safetensors file (no tensor is read), every entry checked
    against the file: a known dtype, a shape of non-negative integers, and a byte range
    inside the file whose length is the shape's. Raises ValueError naming what is wrong (a
    truncated or corrupt file, a header length no file has): SafetensorsError."""
    header, _ = _header_and_start(Path(path))
    return header


def _header_and_start(path: Path) -> tuple[dict, int]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(path, f"not a safetensors file ({size} bytes, shorter than its header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, size - 8):
            raise SafetensorsError(path, f"not a safetensors file, or truncated: its header claims {n} bytes, "
                                         f"the file has {size}")
        try:
            header = json.loads(f.read(n).decode())
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise SafetensorsError(path, "not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise SafetensorsError(path, "not a safetensors file: its header is not a JSON object")
    data = size - 8 - n
    for key, info in header.items():
        if key != "__metadata__":
            problem = _entry_problem(info, data)
            if problem:
                raise SafetensorsError(path, f"tensor {key!r} {problem} (a corrupt or truncated file)")
    return header, 8 + n


def _entry_problem(info, data_bytes: int) -> str | None:
    """Why a header entry cannot be read from `data_bytes` bytes of data (None: it can)."""
    if not isinstance(info, dict) or info.get("dtype") not in NAMES:
        return f"has no dtype of {', '.join(NAMES)}"
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        return f"has the shape {shape!r}, not a list of non-negative integers"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        return f"has the byte range {offsets!r}"
    nbytes = math.prod(shape) * torch.empty((), dtype=NAMES[info["dtype"]]).element_size()
    if not 0 <= offsets[0] <= offsets[1] or offsets[1] - offsets[0] != nbytes:
        return f"has the byte range {offsets}, its shape {shape} and dtype {info['dtype']} need {nbytes} bytes"
    if offsets[1] > data_bytes:
        return f"ends at byte {offsets[1]} of the data, the file holds {data_bytes}"
    return None


class Reader:
    """safetensors files mapped into memory once each; a read is a view of the mapping, so the
    only copy is the one into the tensor being filled, and only the pages it touches are read
    from disk."""

    def __init__(self):
        self._open: dict[Path, tuple[np.memmap, dict, int]] = {}

    def _file(self, path: Path):
        if path not in self._open:
            header, start = _header_and_start(Path(path))
            size = path.stat().st_size
            data = np.memmap(path, dtype=np.uint8, mode="c", offset=start, shape=(size - start,)) \
                if size > start else np.zeros(0, np.uint8)
            self._open[path] = (data, header, start)
        return self._open[path]

    def read(self, path: Path, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of tensor `key`, in row-major order (a view, no copy)."""
        data, header, _ = self._file(path)
        info = header[key]
        dtype = NAMES[info["dtype"]]
        size = torch.empty((), dtype=dtype).element_size()
        begin = info["data_offsets"][0] + lo * size
        raw = torch.from_numpy(data[begin:begin + (hi - lo) * size])
        if begin % size:  # a tensor after one of an odd byte length: not aligned for a view
            raw = raw.clone()
        return raw.view(dtype)

    def close(self) -> None:
        self._open.clear()
