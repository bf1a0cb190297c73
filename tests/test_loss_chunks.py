"""Chunked logits (train.loss_chunk, model/loss.chunked_nll): the same per-token losses and
gradients as the whole logits, and a peak far below theirs.

The layouts (dp2, ZeRO-3, tp2 with its vocabulary-parallel loss, pp2, cp2) run chunked in
the RL layout proof (tests/test_rl.py), against one unchunked process in fp64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ndtrain.data.batch import IGNORE, MicroBatch
from ndtrain.model.args import ModelArgs
from ndtrain.model.llama import Transformer
from ndtrain.model.loss import TokenLoss


def _model(vocab: int, softcap: float = 0.0, dtype=torch.float64) -> Transformer:
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=vocab, max_seq_len=64,
                     ffn_dim=64, logit_softcap=softcap)
    model = Transformer(args)
    model.init_weights(0)
    return model.to(dtype)


def _batch(vocab: int, rows: int, seq: int) -> MicroBatch:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (rows, seq), generator=g)
    targets = torch.randint(0, vocab, (rows, seq), generator=g)
    targets[:, :3] = IGNORE  # a prompt: no loss
    weights = torch.rand(rows, seq, generator=g, dtype=torch.float64)
    return MicroBatch(tokens, targets, weights=weights)


def _loss_and_grads(model: Transformer, mb: MicroBatch, chunk: int):
    model.zero_grad()
    loss_fn = TokenLoss(chunk=chunk)
    out = model(mb.tokens, **loss_fn.model_kwargs(mb))
    loss = loss_fn(out, mb)
    loss.backward()
    with torch.no_grad():
        logp = loss_fn.logprobs(model(mb.tokens, **loss_fn.model_kwargs(mb)), mb)
    return loss.detach(), logp, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_chunked_loss_equals_the_whole_logits_in_fp64(softcap):
    """Weighted loss, log-probabilities and every gradient of chunks of 7 positions (not a
    divisor of 2 × 20) equal the whole logits' in fp64, and those equal PyTorch's own
    cross-entropy of the full logits."""
    model, mb = _model(97, softcap), _batch(97, 2, 20)
    whole, logp_whole, g_whole = _loss_and_grads(model, mb, 0)
    native = (F.cross_entropy(model(mb.tokens).flatten(0, 1), mb.targets.flatten(), ignore_index=IGNORE,
                              reduction="none") * mb.weights.flatten()).sum()
    assert torch.allclose(whole, native, rtol=1e-14, atol=0)
    chunked, logp_chunked, g_chunked = _loss_and_grads(model, mb, 7)
    assert torch.allclose(chunked, whole, rtol=1e-13, atol=0), (chunked, whole)
    assert torch.allclose(logp_chunked, logp_whole, rtol=0, atol=1e-13)
    assert (logp_chunked[:, :3] == 0).all()
    for name, g in g_whole.items():
        scale = float(g.abs().max())
        assert scale > 0, name  # every parameter (the head, the embedding, the block) takes a gradient
        assert float((g_chunked[name] - g).abs().max()) <= 1e-12 * scale, name


@pytest.mark.slow
def test_chunked_logits_peak_is_under_a_third_of_the_whole_at_vocab_32k():
    """A one-block model at vocabulary 32,768, 4 rows × 64 positions, fp32: the whole
    logits' forward and backward peak against chunks of 32 positions (the CPU meter: peak
    bytes above what the model and its inputs hold). The whole logits
    alone are 4·64·32768·4 B = 32 MiB, and the loss keeps their log-softmax and the backward
    their gradient; a chunk holds an eighth of a row's worth."""
    model, mb = _model(32768, dtype=torch.float32), _batch(32768, 4, 64)
    from ndtrain.bench.logits import peak  # the measurement bench rl and benchmarks/loss_chunks.py report
    whole, chunked = peak(model, mb, 0), peak(model, mb, 32)
    logits = 4 * 64 * 32768 * 4
    assert whole >= 2 * logits, whole  # the whole logits and their log-softmax, at least
    assert chunked <= 0.3 * whole, (chunked, whole)
