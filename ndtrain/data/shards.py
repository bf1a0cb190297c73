"""Binary token shards: a 32-byte header followed by little-endian token ids.

Header layout (all little-endian):

    offset  size  field
    0       8     magic b"NDTOKENS"
    8       4     format version (uint32, currently 1)
    12      4     dtype code (uint32: 1 = uint16, 2 = uint32)
    16      8     token count (uint64)
    24      8     checksum: the first 8 bytes of the SHA-256 of the token bytes
                  (zero: none, a shard written before checksums existed)

The token count in the header lets a reader prove that a shard is complete: a file cut
short by a crash or a copy has the wrong size and is refused instead of silently
training on a truncated tail. The checksum catches what the size cannot, a byte changed in
place; reading a whole shard to check it costs a pass over its pages, so it is checked when
asked (`read_shard(path, verify=True)`: the command checks every shard once before a run
starts, see `PreparedData.verify`). Shards are read through ``np.memmap`` so a corpus
larger than memory costs only the pages a batch touches.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from pathlib import Path

import numpy as np

MAGIC = b"NDTOKENS"
VERSION = 1
HEADER = struct.Struct("<8sIIQ8s")
HEADER_BYTES = HEADER.size  # 32
DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}


class DataError(Exception):
    """Any problem with data: a corrupt shard, a bad corpus file, a short stream.

    The message is one line naming the file or value and the rule it breaks, so the CLI
    can print it as is.
    """


def write_shard(path: str | Path, tokens: np.ndarray) -> None:
    """Write ``tokens`` to ``path``, as uint16 when every id fits, else uint32.

    The file is written under a temporary name in the same directory and moved into
    place with ``os.replace``, so readers see either no shard or a whole one.
    """
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise DataError(f"shard {path}: tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 1 << 32):
        raise DataError(f"shard {path}: token ids must lie in [0, 2**32)")
    code = 1 if tokens.size == 0 or int(tokens.max()) < 1 << 16 else 2
    body = tokens.astype(DTYPES[code], copy=False)
    header = HEADER.pack(MAGIC, VERSION, code, body.size, checksum(body))

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(body.tobytes())
        os.chmod(tmp, 0o644)  # mkstemp makes the file private; a shard is ordinary data
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def checksum(body: np.ndarray) -> bytes:
    """The header's checksum of a shard's tokens (never all zero, which means "none")."""
    digest = hashlib.sha256(memoryview(np.ascontiguousarray(body)).cast("B")).digest()[:8]
    return digest if any(digest) else b"\x01" + digest[1:]


def read_shard(path: str | Path, verify: bool = False) -> np.ndarray:
    """Return the tokens of a shard as a read-only memmap, after checking its header (and,
    with `verify`, its tokens against the header's checksum: one pass over the file)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise DataError(f"shard {path}: cannot read ({e.strerror})") from None
    if len(raw) < HEADER_BYTES:
        raise DataError(
            f"shard {path}: file is {size} bytes, shorter than the {HEADER_BYTES}-byte header"
        )
    magic, version, code, count, stored = HEADER.unpack(raw)
    if magic != MAGIC:
        raise DataError(f"shard {path}: magic is {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise DataError(f"shard {path}: format version {version}, this reader knows {VERSION}")
    if code not in DTYPES:
        raise DataError(f"shard {path}: dtype code {code}, known codes are 1 (uint16) and 2 (uint32)")
    dtype = DTYPES[code]
    expected = HEADER_BYTES + count * dtype.itemsize
    if size != expected:
        raise DataError(
            f"shard {path}: file is {size} bytes but its header promises {count} tokens "
            f"of {dtype.name} ({expected} bytes)"
        )
    if count == 0:
        # np.memmap cannot map zero bytes; an empty read-only array behaves the same.
        empty = np.empty(0, dtype=dtype)
        empty.flags.writeable = False
        return empty
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))
    if verify and any(stored) and checksum(tokens) != stored:
        raise DataError(f"shard {path}: its tokens do not match the checksum in its header "
                        "(bytes changed on disk or in a copy); prepare the data again")
    return tokens
