"""The loss of a step: a sum over target tokens, divided by the step's global target count.

Every micro-batch of every rank divides its *sum* by the same global count, the number of
targets (positions whose target is not IGNORE) in the whole global batch, across
micro-batches, data-parallel and context-parallel ranks. Summing those gradients over the
ranks then gives exactly the single-device gradient of the mean loss, whatever the layout,
and the same rule covers pretraining, SFT masks (IGNORE on prompt tokens) and RL, whose
per-token `weights` (a normalisation, an advantage) multiply each token's loss.

A loss has two halves with two owners (`TokenLoss`):
- the *layout* computes each token's negative log-likelihood from the logits it holds
  (`token_nll` here; tensor parallelism swaps in a vocabulary-parallel one);
- the *task* turns those into the micro-batch's loss sum (its *objective*): the weighted
  sum `weighted_sum` for pretraining and SFT; RL's policy-gradient objectives read the
  micro-batch's advantages and recorded log-probabilities too (train/rl/losses.py).

**Chunked logits** (`train.loss_chunk` = C > 0). The [b, s, vocab] logits of a micro-batch
(and, in backward, their gradient, and the fp32 log-softmax cross-entropy keeps) are the
largest activation of a small model with a large vocabulary. With C > 0 they never exist
whole: the model hands its final features and its head to `chunked_nll`
(`TokenLoss.model_kwargs`: the `head_fn` of `Transformer.forward`, called inside the
model's forward so ZeRO-3 holds the head's weights gathered), which applies head and
per-token loss to C positions at a time and keeps only each chunk's losses; backward
recomputes one chunk's logits at a time (activation checkpointing of the chunk,
`torch.utils.checkpoint`), so at most one chunk's [C, vocab] logits and gradient live at
once. Under tensor parallelism each chunk is this rank's vocabulary columns and the
vocabulary-parallel loss (its all-reduces run per chunk, in the same order on every tp
rank, again in backward). The losses are the same numbers as the whole logits' (each
position's loss reads only its own row of logits); the head's gradient is a sum over
chunks instead of one matmul, equal up to rounding (tests/test_loss_chunks.py, fp64).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ndtrain.data.batch import IGNORE, MicroBatch
from ndtrain.model.llama import widened


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each position's next-token cross-entropy [b·s] (0 where the target is IGNORE), in
    fp32 (fp64 for fp64 logits)."""
    return F.cross_entropy(widened(logits.flatten(0, -2)), targets.flatten(), ignore_index=IGNORE, reduction="none")


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of next-token cross-entropies (times `weights`, if given) over the targets that
    are not IGNORE, in fp32 (fp64 for fp64 logits)."""
    logits, targets = widened(logits.flatten(0, -2)), targets.flatten()
    if weights is None:
        return F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    losses = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="none")
    return (losses * weights.flatten().to(losses.dtype)).sum()


def weighted_sum(nll: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """The objective of pretraining and SFT: Σ nll (times the micro-batch's weights, if any)."""
    return nll.sum() if mb.weights is None else (nll * mb.weights.flatten().to(nll.dtype)).sum()


def chunked_nll(features: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                nll: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], targets: torch.Tensor,
                chunk: int) -> torch.Tensor:
    """Each position's `nll(head(features), targets)` [b·s], `chunk` positions at a time:
    no chunk's logits outlive it, and under autograd each chunk is recomputed in backward."""
    x, t = features.flatten(0, -2), targets.flatten()
    train = torch.is_grad_enabled() and x.requires_grad

    def one(xc: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
        return nll(head(xc), tc)
    parts = [checkpoint(one, x[i:i + chunk], t[i:i + chunk], use_reentrant=False) if train
             else one(x[i:i + chunk], t[i:i + chunk]) for i in range(0, len(t), chunk)]
    return torch.cat(parts)


@dataclass
class TokenLoss:
    """The schedule's loss: `objective(nll(logits, targets), micro_batch)`, a sum. With
    `chunk` > 0 the model's output is already each position's nll (`model_kwargs`)."""

    nll: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_nll
    objective: Callable[[torch.Tensor, MicroBatch], torch.Tensor] = weighted_sum
    chunk: int = 0  # positions per chunk of the head and the loss; 0: the whole logits at once

    def model_kwargs(self, mb: MicroBatch) -> dict:
        """What the model's forward (its last stage's) takes besides its inputs: under
        chunking, the function its features and head go to (`chunked_nll`)."""
        if not self.chunk:
            return {}
        return {"head_fn": functools.partial(chunked_nll, nll=self.nll, targets=mb.targets, chunk=self.chunk)}

    def token_nll(self, out: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """Each position's nll [b·s] from the model's output (logits, or under chunking the nll)."""
        return out.flatten() if self.chunk else self.nll(out, mb.targets)

    def __call__(self, out: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        return self.objective(self.token_nll(out, mb), mb)

    def logprobs(self, out: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """log p(target) at every position [b, s] (0 where the target is IGNORE)."""
        return -self.token_nll(out, mb).view(mb.targets.shape)


def count_targets(targets: torch.Tensor) -> int:
    return int((targets != IGNORE).sum())
