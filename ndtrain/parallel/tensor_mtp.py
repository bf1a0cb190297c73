"""Tensor parallelism for the multi-token prediction modules (model/mtp.py): the swaps
parallel/tensor.py's PLAN adds for them.

- Each module's block is swapped as the main blocks are (its patterns are the main blocks'
  under `mtp.*.block.`; it is of the last block's kind, MoE or dense).
- Its input norms and the projection of their concatenation are whole on every rank: they
  run on the residual stream (this rank's positions under sequence parallelism, where their
  gradients are partial over tp; without it every rank computes the same thing).
- The norm before the head enters the head's region as the final norm does.
- The input embedding is the model's (vocabulary-parallel); a pipeline's last stage holds a
  vocabulary-parallel copy (`mtp_embeddings`).
- h⁰ is the final norm's output *before* the head's region entry (`RegionEntryNorm.normed`):
  the entry's backward all-reduces over tp (or reduce-scatters under SP), which would sum the
  modules' gradient, whole on every rank, tp times.
"""

from __future__ import annotations

from torch import nn

from ndtrain.parallel.placement import mark_partial


def _stream_linear(m: nn.Linear, c) -> nn.Module:
    """A linear layer on the residual stream, whole on every rank (eh_proj)."""
    m.weight = c.param(m.weight)
    if c.sp:
        mark_partial(m.weight, ("tp",))
    return m


def plan(main: dict, plain_norm, entry_norm, embedding) -> dict:
    """The MTP modules' entries, from the main blocks' (`main`: PLAN) and the swaps named."""
    out = {"mtp.*.block." + k[len("layers.*."):]: swap for k, swap in main.items() if k.startswith("layers.*.")}
    out.update({"mtp.*.enorm": plain_norm, "mtp.*.hnorm": plain_norm, "mtp.*.eh_proj": _stream_linear,
                "mtp.*.norm": entry_norm, "mtp_embeddings": embedding})
    return out
