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


def write_safetensors(path: Path, entries: list[tuple[str, torch.dtype, tuple, Callable[[], torch.Tensor]]],
                      metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Write `entries` (key, dtype, shape, fetch), fetching one tensor at a time, and fsync
    the file; returns its size in bytes and its SHA-256."""
    header, offset = {}, 0
    for key, dtype, shape, _ in entries:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # aligns the tensors' bytes
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


def header_of(path: Path) -> dict:
    """The JSON header of a safetensors file (no tensor is read)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


class Reader:
    """safetensors files mapped into memory once each; a read is a view of the mapping, so the
    only copy is the one into the tensor being filled, and only the pages it touches are read
    from disk."""

    def __init__(self):
        self._open: dict[Path, tuple[np.memmap, dict, int]] = {}

    def _file(self, path: Path):
        if path not in self._open:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            size = path.stat().st_size
            data = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + n, shape=(size - 8 - n,)) \
                if size > 8 + n else np.zeros(0, np.uint8)
            self._open[path] = (data, header, 8 + n)
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
