"""safetensors files, written as a stream with their checksum, and read a slice at a time.

The safetensors format is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw little-endian bytes. We write it
ourselves so that each tensor goes from memory to the file without an intermediate copy of
the whole file, and the SHA-256 of the file is computed over the same bytes on the way (no
second read). Reading goes through `safetensors.safe_open`, whose `get_slice` reads only the
rows asked for.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
CHUNK = 8 << 20


def _bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().reshape(-1).contiguous().cpu()
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def write_safetensors(path: Path, entries: list[tuple[str, torch.dtype, tuple, Callable[[], torch.Tensor]]],
                      metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Write `entries` (key, dtype, shape, fetch), fetching one tensor at a time; returns the
    file's size in bytes and its SHA-256."""
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
    with open(path, "wb") as f:
        def put(buf: memoryview) -> None:
            nonlocal size
            f.write(buf)
            digest.update(buf)
            size += buf.nbytes

        put(memoryview(struct.pack("<Q", len(raw)) + raw))
        for key, dtype, shape, fetch in entries:
            t = fetch()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{key}: announced {dtype} {tuple(shape)}, got {t.dtype} {tuple(t.shape)}")
            put(_bytes(t))
    return size, digest.hexdigest()


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
    """Open safetensors files once each; read flat element ranges of their tensors."""

    def __init__(self):
        self._open: dict[Path, object] = {}

    def handle(self, path: Path):
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt", device="cpu")
        return self._open[path]

    def read(self, path: Path, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of tensor `key` in row-major order, reading only the rows they
        fall in."""
        part = self.handle(path).get_slice(key)
        shape = part.get_shape()
        if not shape:
            return part[...].reshape(-1)[lo:hi]
        inner = math.prod(shape[1:])
        r0, r1 = lo // inner, -(-hi // inner)
        rows = part[r0:r1].reshape(-1)
        return rows[lo - r0 * inner:hi - r0 * inner]

    def close(self) -> None:
        self._open.clear()
