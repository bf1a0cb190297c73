"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 section 2.2): `model.mtp_depth` = D
sequential modules after the last block, module d (1..D) predicting, at position i, the
token d + 1 places after the next one.

    h⁰ = the main model's last hidden state after its final norm (what the head reads)
    hᵈ_i = norm_d(Block_d(eh_proj_d([enorm_d(Emb(t_{i+d})) ; hnorm_d(hᵈ⁻¹_i)])))
    logitsᵈ_i = Head(hᵈ_i), target t_{i+d+1}

The embedding and the head are the model's own (shared, as in DeepSeek-V3); each module has
its two input norms, the projection of their concatenation (embedding first, as DeepSeek's
checkpoints and transformers order it), one decoder block of the last block's kind and the
norm before the head. The block attends over the same positions and documents as the main
model (rotary attention depends only on relative positions, so using the token's position
i + d instead would change nothing).

Targets: t_{i+d} and t_{i+d+1} are the micro-batch's tokens and targets shifted left by d;
the last d positions of a row have none, and a packed row never predicts across a document
boundary: position i takes no MTP loss unless t_{i+d} is in i's document (its target is then
in that document too, or IGNORE, as the main loss's is).

Loss: train.mtp_weight / D × Σ_d (the token loss of module d, in the task's sum form), added
to the objective through the step's `RoutingLog` (model/moe.py), as the MoE balance loss is,
so every schedule divides it by the step's target count with the token loss. The per-module
sums are kept for the metrics (`mtp_loss`: Σ over modules / D per target). Evaluation and
generation do not run the modules (generation ignores them; no speculative decoding).

The MTP block's MoE (if it has one) routes with its own router; its routing statistics join
the step's MoE table as block "mtp.d" (the metrics' `moe` entry: loads, max violation, dead
experts, and the balance term it would have, `aux_loss`), but it adds no balance loss to the
objective and its selection bias is not updated by `train.moe_bias_rate`.

Layouts (proofs: tests/test_deepseek_layouts.py, tests/test_mtp_layouts.py):
- one process, data parallelism and ZeRO-1/2/3: the modules are part of the model;
- pipelines (1F1B, ZB, DualPipeV, ...): the modules live on the last stage with the head. The
  embedding reaches them as a copy that chunk holds (`Transformer.mtp_embeddings`, the tied
  head's weight itself when the embeddings are tied), initialised to the embedding's values
  (model/init.py), marked a duplicate (counted once by the gradient norm, never written by
  checkpoints, read back from `tok_embeddings.weight`); after the backward its gradient and
  the first stage's embedding gradient are summed (pipeline/stage.py `TiedEmbedding`, as a
  tied head's are), so both copies take the same step and stay equal. The token ids need no
  message: every stage has the micro-batch;
- context parallelism (ring, all-gather, Ulysses): module d at position i reads token i + d,
  which another cp rank may hold (the zigzag layout, parallel/context/layout.py), so the
  inputs and targets of every module are computed from the whole rows before the
  permutation (`lookahead`, `context.shard(..., mtp_depth)`) and permuted with the rest;
  the hidden states never move (hᵈ_i depends on hᵈ⁻¹ at the same position); the modules'
  attention cores are the context-parallel ones;
- expert parallelism: the MTP block's experts are split over ep as the main blocks' are
  (parallel/expert.py `parallelize`);
- tensor parallelism (± sequence parallelism): the modules' blocks split as the main ones,
  their input norms and projection whole on every rank (parallel/tensor_mtp.py). h⁰ and each
  module's output are read by the next module *before* the head's region entry (the entry's
  backward all-reduces over tp, which would sum the modules' gradient, whole on every rank,
  tp times; under SP the stream is the rank's positions); the head reads them after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from .args import ModelArgs
from .moe import RoutingLog

IGNORE = -100


class MTPModule(nn.Module):
    """`block`: a decoder block of the last block's kind; `norm`: the RMSNorm class (both
    from model/llama.py, which builds these modules)."""

    def __init__(self, args: ModelArgs, block: nn.Module, norm: type):
        super().__init__()
        self.enorm = norm(args.dim, args.norm_eps)
        self.hnorm = norm(args.dim, args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = block
        self.norm = norm(args.dim, args.norm_eps)

    def forward(self, h: Tensor, e: Tensor, cos: Tensor, sin: Tensor, doc_ids: Tensor | None = None,
                stats=None, key: str = "") -> Tensor:
        """(hᵈ as the head reads it, hᵈ as the next module reads it): the output norm's, the
        same tensor but under tensor parallelism (parallel/tensor_mtp.py), where the head's is
        after its region entry and the next module's before. `stats`: a RoutingLog that
        records its MoE's routing statistics under `key`."""
        x = self.eh_proj(torch.cat((self.enorm(e), self.hnorm(h)), dim=-1))
        y = self.block(x, cos, sin, layer_key=key, doc_ids=doc_ids, routing=stats)
        out = self.norm(y)
        return out, (self.norm.normed(y) if hasattr(self.norm, "normed") else out)


@dataclass
class MTPStep:
    """What the training step gives the model for its MTP losses: the task's loss function,
    the weight, the current micro-batch (set by the schedule before each forward), and the
    per-module loss sums of the step (detached)."""

    loss_fn: object
    weight: float
    batch: object = None
    sums: dict[int, Tensor] = field(default_factory=dict)


def shift(t: Tensor, d: int, fill) -> Tensor:
    """t [b, s] moved d places left, the last d positions `fill`."""
    return torch.cat((t[:, d:], t.new_full((t.shape[0], d), fill)), dim=1)


def depth_batch(mb, d: int):
    """The micro-batch of module d: tokens t_{i+d}, targets t_{i+d+1} (IGNORE past the row's
    end or where t_{i+d} is in another document than position i). From the batch's
    `mtp_tokens`/`mtp_targets` where `lookahead` attached them (context parallelism), else
    by shifting the batch's own rows (whole rows: one process, data parallelism, ZeRO,
    pipelines)."""
    if mb.mtp_tokens is not None:
        return replace(mb, tokens=mb.mtp_tokens[..., d - 1], targets=mb.mtp_targets[..., d - 1])
    targets = shift(mb.targets, d, IGNORE)
    if mb.doc_ids is not None:
        targets = targets.masked_fill(shift(mb.doc_ids, d, -1) != mb.doc_ids, IGNORE)
    weights = shift(mb.weights, d, 0.0) if mb.weights is not None else None
    return replace(mb, tokens=shift(mb.tokens, d, 0), targets=targets, weights=weights)


def lookahead(mb, depth: int):
    """`mb` (whole rows) with every module's input tokens and targets attached
    ([b, s, depth]), so a layout that permutes or splits the positions (context parallelism's
    zigzag, parallel/context/layout.py) gives each position what `depth_batch` would have
    given it from the whole row: token t_{i+d} may sit in a chunk another rank holds. Per-
    token loss weights (RL, DPO, which refuse multi-token prediction) are not carried."""
    if mb.weights is not None:
        raise ValueError("multi-token prediction's lookahead carries no per-token loss weights")
    parts = [depth_batch(mb, d) for d in range(1, depth + 1)]
    return replace(mb, mtp_tokens=torch.stack([p.tokens for p in parts], -1),
                   mtp_targets=torch.stack([p.targets for p in parts], -1))


def hidden_states(model, h: Tensor, tokens_of, cos: Tensor, sin: Tensor, doc_ids: Tensor | None, stats=None):
    """Yield (d, hᵈ as the head reads it) for d = 1..D from h⁰; `tokens_of(d)`: module d's
    input tokens [b, s].
    `stats`: where the modules' MoE blocks record their routing (as "mtp.d")."""
    for d, module in enumerate(model.mtp.values(), start=1):
        out, h = module(h, model.embed(tokens_of(d)), cos, sin, doc_ids, stats, f"mtp.{d}")
        yield d, out


def statistics_only(routing: RoutingLog) -> RoutingLog:
    """A log that writes the routing statistics into `routing`'s tables and asks for no
    balance loss (the MTP block's MoE: module docstring)."""
    return RoutingLog(0.0, routing.keep, routing.counts, routing.balance, routing.dropped)


def add_losses(model, h: Tensor, cos: Tensor, sin: Tensor, doc_ids: Tensor | None, routing: RoutingLog) -> None:
    """The MTP losses of the current micro-batch into `routing.pending` (the step's model
    losses), the MoE blocks' statistics into its tables."""
    step = routing.mtp
    batches = {d: depth_batch(step.batch, d) for d in range(1, len(model.mtp) + 1)}
    total = None
    for d, hd in hidden_states(model, h, lambda d: batches[d].tokens, cos, sin, doc_ids, statistics_only(routing)):
        loss = step.loss_fn(model.output(hd), batches[d])
        step.sums[d] = step.sums.get(d, 0.0) + loss.detach().double()
        total = loss if total is None else total + loss
    routing.pending.append(total * (step.weight / len(model.mtp)))


@torch.no_grad()
def predict(model, tokens: Tensor) -> list[Tensor]:
    """The logits of every MTP module [b, s, vocab] for `tokens` [b, s] (positions 0..s−1,
    one document per row): module d's row i predicts t_{i+d+1}."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    cos, sin = model.rotary(positions)
    h = model.embed(tokens)
    for key, layer in model.layers.items():
        h = layer(h, cos, sin, None, key)
    h = model.norm(h)
    return [model.output(hd) for _, hd in hidden_states(model, h, lambda d: shift(tokens, d, 0), cos, sin, None)]
