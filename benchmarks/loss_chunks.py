"""The forward + backward peak of the output head and loss, whole logits against chunks
(train.loss_chunk, model/loss.chunked_nll), at vocabulary 32,768, on the CPU meter
(observe/memory.CpuPeak: every storage created, exactly; no timing). The measurement is
ndtrain/bench/logits.py's, which `ndtrain bench rl` also reports.

    PYTHONPATH=. python benchmarks/loss_chunks.py [ROWS SEQ DIM]

One block of a model of width DIM (fp32), ROWS × SEQ positions; the peak above what the
model and its inputs hold. The last line: the smallest chunk's peak over the whole logits'."""

from __future__ import annotations

import sys

from ndtrain.bench.logits import VOCAB, peaks


def main(rows: int = 8, seq: int = 256, dim: int = 256) -> None:
    logits = rows * seq * VOCAB * 4
    print(f"head + loss, forward and backward: {rows} rows × {seq} positions, dim {dim}, vocab {VOCAB}, fp32; "
          f"the logits alone: {logits / 2**20:.1f} MiB")
    measured = peaks(rows, seq, dim, (0, 1024, 512, 256, 128))
    whole = measured.pop(0)
    print(f"{'whole logits':>14}: {whole / 2**20:8.1f} MiB")
    ratio = 1.0
    for chunk, p in measured.items():
        ratio = p / whole
        print(f"{'chunk ' + str(chunk):>14}: {p / 2**20:8.1f} MiB  ({ratio:.3f} of the whole)")
    print(f"ndtrain chunked/whole logits peak ratio: {ratio:.3f}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
