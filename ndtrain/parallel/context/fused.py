"""One block of context-parallel attention on torch's fused attention ops, which return the
log-sum-exp and have a backward that takes it: the arithmetic of kernels.py without
materialising the block's scores.

Which op runs is chosen per block (`kernel_for`), apart from the call (`forward`,
`backward`, which take the choice as `kind`), so the calls can be checked on CPU with fake
CUDA tensors where the selector cannot run:
- CPU: `_scaled_dot_product_flash_attention_for_cpu` (+ `_backward`), every dtype fp64
  included, grouped-query attention native, document and window masks as its additive
  `attn_mask`. Its outputs and gradients equal SDPA's bitwise, so the fp64 proofs hold at
  1e-10.
- CUDA, full blocks and the causal square: torch's own SDPA selector
  (`torch._fused_sdp_choice`, which honours `torch.nn.attention.sdpa_kernel`) picks
  `_scaled_dot_product_flash_attention` (fp16/bf16, grouped-query native),
  `_scaled_dot_product_efficient_attention` or `_scaled_dot_product_cudnn_attention` (K/V
  repeated to the query heads, their gradients summed back). Where no fused op takes
  grouped heads the selector answers "math", or raises when math is switched off; either
  way it is asked again with the heads repeated.
- CUDA, blocks with a mask (documents, a sliding window), in fp32: `_scaled_dot_product_efficient_
  attention` with the mask as its additive `attn_bias` (0 / −inf, laid out as SDPA lays it
  out for this op: [b, H, sq, sk] contiguous, rows padded to 16 elements), when efficient
  attention is enabled and takes the inputs (`can_use_efficient_attention`). Flash takes no
  mask; cuDNN takes one, but what it does with a row that sees no key is not pinned down
  here. A row that sees no key of the block gets out 0 and lse −inf whatever the op wrote
  there, as the merge expects; its backward reads P = exp(−inf − lse) = 0, so it adds
  nothing and stays finite.
- The plain kernel (kernels.py) runs where none of these applies (`SDPBackend.MATH`, e.g.
  fp64 on CUDA, or `with sdpa_kernel(SDPBackend.MATH)`), and instead of efficient attention
  in bf16/fp16 (`HALF_EFFICIENT_BROKEN`: its backward gave non-finite gradients on the
  first H200), which makes masked blocks in a bf16 run plain, with one warning.

Every block's backward gets the *merged* output and log-sum-exp of its rows: the ops
recompute P = exp(S − lse) and D = rowsum(dout ∘ out) from them, which is the block's share
of the full gradient. The ops run in the compute dtype (bf16 in bf16 runs, as one process's
SDPA does); their outputs are merged and accumulated in fp32 (fp64 in fp64 runs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ndtrain.kernels.fp8 import warn_once
from ndtrain.model.llama import widened
from ndtrain.parallel.context.kernels import NEG_INF, attend, attend_backward, finite
from ndtrain.parallel.context.visibility import Block

aten = torch.ops.aten
_BACKENDS = {1: "flash", 2: "efficient", 3: "cudnn"}  # torch.nn.attention.SDPBackend values


# On the first H200 (torch 2.11+cu130, 2026-11-28; docs/benchmarks-gpu.md) efficient
# attention's backward in bf16, given an external log-sum-exp, returned non-finite dq and dk
# for some calls and not for others on the same inputs (fp32: always finite). Until that is
# understood, half-precision blocks do not run it: they take flash or cuDNN where torch's
# selector offers them, else the plain kernel, and say so once.
HALF_EFFICIENT_BROKEN = (torch.bfloat16, torch.float16)


def kernel_for(q: Tensor, k: Tensor, block: Block) -> str:
    """Which op runs this block: "cpu", "flash", "efficient", "cudnn" or "plain"."""
    cuda = q.device.type != "cpu"
    if block.mask is not None and cuda:
        return _not_half_efficient(q, "efficient" if _efficient_takes_mask(q, k, block) else "plain")
    bias = block.additive(q.dtype) if block.mask is not None else None
    choice = _selected(q, k, bias, block.causal, enable_gqa=q.shape[1] != k.shape[1])
    if cuda and choice in (None, 0) and q.shape[1] != k.shape[1]:  # no fused op takes GQA: repeat
        choice = _selected(q, _widened_heads(q, k), None, block.causal)
    if choice not in _BACKENDS:
        return "plain"
    return "cpu" if not cuda else _not_half_efficient(q, _BACKENDS[choice])


def _not_half_efficient(q: Tensor, kind: str) -> str:
    """`kind`, or the plain kernel where it is efficient attention in half precision."""
    if kind != "efficient" or q.dtype not in HALF_EFFICIENT_BROKEN:
        return kind
    warn_once("cp-half-efficient", f"a block that would run efficient attention in {str(q.dtype).split('.')[-1]} "
              "runs the plain kernel instead (its backward gave non-finite gradients on an H200, "
              "docs/benchmarks-gpu.md); flash and cuDNN are unaffected", topic="context parallelism:")
    return "plain"


def _selected(q: Tensor, k: Tensor, bias: Tensor | None, causal: bool, enable_gqa: bool = False) -> int | None:
    """torch's SDPA selector (an SDPBackend value), or None when it raises: no backend
    allowed by `sdpa_kernel` takes these inputs (e.g. grouped heads with only efficient
    attention on, in torch 2.11), math included."""
    try:
        return torch._fused_sdp_choice(q, k, k, bias, 0.0, causal, enable_gqa=enable_gqa)
    except RuntimeError:
        return None


def _widened_heads(q: Tensor, k: Tensor) -> Tensor:
    """An empty stand-in for k with every KV head repeated to the query heads."""
    return k.new_empty((k.shape[0], q.shape[1], *k.shape[2:]))


def _efficient_takes_mask(q: Tensor, k: Tensor, block: Block) -> bool:
    """Whether efficient attention is enabled (`sdpa_kernel`) and takes this masked block,
    K/V repeated, with a bias of q's dtype and shape (e.g. not fp64). The bias it is asked
    about is one padded [sq, sk] plane broadcast, so that asking allocates no [b, H, sq, sk]
    bias where the answer is no (`attention_bias` builds the real one)."""
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        return False
    b, h, sq = q.shape[:3]
    sk = k.shape[2]
    bias = q.new_empty((sq, -(-sk // 16) * 16)).narrow(-1, 0, sk).expand(b, h, sq, sk)
    wide = _widened_heads(q, k)
    return torch.backends.cuda.can_use_efficient_attention(torch.backends.cuda.SDPAParams(q, wide, wide, bias, 0.0,
                                                                                          False, False))


def attention_bias(block: Block, q: Tensor, k: Tensor) -> Tensor:
    """The block's mask as efficient attention's `attn_bias`: 0 where visible, −inf elsewhere,
    [b, H, sq, sk] in q's dtype, each row padded to a multiple of 16 elements and the
    whole laid out contiguously, as SDPA prepares a mask for this op (torch's
    `preprocess_mask`: the kernel needs aligned rows, and broadcast strides of 0 have given
    wrong results). Built once per block (every layer, forward and backward, reads it)."""
    key = ("bias", q.dtype, q.shape[0], q.shape[1])
    if key not in block._cache:
        b, h, sq = q.shape[:3]
        sk = k.shape[2]
        padded = torch.zeros((b, h, sq, -(-sk // 16) * 16), dtype=q.dtype, device=q.device)
        block._cache[key] = padded.narrow(-1, 0, sk).masked_fill_(block.mask.logical_not(), NEG_INF)
    return block._cache[key]


def forward(q: Tensor, k: Tensor, v: Tensor, block: Block, scale: float,
            kind: str | None = None) -> tuple[Tensor, Tensor]:
    """q [b, H, sq, d] (the block's rows), k and v [b, G, sk, d] (its columns), in the
    compute dtype → out [b, H, sq, d] and lse [b, H, sq], widened (fp32, or fp64). `kind`:
    the op (`kernel_for`'s answer, asked when None)."""
    kind = kind or kernel_for(q, k, block)
    if kind == "plain":
        return attend(widened(q), widened(k), widened(v), block.explicit(q.device), scale)
    if kind == "cpu":
        bias = block.additive(q.dtype) if block.mask is not None else None
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, block.causal, attn_mask=bias,
                                                                    scale=scale)
        if block.mask is not None:  # the op reports lse 0 for a row that sees nothing
            lse = lse.masked_fill(~block.seen(), NEG_INF)
        return widened(out), widened(lse)
    bias = attention_bias(block, q, k) if block.mask is not None else None
    q, k, v = (_dense(t) for t in (q, *_repeated(kind, q, k, v)))
    if kind == "flash":
        out, lse, *_, seed, offset, _ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, block.causal, False,
                                                                                 scale=scale)
    elif kind == "efficient":
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, block.causal,
                                                                             scale=scale)
    else:
        out, lse, *_, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0,
                                                                                 block.causal, False, scale=scale)
    block.keep(kind, (seed, offset))  # the random state backward takes (unread without dropout)
    # [b, H, sq]; efficient pads sq to a multiple of 32 (on CUDA), cuDNN adds a last dim of 1
    out, lse = widened(out), widened(lse.reshape(*lse.shape[:2], -1).narrow(-1, 0, q.shape[2]))
    if bias is not None:  # a row that sees no key: nothing, whatever the op wrote there
        unseen = block.seen().logical_not()
        out, lse = out.masked_fill(unseen.unsqueeze(-1), 0.0), lse.masked_fill(unseen, NEG_INF)
    return out, lse


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, block: Block,
             scale: float, kind: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The block's share of the gradients (dq [b, H, sq, d], dk and dv [b, G, sk, d]) from
    the merged `out` (compute dtype) and `lse` (widened) of its rows; `kind` as in
    `forward`."""
    kind = kind or kernel_for(q, k, block)
    if kind == "plain":
        dout_w, out_w = widened(dout), widened(out)
        delta = (dout_w * out_w).sum(-1)
        return attend_backward(widened(q), widened(k), widened(v), block.explicit(q.device), scale, lse, delta,
                               dout_w)
    lse = _dense(finite(lse))
    if kind == "cpu":
        bias = block.additive(q.dtype) if block.mask is not None else None
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, block.causal, attn_mask=bias, scale=scale)
    bias = attention_bias(block, q, k) if block.mask is not None else None
    n_kv = k.shape[1]
    dout, out, q, k, v = (_dense(t) for t in (dout, out, q, *_repeated(kind, q, k, v)))
    sq, sk = q.shape[2], k.shape[2]
    seed, offset = block.kept(kind, q.device)
    if kind == "flash":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, sq, sk, 0.0, block.causal, seed, offset, scale=scale)
    elif kind == "efficient":
        padded = lse
        if torch.version.hip is None:  # the layout its forward returns on CUDA
            padded = F.pad(lse, (0, -(-sq // 32) * 32 - sq))
        dq, dk, dv = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, bias, out, padded, seed, offset, 0.0, [True, True, True, False], block.causal,
            scale=scale)[:3]
    else:
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.unsqueeze(-1), seed, offset, None, None, None, sq, sk, 0.0, block.causal,
            scale=scale)
    if dk.shape[1] != n_kv:  # K/V were repeated: sum each group's gradients
        dk, dv = (t.view(t.shape[0], n_kv, -1, *t.shape[2:]).sum(2) for t in (dk, dv))
    return dq, dk, dv


def _dense(t: Tensor) -> Tensor:
    """t laid out contiguously, as `Tensor.contiguous` does; spelled as a clone because that
    method's Python binding opens a CUDA device guard, which fails for the fake CUDA tensors
    that check these calls on a CPU-only torch (so do `~`, indexing and `copy_`: the CUDA
    paths here use `logical_not`, `narrow` and `F.pad`)."""
    return t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


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
    text = f"full and causal blocks on {NAMES.get(plain, plain)}; document-masked and windowed blocks on "
    if masked == "cpu":
        return text + "the same op, the mask as its attn_mask"
    if masked == "efficient":
        return text + NAMES[masked] + ", the mask as its attn_bias"
    why = ""
    if device.type != "cpu":
        why = (" (efficient attention's bf16/fp16 backward gave non-finite gradients on an H200)"
               if dtype in HALF_EFFICIENT_BROKEN else " (efficient attention is off or cannot take these inputs)")
    return text + NAMES[masked] + why
