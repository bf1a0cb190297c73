"""The context-parallel attention core, what it replaces in a model, and what it sends.

`apply(model, group, impl, sp_group)` swaps every `AttentionCore` (rotary, softmax
attention, head merge: model/llama.py) for a `ContextParallelAttention` over the CP group,
and every residual dropout for one that draws the whole sequence's mask. The projections,
norms and MLP are untouched: they act on each token independently, so they work on any
subset of the sequence.

Latent attention (model/mla.py) hands the core q and k rotated already (`rotate=False`), and
its values zero-padded to the query·key width: every back end here moves K and V as one
message and runs the fused ops of any other model (fused.py `kernel_for`).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ndtrain.comm import ops
from ndtrain.config import CP_IMPLS, ConfigError
from ndtrain.mesh import Group
from ndtrain.model.llama import AttentionCore, KVCache, apply_rope
from ndtrain.parallel.context.allgather import AllGatherAttention
from ndtrain.parallel.context.layout import zigzag_index
from ndtrain.parallel.context.ring import RingAttention
from ndtrain.parallel.context.ulysses import ulysses_attention
from ndtrain.parallel.context.visibility import Visibility

IMPLS = CP_IMPLS


class Plans:
    """What every layer of one model shares about the current micro-batch: its
    `Visibility` (one per sliding window the layers have), and every rank's document ids,
    all-gathered once per micro-batch (not per layer): the cache holds the local ids weakly
    and is reused while the same tensor comes back, layer after layer."""

    def __init__(self, group: Group):
        self.group = group
        self._plain: dict[tuple, Visibility] = {}
        self._docs_ref = None
        self._docs: Tensor | None = None
        self._docs_vis: dict[int, Visibility] = {}

    def visibility(self, local_len: int, doc_ids: Tensor | None, device: torch.device, window: int = 0) -> Visibility:
        cp, seq_len = self.group.size, local_len * self.group.size
        if doc_ids is None:
            key = (seq_len, str(device), window)
            if key not in self._plain:
                self._plain[key] = Visibility(seq_len, cp, self.group.rank, device=device, window=window)
            return self._plain[key]
        if self._docs_ref is None or self._docs_ref() is not doc_ids:
            gathered = doc_ids.new_empty((cp, *doc_ids.shape))
            ops.all_gather(gathered.view(-1), doc_ids.contiguous().view(-1), self.group)
            self._docs_ref, self._docs, self._docs_vis = weakref.ref(doc_ids), gathered, {}
        if window not in self._docs_vis:
            self._docs_vis[window] = Visibility(seq_len, cp, self.group.rank, docs=self._docs, device=device,
                                                window=window)
        return self._docs_vis[window]


class ContextParallelAttention(nn.Module):
    """`AttentionCore` for a sequence split over the CP group in the zigzag layout: rotary
    with each token's own angles (from its true position), then attention over the whole
    sequence by `impl` (ring, allgather or ulysses). Same signature and result as the core
    it replaces, on this rank's tokens."""

    def __init__(self, group: Group, impl: str, plans: Plans, window: int = 0, rotate: bool = True):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"unknown context-parallel attention {impl!r}; choose one of {', '.join(IMPLS)}")
        self.group, self.impl, self.plans, self.window, self.rotate = group, impl, plans, window, rotate
        self.recorder = None  # a train.trace recorder while `ndtrain trace` watches the ring

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                cache: KVCache | None = None, layer_key: str | None = None,
                doc_ids: Tensor | None = None, sinks: Tensor | None = None) -> Tensor:
        if cache is not None:
            raise ValueError("context parallelism splits sequences for training; decode with the plain model")
        if self.rotate:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        vis = self.plans.visibility(q.shape[1], doc_ids, q.device, self.window)
        args = (q, k, v, self.group, vis, self.recorder, layer_key or "", sinks)
        if self.impl == "ring":
            return RingAttention.apply(*args)
        if self.impl == "allgather":
            return AllGatherAttention.apply(*args)
        return ulysses_attention(*args)


class SequenceDropout(nn.Module):
    """Dropout on this rank's positions that equals dropout on the whole sequence: every rank
    of a CP × TP group shares one random stream (the trainer seeds them alike), draws the
    mask of the whole [b, S, h] exactly as `F.dropout` on one device would, and keeps the
    positions it holds (its zigzag chunks; under sequence parallelism its tp slice of them)."""

    def __init__(self, p: float, cp: Group, sp: Group | None):
        super().__init__()
        self.p, self.cp, self.sp = p, cp, sp
        self._index: dict[tuple, Tensor] = {}

    def positions(self, local: int, device) -> Tensor:
        t, r = (self.sp.size, self.sp.rank) if self.sp is not None else (1, 0)
        key = (local, str(device))
        if key not in self._index:
            per_cp = local * t
            index = zigzag_index(per_cp * self.cp.size, self.cp.size, self.cp.rank, device)
            self._index[key] = index[r * local:(r + 1) * local]
        return self._index[key]

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        index = self.positions(x.shape[1], x.device)
        full = x.new_ones((x.shape[0], x.shape[1] * self.cp.size * (self.sp.size if self.sp else 1), *x.shape[2:]))
        return x * F.dropout(full, self.p).index_select(1, index)


def apply(model: nn.Module, group: Group, impl: str, sp_group: Group | None = None) -> list[str]:
    """Swap every attention core of `model` (a decoder or a pipeline chunk, plain or
    tensor-parallel) for the context-parallel one, in place; returns the swapped names.
    A model whose attention does not apply rotary positions in an `AttentionCore` is refused:
    its positions would be those of the local tokens, 0..S/cp−1, not the true ones."""
    plans = Plans(group)
    swapped = []
    blocks = [(f"layer {name}", f"layers.{name}", block)
              for name, block in getattr(model, "layers", nn.ModuleDict()).items()]
    mtp = getattr(model, "mtp", None) or {}  # multi-token prediction's blocks (model/mtp.py)
    blocks += [(f"MTP module {d}'s block", f"mtp.{d}.block", module.block) for d, module in mtp.items()]
    for label, name, block in blocks:
        core = getattr(getattr(block, "attention", None), "core", None)
        if not isinstance(core, AttentionCore):
            raise ConfigError("parallel.cp", group.size,
                              f"{label} of {type(model).__name__} has no AttentionCore that takes each "
                              "token's position; context parallelism needs explicit positions")
        if core.softcap:
            raise ConfigError("parallel.cp", group.size, f"{label} soft-caps its attention scores (Gemma 2); "
                              "context parallelism's attention kernels have no soft-capping")
        block.attention.core = ContextParallelAttention(group, impl, plans, core.window, core.rotate)
        swapped.append(f"{name}.attention.core")
        dropout = getattr(block, "dropout", None)
        if dropout is not None and dropout.p > 0:
            block.dropout = SequenceDropout(dropout.p, group, sp_group)
    if not swapped:
        raise ConfigError("parallel.cp", group.size, f"{type(model).__name__} holds no decoder layers "
                          "(`layers`) whose attention context parallelism could split")
    return swapped


def set_recorder(model: nn.Module, recorder) -> None:
    """Let every context-parallel core record its steps (`ndtrain trace`); None stops it."""
    for m in model.modules():
        if isinstance(m, ContextParallelAttention):
            m.recorder = recorder


def wire_bytes(impl: str, tokens: int, heads: int, kv_heads: int, head_dim: int, cp: int,
               value_bytes: int, accum_bytes: int) -> float:
    """Bytes one rank puts on the wire per layer and micro-batch, forward and backward, as
    comm/stats.py counts them. `tokens` T = b·S, the tokens the CP group shares; `heads` H and
    `kv_heads` G per TP rank; `value_bytes` of the compute dtype; `accum_bytes` of the fp32
    (fp64) gradient accumulators. In elements (all one dtype):
    - ring:      (cp−1)·2·(T/cp)·G·d forward, as much again backward, plus cp·2·(T/cp)·G·d of
                 gradient accumulators = (6·cp − 4)/cp · T·G·d  (→ 6·T·G·d);
    - allgather: all-gather forward and reduce-scatter backward of 2·T·G·d, (cp−1)/cp of each
                 = 4·T·G·d·(cp−1)/cp  (→ 4·T·G·d);
    - ulysses:   q, k, v and the output, forward and backward, (cp−1)/cp of each:
                 4·T·(H + G')·d·(cp−1)/cp², G' = G, or cp when KV heads are repeated
                 (→ 4·T·(H+G)·d/cp)."""
    T, H, G, d = tokens, heads, kv_heads, head_dim
    if impl == "ring":
        block = 2 * (T / cp) * G * d
        return 2 * (cp - 1) * block * value_bytes + cp * block * accum_bytes
    if impl == "allgather":
        return (cp - 1) / cp * 2 * T * G * d * (value_bytes + accum_bytes)
    if impl == "ulysses":
        g = G if G % cp == 0 else cp
        return 2 * (cp - 1) / cp * (T / cp) * (2 * H + 2 * g) * d * value_bytes
    raise ValueError(f"unknown context-parallel attention {impl!r}")
