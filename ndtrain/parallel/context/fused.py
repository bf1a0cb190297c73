"""One block of context-parallel attention on torch's fused attention ops, which return the
log-sum-exp and have a backward that takes it: the arithmetic of kernels.py without
materialising the block's scores.

Which op runs is chosen per block at run time by torch's own SDPA selector
(`torch._fused_sdp_choice`, which honours `torch.nn.attention.sdpa_kernel`):
- CPU: `_scaled_dot_product_flash_attention_for_cpu` (+ `_backward`), every dtype fp64
  included, grouped-query attention native, document masks as its additive `attn_mask`.
  Its outputs and gradients equal SDPA's bitwise, so the fp64 proofs hold at 1e-10.
- CUDA: `_scaled_dot_product_flash_attention` (fp16/bf16, grouped-query native),
  `_scaled_dot_product_efficient_attention` or `_scaled_dot_product_cudnn_attention` (K/V
  repeated to the query heads, their gradients summed back), for blocks that are full or
  the causal square. A block with a document mask runs the plain kernel (kernels.py) on
  CUDA: the flash op takes no mask, and what the others do with a row that sees no key is
  not something the proofs have pinned down.
- The plain kernel also runs where the selector finds no fused op (`SDPBackend.MATH`,
  e.g. fp64 on CUDA, or `with sdpa_kernel(SDPBackend.MATH)`).

Every block's backward gets the *merged* output and log-sum-exp of its rows: the ops
recompute P = exp(S − lse) and D = rowsum(dout ∘ out) from them, which is the block's share
of the full gradient. The ops run in the compute dtype (bf16 in bf16 runs, as one process's
SDPA does); their outputs are merged and accumulated in fp32 (fp64 in fp64 runs).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ndtrain.model.llama import widened
from ndtrain.parallel.context.kernels import NEG_INF, attend, attend_backward, finite
from ndtrain.parallel.context.visibility import Block

aten = torch.ops.aten
_BACKENDS = {1: "flash", 2: "efficient", 3: "cudnn"}  # torch.nn.attention.SDPBackend values


def kernel_for(q: Tensor, k: Tensor, block: Block) -> str:
    """Which op runs this block: "cpu", "flash", "efficient", "cudnn" or "plain"."""
    if block.mask is not None and q.device.type != "cpu":
        return "plain"
    bias = block.additive(q.dtype) if block.mask is not None else None
    try:
        choice = torch._fused_sdp_choice(q, k, k, bias, 0.0, block.causal, enable_gqa=q.shape[1] != k.shape[1])
        if q.device.type != "cpu" and choice == 0 and q.shape[1] != k.shape[1]:  # no fused op takes GQA: repeat
            wide = k.new_empty((k.shape[0], q.shape[1], *k.shape[2:]))
            choice = torch._fused_sdp_choice(q, wide, wide, None, 0.0, block.causal)
    except RuntimeError:  # no viable backend (every fused one switched off)
        return "plain"
    if choice not in _BACKENDS:
        return "plain"
    return "cpu" if q.device.type == "cpu" else _BACKENDS[choice]


def forward(q: Tensor, k: Tensor, v: Tensor, block: Block, scale: float) -> tuple[Tensor, Tensor]:
    """q [b, H, sq, d] (the block's rows), k and v [b, G, sk, d] (its columns), in the
    compute dtype → out [b, H, sq, d] and lse [b, H, sq], widened (fp32, or fp64)."""
    kind = kernel_for(q, k, block)
    if kind == "plain":
        return attend(widened(q), widened(k), widened(v), block.explicit(q.device), scale)
    if kind == "cpu":
        bias = block.additive(q.dtype) if block.mask is not None else None
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, block.causal, attn_mask=bias,
                                                                    scale=scale)
        if block.mask is not None:  # the op reports lse 0 for a row that sees nothing
            lse = lse.masked_fill(~block.seen(), NEG_INF)
        return widened(out), widened(lse)
    q, k, v = (t.contiguous() for t in (q, *_repeated(kind, q, k, v)))
    if kind == "flash":
        out, lse, *_, seed, offset, _ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, block.causal, False,
                                                                                 scale=scale)
    elif kind == "efficient":
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, block.causal,
                                                                             scale=scale)
    else:
        out, lse, *_, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0,
                                                                                 block.causal, False, scale=scale)
    block.keep(kind, (seed, offset))  # the random state backward takes (unread without dropout)
    sq = q.shape[2]
    # [b, H, sq]; efficient pads sq to a multiple of 32 (on CUDA), cuDNN adds a last dim of 1
    return widened(out), widened(lse.reshape(*lse.shape[:2], -1)[..., :sq])


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, block: Block,
             scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The block's share of the gradients (dq [b, H, sq, d], dk and dv [b, G, sk, d]) from
    the merged `out` (compute dtype) and `lse` (widened) of its rows."""
    kind = kernel_for(q, k, block)
    if kind == "plain":
        dout_w, out_w = widened(dout), widened(out)
        delta = (dout_w * out_w).sum(-1)
        return attend_backward(widened(q), widened(k), widened(v), block.explicit(q.device), scale, lse, delta,
                               dout_w)
    lse = finite(lse).contiguous()
    if kind == "cpu":
        bias = block.additive(q.dtype) if block.mask is not None else None
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, block.causal, attn_mask=bias, scale=scale)
    n_kv = k.shape[1]
    dout, out, q, k, v = (t.contiguous() for t in (dout, out, q, *_repeated(kind, q, k, v)))
    sq, sk = q.shape[2], k.shape[2]
    seed, offset = block.kept(kind, q.device)
    if kind == "flash":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, sq, sk, 0.0, block.causal, seed, offset, scale=scale)
    elif kind == "efficient":
        padded = lse
        if torch.version.hip is None:  # the layout its forward returns on CUDA
            padded = lse.new_zeros((*lse.shape[:2], -(-sq // 32) * 32))
            padded[..., :sq] = lse
        dq, dk, dv = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, padded, seed, offset, 0.0, [True, True, True, False], block.causal,
            scale=scale)[:3]
    else:
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.unsqueeze(-1), seed, offset, None, None, None, sq, sk, 0.0, block.causal,
            scale=scale)
    if dk.shape[1] != n_kv:  # K/V were repeated: sum each group's gradients
        dk, dv = (t.view(t.shape[0], n_kv, -1, *t.shape[2:]).sum(2) for t in (dk, dv))
    return dq, dk, dv


def _repeated(kind: str, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """K and V as the op takes them: flash reads grouped-query heads itself; efficient and
    cuDNN get every KV head repeated for its H/G query heads."""
    r = q.shape[1] // k.shape[1]
    if kind == "flash" or r == 1:
        return k, v
    return k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)



NAMES = {"cpu": "_scaled_dot_product_flash_attention_for_cpu", "flash": "_scaled_dot_product_flash_attention",
         "efficient": "_scaled_dot_product_efficient_attention", "cudnn": "_scaled_dot_product_cudnn_attention",
         "plain": "the plain kernel (kernels.py)"}


def describe(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, tokens: int) -> str:
    """Which op the ring and all-gather back ends run here for each kind of block, in
    words (`bench cp` prints it)."""
    q = torch.empty((1, heads, tokens, head_dim), dtype=dtype, device=device)
    k = torch.empty((1, kv_heads, tokens, head_dim), dtype=dtype, device=device)
    rows = slice(0, tokens)
    full, causal = (kernel_for(q, k, Block(rows, rows, None, c)) for c in (False, True))
    masked = kernel_for(q, k, Block(rows, rows, torch.ones((1, 1, tokens, tokens), dtype=torch.bool, device=device)))
    plain = full if full == causal else f"{full} (full), {causal} (causal)"
    text = f"full and causal blocks on {NAMES.get(plain, plain)}; document-masked blocks on "
    if masked == "cpu":
        return text + "the same op, the mask as its attn_mask"
    why = " (the CUDA ops take no document mask here)" if masked == "plain" and device.type != "cpu" else ""
    return text + NAMES[masked] + why
