"""The forward + backward peak of the output head and loss, whole logits against chunks
(train.loss_chunk, model/loss.chunked_nll), at vocabulary 32,768, on the CPU meter
(observe/memory.CpuPeak: every storage created, exactly; no timing).

    PYTHONPATH=. python benchmarks/loss_chunks.py [ROWS SEQ DIM]

One block of a model of width DIM (fp32), ROWS × SEQ positions; the peak above what the
model and its inputs hold. The last line: the smallest chunk's peak over the whole logits'."""

from __future__ import annotations

import sys

import torch

from ndtrain.data.batch import MicroBatch
from ndtrain.model.args import ModelArgs
from ndtrain.model.llama import Transformer
from ndtrain.model.loss import TokenLoss
from ndtrain.observe.memory import measure_peak

VOCAB = 32768


def peak(model: Transformer, mb: MicroBatch, chunk: int) -> int:
    loss_fn = TokenLoss(chunk=chunk)
    model.zero_grad(set_to_none=False)
    with measure_peak(torch.device("cpu")) as out:
        loss_fn(model(mb.tokens, **loss_fn.model_kwargs(mb)), mb).backward()
    return out["bytes"]


def main(rows: int = 8, seq: int = 256, dim: int = 256) -> None:
    args = ModelArgs(dim=dim, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=VOCAB, max_seq_len=seq,
                     ffn_dim=4 * dim)
    model = Transformer(args)
    model.init_weights(0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (rows, seq), generator=g)
    mb = MicroBatch(tokens, torch.randint(0, VOCAB, (rows, seq), generator=g))
    logits = rows * seq * VOCAB * 4
    print(f"head + loss, forward and backward: {rows} rows × {seq} positions, dim {dim}, vocab {VOCAB}, fp32; "
          f"the logits alone: {logits / 2**20:.1f} MiB")
    whole = peak(model, mb, 0)
    print(f"{'whole logits':>14}: {whole / 2**20:8.1f} MiB")
    ratio = 1.0
    for chunk in (1024, 512, 256, 128):
        p = peak(model, mb, chunk)
        ratio = p / whole
        print(f"{'chunk ' + str(chunk):>14}: {p / 2**20:8.1f} MiB  ({ratio:.3f} of the whole)")
    print(f"ndtrain chunked/whole logits peak ratio: {ratio:.3f}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
