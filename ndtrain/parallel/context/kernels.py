"""Blockwise softmax attention with its log-sum-exp, an explicit backward, and the merge of
partial results: the arithmetic every context-parallel back end is made of.

FlashAttention-2's decomposition:
- forward of one block of queries against one block of keys: scores S = q·kᵀ·scale,
  masked to −inf where a query may not see a key; lse = log Σ exp S per query row;
  out = exp(S − lse)·v, the block's normalised output;
- two partial results for the same rows (other key blocks) merge exactly:
  lse = logaddexp(lse₁, lse₂), out = out₁·e^(lse₁−lse) + out₂·e^(lse₂−lse);
- backward of a block, given the *final* lse and D = rowsum(dout ∘ out) of its rows:
  P = exp(S − lse), dV = Pᵀ·dout, dP = dout·vᵀ, dS = P ∘ (dP − D), dq = dS·k·scale,
  dk = dSᵀ·q·scale. Summing those over key blocks gives the gradient of full attention.

The blocks run on torch's fused attention ops that return the log-sum-exp (`fused.py`);
this module holds the merge and the same block written in plain torch, which runs where no
fused op can (`fused.py` says where). The plain block materialises its scores.

Attention sinks (gpt-oss: a logit σ_h per head in every row's softmax denominator, with no
value) fold into the merged result once every block is in (`fold_sinks`):
lse' = logaddexp(lse, σ_h), out' = out·e^(lse−lse'). The blocks' backward, given out' and
lse', is then the gradient of attention with sinks as it stands (the sink's column has no
value, so it adds nothing to D = rowsum(dout ∘ out')), and the sink's own gradient is
dσ_h = −Σ_rows e^(σ_h − lse')·D (`sinks_grad`).

A row that sees no key of a block has lse = −inf there (and out = 0); the merge and the
backward treat it as weight 0, so fully masked blocks and rows never produce NaN.

Layout: queries [b, H, s, d], keys and values [b, G, s, d] with G key/value heads (grouped-
query attention without copying K/V: query head g·r + i, r = H/G, reads KV head g, as in
`F.scaled_dot_product_attention(enable_gqa=True)`). The plain block computes in its inputs'
dtype; the back ends pass fp32 (fp64 for fp64 runs). Masks are boolean, True = visible,
broadcastable to [b, 1, sq, sk].
"""

from __future__ import annotations

import torch
from torch import Tensor

NEG_INF = float("-inf")


def to_heads(x: Tensor) -> Tensor:
    """[b, s, n, d] → [b, n, s, d] (a contiguous copy)."""
    return x.transpose(1, 2).contiguous()


def from_heads(x: Tensor) -> Tensor:
    """[b, n, s, d] → [b, s, n·d], heads in order."""
    b, n, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, n * d)


def finite(x: Tensor) -> Tensor:
    """x with −inf (a row that sees nothing) replaced by 0, so exp(S − x) is 0 there."""
    return x.masked_fill(x == NEG_INF, 0.0)


def _grouped(q: Tensor, n_kv: int) -> Tensor:
    """[b, H, s, d] → [b, G, H/G, s, d] (a view)."""
    b, h, s, d = q.shape
    return q.view(b, n_kv, h // n_kv, s, d)


def _scores(q: Tensor, k: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    s = (_grouped(q, k.shape[1]) * scale) @ k.unsqueeze(2).transpose(-1, -2)  # [b, G, r, sq, sk]
    return s if mask is None else s.masked_fill_(~mask.unsqueeze(2), NEG_INF)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """One block: q [b, H, sq, d], k and v [b, G, sk, d]. Returns out [b, H, sq, d] and lse
    [b, H, sq]."""
    p = _scores(q, k, mask, scale)
    top = finite(p.amax(dim=-1))
    p.sub_(top.unsqueeze(-1)).exp_()  # in place: the block's scores are not needed again
    total = p.sum(dim=-1)
    out = (p @ v.unsqueeze(2)) / total.masked_fill(total == 0, 1.0).unsqueeze(-1)
    return out.flatten(1, 2), (top + total.log()).flatten(1, 2)


def merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial results of the same rows (see the module docstring)."""
    new = torch.logaddexp(lse, block_lse)
    safe = finite(new)
    out = out * (lse - safe).exp().unsqueeze(-1) + block_out * (block_lse - safe).exp().unsqueeze(-1)
    return out, new


def attend_backward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, lse: Tensor,
                    delta: Tensor, dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The block's share of the gradients: (dq [b, H, sq, d], dk and dv [b, G, sk, d]).
    `lse` is the rows' final log-sum-exp over all key blocks, `delta` = rowsum(dout ∘ out)
    of the final output, both [b, H, sq]."""
    n_kv = k.shape[1]
    p = _scores(q, k, mask, scale).sub_(_grouped(finite(lse).unsqueeze(-1), n_kv)).exp_()
    b, g, r, sq, sk = p.shape
    flat_p, flat_dout = p.reshape(b, g, r * sq, sk), dout.reshape(b, g, r * sq, -1)
    dv = flat_p.transpose(-1, -2) @ flat_dout
    ds = (_grouped(dout, n_kv) @ v.unsqueeze(2).transpose(-1, -2))
    ds = ds.sub_(_grouped(delta.unsqueeze(-1), n_kv)).mul_(p)  # P ∘ (dP − D)
    dq = (ds @ k.unsqueeze(2)).flatten(1, 2) * scale
    dk = (ds.reshape(b, g, r * sq, sk).transpose(-1, -2) @ q.reshape(b, g, r * sq, -1)) * scale
    return dq, dk, dv


def fold_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """The merged out [b, H, s, d] and lse [b, H, s] of every key block → those of attention
    with one sink logit per head, `sinks` [H] (see the module docstring)."""
    new = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
    return out * (lse - new).exp().unsqueeze(-1), new


def sinks_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """dσ [H] of these rows: −Σ_rows e^(σ_h − lse')·rowsum(dout ∘ out'), with the folded
    out' [b, H, s, d] and lse' [b, H, s]; in lse's dtype."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    share = (sinks.to(lse.dtype).view(1, -1, 1) - lse).exp()
    return -(share * delta).sum((0, 2))


class Partial:
    """The running output [b, H, s, d] and log-sum-exp [b, H, s] of a rank's query rows,
    merged block by block; rows that no block reached keep out 0 and lse −inf."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = shape, dtype, device
        self.out: Tensor | None = None
        self.lse: Tensor | None = None

    def add(self, rows: slice, out: Tensor, lse: Tensor) -> None:
        if self.out is None and rows.start in (0, None) and rows.stop in (self.shape[2], None):
            self.out, self.lse = out, lse  # the first block covers every row: nothing to merge yet
            return
        self._allocate()
        at = (slice(None), slice(None), rows)
        self.out[at], self.lse[at] = merge(self.out[at], self.lse[at], out, lse)

    def result(self) -> tuple[Tensor, Tensor]:
        self._allocate()
        return self.out, self.lse

    def _allocate(self) -> None:
        if self.out is None:
            self.out = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            self.lse = torch.full(self.shape[:-1], NEG_INF, dtype=self.dtype, device=self.device)
