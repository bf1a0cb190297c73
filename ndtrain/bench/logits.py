"""The forward + backward peak of the output head and loss, whole logits against chunks
(train.loss_chunk, model/loss.chunked_nll), on the CPU meter (observe/memory.CpuPeak: every
storage created, exactly; no timing). `ndtrain bench rl` reports it; benchmarks/loss_chunks.py
prints the whole table.

One block of a model of width `dim` (fp32), `rows` × `seq` positions, vocabulary 32,768 by
default; the peak above what the model and its inputs hold."""

from __future__ import annotations

import torch

from ndtrain.data.batch import MicroBatch
from ndtrain.model.args import ModelArgs
from ndtrain.model.llama import Transformer
from ndtrain.model.loss import TokenLoss
from ndtrain.observe.memory import measure_peak

VOCAB = 32768


def peak(model: Transformer, mb: MicroBatch, chunk: int) -> int:
    """Bytes at the peak of one forward and backward with the loss in chunks of `chunk`
    positions (0: the whole logits)."""
    loss_fn = TokenLoss(chunk=chunk)
    model.zero_grad(set_to_none=False)
    with measure_peak(torch.device("cpu")) as out:
        loss_fn(model(mb.tokens, **loss_fn.model_kwargs(mb)), mb).backward()
    return out["bytes"]


def case(rows: int, seq: int, dim: int, vocab: int = VOCAB) -> tuple[Transformer, MicroBatch]:
    args = ModelArgs(dim=dim, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=vocab, max_seq_len=seq, ffn_dim=4 * dim)
    model = Transformer(args)
    model.init_weights(0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (rows, seq), generator=g)
    return model, MicroBatch(tokens, torch.randint(0, vocab, (rows, seq), generator=g))


def peaks(rows: int, seq: int, dim: int, chunks: tuple[int, ...]) -> dict[int, int]:
    """{chunk: peak bytes}, chunk 0 the whole logits, measured in this order."""
    model, mb = case(rows, seq, dim)
    return {c: peak(model, mb, c) for c in chunks}
