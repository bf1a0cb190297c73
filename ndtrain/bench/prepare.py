"""`ndtrain bench prepare`: our prepare against a bare `tokenizers` loop over the same files.

Both sides tokenize the same corpus (data.path, default the standard library) with the same
tokenizer.json (data.tokenizer; by default the BPE that `ndtrain prepare` trains on the
corpus, prepared once beforehand and not timed) and write the tokens to disk.

- ours: `prepare_data` into a fresh cache folder each round: the split plan's pass, the
  tokenization on data.workers processes (0: one per core), shards with checksums, the
  unigram counts, meta.json: everything `ndtrain prepare` does.
- bare: one process reads each file (a JSONL line or a whole file is a document; empty ones
  skipped, as prepare skips them), calls the
  tokenizer's `encode_batch_fast` (its fastest documented call: no offsets; the thread pool
  of tokenizers on, as it is by default, so the anchor uses every core too) on batches of
  512 documents, and appends the ids as uint32 to one file.

Alternating rounds; the figure is kB of corpus text per second; the last line is ours over
bare. data.workers reaches ours only: the processes are what is measured.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from ndtrain.bench.common import Bench, alternate, announce, bench_config, report

BATCH_DOCS = 512
BENCH = Bench("prepare", (), ("run.progress=false",),
              ("data.path", "data.tokenizer", "data.vocab_size", "data.text_key", "data.workers", "data.cache_dir",
               "data.val_fraction"))


def bare_encode(source: str, tokenizer_json: Path, text_key: str, out: Path) -> int:
    """The anchor: read, `encode_batch_fast`, append uint32 ids; returns the token count."""
    from tokenizers import Tokenizer

    from ndtrain.data.corpus import source_files
    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.encode_special_tokens = True  # as ours: a document's text is text
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    eot = tok.token_to_id("<|endoftext|>")
    tokens, batch = 0, []
    with open(out, "wb") as f:
        def flush() -> int:
            flat: list[int] = []
            for e in encode(batch, add_special_tokens=False):
                flat += e.ids
                flat.append(eot)
            np.array(flat, dtype=np.uint32).tofile(f)
            batch.clear()
            return len(flat)

        def documents():
            for path in source_files(source)[1]:
                if path.suffix == ".jsonl":
                    with open(path, encoding="utf-8", errors="replace") as lines:
                        yield from (t for line in lines if line.strip() and (t := json.loads(line)[text_key]))
                elif text := path.read_bytes().decode("utf-8", errors="replace"):
                    yield text

        for text in documents():
            batch.append(text)
            if len(batch) >= BATCH_DOCS:
                tokens += flush()
        if batch:
            tokens += flush()
    return tokens


def _cpu_timed(fn, into: list[float]):
    """`fn`, recording the CPU seconds of this process and its finished children per call."""
    import resource

    def cpu() -> float:
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                     resource.getrusage(resource.RUSAGE_CHILDREN)))

    def timed() -> None:
        start = cpu()
        fn()
        into.append(cpu() - start)
    return timed


def run(args) -> int:
    from ndtrain.data.corpus import source_files
    from ndtrain.data.encode import worker_count
    from ndtrain.data.prepare import PreparedData, prepare_data

    args.nproc = 1  # the worker processes are data.workers'
    cfg = bench_config(args, BENCH)
    d = cfg.data
    tokenizer = Path(d.tokenizer).expanduser() if d.tokenizer else None
    if tokenizer is None:  # the corpus's own BPE, trained (and cached) once, not timed
        prepared = prepare_data(d.path, "", d.vocab_size, d.val_fraction, d.cache_dir, d.text_key, progress=False)
        tokenizer = PreparedData.open(prepared).path / "tokenizer.json"
    corpus_bytes = sum(p.stat().st_size for p in source_files(d.path)[1])
    workers = worker_count(d.workers, corpus_bytes)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    announce(args, cfg, f"bench prepare: ndtrain prepare ({workers} worker process{'es' if workers > 1 else ''}) vs a "
                        f"bare tokenizers encode_batch_fast loop (1 process) · {d.path} ({corpus_bytes / 1e6:.1f} MB) · "
                        f"{args.rounds} rounds × {args.steps}, alternating · {os.cpu_count()} cores, load average "
                        f"{load} before the start")
    scratch = Path(tempfile.mkdtemp(prefix="ndtrain-bench-prepare-"))
    try:
        def ours() -> None:
            out = scratch / "ours"
            prepare_data(d.path, str(tokenizer), d.vocab_size, d.val_fraction, out, d.text_key, progress=False,
                         workers=workers)
            shutil.rmtree(out)

        def bare() -> None:
            bare_encode(d.path, tokenizer, d.text_key, scratch / "bare.bin")
            (scratch / "bare.bin").unlink()

        cpu = {"ndtrain prepare": [], "encode_batch": []}
        times = alternate({name: _cpu_timed(fn, cpu[name]) for name, fn in
                           (("ndtrain prepare", ours), ("encode_batch", bare))}, args.rounds, args.steps,
                          torch.device("cpu"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    # CPU seconds do not depend on what else the machine runs as much as wall time does.
    print("CPU time per pass (the process and its workers), median: " + ", ".join(
        f"{name} {float(np.median(c)):.2f} s" for name, c in cpu.items()), flush=True)
    print(report(times, corpus_bytes / 1e3, "kB/s", "ndtrain prepare/encode_batch", "ndtrain prepare",
                 "encode_batch"), flush=True)
    return 0
