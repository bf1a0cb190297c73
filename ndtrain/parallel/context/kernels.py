"""Blockwise softmax attention with its log-sum-exp, an explicit backward, and the merge of
partial results: the arithmetic every context-parallel back end is made of.

FlashAttention-2's decomposition, written in plain torch so it runs on any device:
- forward of one block of queries against one block of keys: scores S = q·kᵀ·scale,
  masked to −inf where a query may not see a key; lse = log Σ exp S per query row;
  out = exp(S − lse)·v, the block's normalised output;
- two partial results for the same rows (other key blocks) merge exactly:
  lse = logaddexp(lse₁, lse₂), out = out₁·e^(lse₁−lse) + out₂·e^(lse₂−lse);
- backward of a block, given the *final* lse and D = rowsum(dout ∘ out) of its rows:
  P = exp(S − lse), dV = Pᵀ·dout, dP = dout·vᵀ, dS = P ∘ (dP − D), dq = dS·k·scale,
  dk = dSᵀ·q·scale. Summing those over key blocks gives the gradient of full attention.

A row that sees no key of a block has lse = −inf there (and out = 0); the merge and the
backward treat it as weight 0, so fully masked blocks and rows never produce NaN.

Layout inside the kernels (grouped-query attention without copying K/V): queries
[b, G, r, s, d] with G key/value heads and r = H/G query heads per KV head (query head
g·r + i reads KV head g, as in `F.scaled_dot_product_attention(enable_gqa=True)`), keys and
values [b, G, s, d]. Everything is computed in the caller's dtype; the back ends pass fp32
(fp64 for fp64 runs).
"""

from __future__ import annotations

import torch
from torch import Tensor

NEG_INF = float("-inf")


def to_heads(q: Tensor, n_kv: int) -> Tensor:
    """[b, s, H, d] → [b, G, H/G, s, d] (a copy)."""
    b, s, h, d = q.shape
    return q.view(b, s, n_kv, h // n_kv, d).permute(0, 2, 3, 1, 4).contiguous()


def from_heads(x: Tensor) -> Tensor:
    """[b, G, r, s, d] → [b, s, G·r·d], heads in query order."""
    b, g, r, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, g * r * d)


def kv_heads(k: Tensor) -> Tensor:
    """[b, s, G, d] → [b, G, s, d]."""
    return k.transpose(1, 2)


def _scores(q: Tensor, k: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    s = torch.matmul(q * scale, k.unsqueeze(2).transpose(-1, -2))  # [b, G, r, sq, sk]
    return s if mask is None else s.masked_fill_(~mask, NEG_INF)


def _finite(x: Tensor) -> Tensor:
    """x with −inf (a row that sees nothing) replaced by 0, so exp(S − x) is 0 there."""
    return x.masked_fill(x == NEG_INF, 0.0)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """One block: q [b, G, r, sq, d], k and v [b, G, sk, d], mask broadcastable to
    [b, 1, 1, sq, sk] (True = visible) or None. Returns out [b, G, r, sq, d] and lse
    [b, G, r, sq]."""
    p = _scores(q, k, mask, scale)
    top = _finite(p.amax(dim=-1))
    p.sub_(top.unsqueeze(-1)).exp_()  # in place: the block's scores are not needed again
    total = p.sum(dim=-1)
    out = torch.matmul(p, v.unsqueeze(2)) / total.masked_fill(total == 0, 1.0).unsqueeze(-1)
    return out, top + torch.log(total)


def merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial results of the same rows (see the module docstring)."""
    new = torch.logaddexp(lse, block_lse)
    safe = _finite(new)
    out = out * torch.exp(lse - safe).unsqueeze(-1) + block_out * torch.exp(block_lse - safe).unsqueeze(-1)
    return out, new


def attend_backward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, lse: Tensor,
                    delta: Tensor, dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The block's share of the gradients: (dq [b, G, r, sq, d], dk and dv [b, G, sk, d]).
    `lse` is the rows' final log-sum-exp over all key blocks, `delta` = rowsum(dout ∘ out)
    of the final output, both [b, G, r, sq]."""
    p = _scores(q, k, mask, scale).sub_(_finite(lse).unsqueeze(-1)).exp_()
    b, g, r, sq, sk = p.shape
    flat_p, flat_dout = p.reshape(b, g, r * sq, sk), dout.reshape(b, g, r * sq, -1)
    dv = torch.matmul(flat_p.transpose(-1, -2), flat_dout)
    ds = torch.matmul(dout, v.unsqueeze(2).transpose(-1, -2)).sub_(delta.unsqueeze(-1)).mul_(p)  # P ∘ (dP − D)
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.reshape(b, g, r * sq, sk).transpose(-1, -2), q.reshape(b, g, r * sq, -1)) * scale
    return dq, dk, dv
