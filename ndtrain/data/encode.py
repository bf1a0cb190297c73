"""Tokenizing a stream of documents on worker processes, in order, in bounded memory.

The reading process cuts the stream into chunks of about `CHUNK_BYTES` of text and hands
them to `workers` processes (forked, see `_context`; each builds its own tokenizer, with
tokenizers' own thread pool off: one process per core, not cores × threads). Each
worker encodes its chunk with `encode_batch_fast` and returns the chunk's tokens as one
uint32 array per split, each document as `bos_ids + ids + [eot_id]`. Results come back in
the order the chunks went out, so the shards are the same for any number of workers, and at
most `2 × workers` chunks are in flight: memory is bounded by the chunk size, not the corpus.

With one worker the chunks are encoded in the reading process (tokenizers' threads then do
what parallelism there is), which is also what a small corpus gets: below
`MIN_BYTES_PER_WORKER` of text each, starting processes and copying the text to them costs
more than it saves. A worker that dies (killed for memory) is a DataError, not a hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from ndtrain.data.shards import DataError

# 256 KB: small enough that the last chunks, which only some workers get, leave little idle
# time (a 1 MB chunk is ~0.3 s of one core), large enough that handing one over costs nothing.
CHUNK_BYTES = 1 << 18
MIN_BYTES_PER_WORKER = 2 << 20
IN_FLIGHT_PER_WORKER = 2


@dataclass
class Encoded:
    """One chunk's result: tokens per split (document order), its documents and UTF-8 bytes."""

    train: np.ndarray
    val: np.ndarray
    documents: int
    text_bytes: int


class ChunkEncoder:
    """A tokenizer and its document rule; picklable as its JSON, so a worker can rebuild it."""

    def __init__(self, tokenizer_json: str, eot_id: int, bos_ids: tuple[int, ...]):
        from tokenizers import Tokenizer
        self.spec = (tokenizer_json, eot_id, tuple(bos_ids))
        self._tok = Tokenizer.from_str(tokenizer_json)
        self._tok.encode_special_tokens = True  # a document's text is text, never control tokens
        self._encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        self.eot_id, self.bos = eot_id, list(bos_ids)

    def __call__(self, chunk: list[tuple[bool, str]]) -> Encoded:
        """`chunk`: (is_validation, text) per document."""
        texts = [text for _, text in chunk]
        flat: dict[bool, list[int]] = {False: [], True: []}
        for (is_val, _), e in zip(chunk, self._encode(texts, add_special_tokens=False)):
            out = flat[is_val]
            out += self.bos
            out += e.ids
            out.append(self.eot_id)
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        return Encoded(np.array(flat[False], dtype=np.uint32), np.array(flat[True], dtype=np.uint32),
                       len(chunk), size)


_WORKER: ChunkEncoder | None = None


def _start_worker(spec: tuple, parent: int) -> None:
    global _WORKER
    _die_with(parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core: no threads inside
    _WORKER = ChunkEncoder(*spec)


def _die_with(parent: int) -> None:
    """A worker ends when the reading process does, even killed (SIGKILL has no cleanup, and
    a forked worker holds the write end of its own task queue, so it would wait forever):
    Linux's PR_SET_PDEATHSIG, then a check that the parent did not die before it was set."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the pool's own shutdown still ends workers
        return
    if os.getppid() != parent:
        os._exit(1)


def _encode_in_worker(chunk: list[tuple[bool, str]]) -> Encoded:
    return _WORKER(chunk)


def chunks(documents: Iterable[tuple[bool, str]], chunk_bytes: int | None = None) -> Iterator[list]:
    """Consecutive documents grouped into lists of about `chunk_bytes` characters."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    chunk, size = [], 0
    for item in documents:
        chunk.append(item)
        size += len(item[1])
        if size >= chunk_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def encode_stream(encoder: ChunkEncoder, documents: Iterable[tuple[bool, str]], workers: int,
                  chunk_bytes: int | None = None) -> Iterator[Encoded]:
    """Each chunk's `Encoded`, in stream order, from `workers` processes (1: this one)."""
    if workers <= 1:
        for chunk in chunks(documents, chunk_bytes):
            yield encoder(chunk)
        return
    with ProcessPoolExecutor(workers, mp_context=_context(), initializer=_start_worker,
                             initargs=(encoder.spec, os.getpid())) as pool:
        pending: deque = deque()
        try:
            for chunk in chunks(documents, chunk_bytes):
                pending.append(pool.submit(_encode_in_worker, chunk))
                if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool:
            raise DataError(f"a tokenizing worker process died (out of memory?); with data.workers = "
                            f"{workers}, try fewer") from None
        finally:
            for future in pending:
                future.cancel()


def _context():
    """fork where there is one: a worker starts in milliseconds, imports nothing, and cannot
    run the caller's script again (spawn re-imports `__main__`, and a script without an
    `if __name__ == "__main__"` guard would prepare again in every worker). The reading
    process may hold threads (torch's, tokenizers'): the worker uses none of their state (it
    builds its own tokenizer, with tokenizers' threads off), as torch's DataLoader workers,
    forked from the same kind of process, do not."""
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def worker_count(requested: int, corpus_bytes: int) -> int:
    """`data.workers` (0: every core), at most one per `MIN_BYTES_PER_WORKER` of corpus."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if requested:
        return requested
    return max(1, min(cores, corpus_bytes // MIN_BYTES_PER_WORKER))
