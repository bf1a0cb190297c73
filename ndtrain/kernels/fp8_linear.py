"""The fp8 linear layer's three matmuls, and the autograd functions that run them.

A linear layer y = x·Wᵀ (x [T, K] tokens × input features, W [N, K]) runs three matmuls,
each on two fp8 operands cut into cells along its reduction dimension (kernels/fp8.py):

    forward       y  = x  · Wᵀ     reduces over K
    input grad    dx = dy · W      reduces over N
    weight grad   dW = dyᵀ · x     reduces over T, the tokens

A recipe names the cells of each operand as (rows, columns) of the tensor as stored:

                  x       W          dy         W (dgrad)   dy (wgrad)   x (wgrad)
    tensorwise    whole   whole      whole      whole       whole        whole
    rowwise       1×K     1×K        1×N        N×1         T×1          T×1
    blockwise     1×128   128×128    1×128      128×128     128×1        128×1

x and W are E4M3 everywhere. dy is E5M2 under `tensorwise` only: a single scale for a whole
gradient leaves its small entries to the format's range, and E5M2 has 2^15 more of it than
E4M3 (Transformer Engine's HYBRID format, torchao's tensorwise default). Row-, tile- and
block-wise scales follow the gradient's magnitude closely enough that E4M3's extra mantissa
bit wins, which is DeepSeek-V3's argument for E4M3 throughout. `rowwise` rounds its scales up
to powers of two (torchao's rowwise), so scaling itself adds no rounding.

Where two matmuls need the same cells, one quantization serves both (tensorwise: x, W and
dy once each; blockwise: W's 128×128 blocks, transposed for the input gradient). What
forward saves for backward: tensorwise keeps x in fp8 (its weight-gradient operand); the
others keep x as it came, because the weight gradient needs it cut along the tokens. The
weight is quantized again in backward from the parameter itself, so an fp8 copy of every
weight is never held between forward and backward (ZeRO-3 frees the gathered weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import Tensor

from ndtrain.kernels.fp8 import BLOCK, E4M3, E5M2, WHOLE, Dim, Quantized, quantize, scaled_matmul


@dataclass(frozen=True)
class Recipe:
    name: str
    x: tuple[int, int]
    w: tuple[int, int]
    dy: tuple[int, int]
    w_dgrad: tuple[int, int]
    dy_wgrad: tuple[int, int]
    x_wgrad: tuple[int, int]
    grad_fmt: torch.dtype
    pow2: bool

    @property
    def saves_fp8_input(self) -> bool:
        return self.x == self.x_wgrad


_W, _B = WHOLE, BLOCK
RECIPES = {
    "tensorwise": Recipe("tensorwise", (_W, _W), (_W, _W), (_W, _W), (_W, _W), (_W, _W), (_W, _W), E5M2, False),
    "rowwise": Recipe("rowwise", (1, _W), (1, _W), (1, _W), (_W, 1), (_W, 1), (_W, 1), E4M3, True),
    "blockwise": Recipe("blockwise", (1, _B), (_B, _B), (1, _B), (_B, _B), (_B, 1), (_B, 1), E4M3, False),
}


@dataclass
class LinearPlan:
    """How one linear layer runs in fp8 on this rank: its recipe, its input and output
    feature dimensions as held here (`k`, `n`: a tensor-parallel shard, or whole), and
    `tokens(shape)`, the token dimension of an input whose leading dimensions are `shape`
    (split over context-parallel ranks, or whole). `backend`: None chooses by device and
    dtype (kernels/fp8.choose_backend). `saved_fp8` adds up the bytes of fp8 tensors that
    forwards kept for backward (the memory report's fp8 copies). `backends`: the back end
    each of its matmuls last ran on ("forward", "input_grad", "weight_grad")."""

    recipe: Recipe
    k: Dim
    n: Dim
    tokens: Callable[[tuple[int, ...]], Dim] = field(default=lambda shape: Dim.whole(_numel(shape)))
    backend: str | None = None
    saved_fp8: list[int] = field(default_factory=lambda: [0])
    backends: dict[str, str] = field(default_factory=dict)


# A weight may carry its fp8 form, quantized and gathered elsewhere (ZeRO-3's fp8 all-gather,
# parallel/fp8_gather.py): tensorwise values and their scale. The matmuls then use it as it is.
PREQUANTIZED = "_ndtrain_fp8"


@dataclass
class Prequantized:
    data: Tensor  # fp8, the weight's shape (a view into a gathered buffer)
    scale: Tensor  # 0-d fp32


def _weight_of(w: Tensor, plan: LinearPlan, blocks: tuple[int, int]) -> Quantized:
    pre = getattr(w, PREQUANTIZED, None)
    if pre is not None and blocks == (WHOLE, WHOLE):
        return Quantized(pre.data, pre.scale.view(1, 1))
    return _quantize_weight(w, plan, blocks)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _quantize_weight(w: Tensor, plan: LinearPlan, blocks: tuple[int, int]) -> Quantized:
    return quantize(w, (plan.n, plan.k), blocks, E4M3, plan.recipe.pow2)


def forward_matmul(x: Tensor, w: Tensor, plan: LinearPlan, tokens: Dim,
                   wq: Quantized | None = None) -> tuple[Tensor, Quantized]:
    """y = x·Wᵀ for x [T, K] and W [N, K]; returns y and x quantized."""
    r = plan.recipe
    xq = quantize(x, (tokens, plan.k), r.x, E4M3, r.pow2)
    wq = wq if wq is not None else _weight_of(w, plan, r.w)
    return scaled_matmul(xq, wq, plan.k.runs(r.x[1]), x.dtype, plan.backend, plan.backends, "forward"), xq


def input_grad(dy: Tensor, w: Tensor, plan: LinearPlan, tokens: Dim, dyq: Quantized,
               wq: Quantized | None = None) -> Tensor:
    """dx = dy·W [T, K] from dy quantized for it."""
    wq = wq if wq is not None else _weight_of(w, plan, plan.recipe.w_dgrad)
    return scaled_matmul(dyq, wq.t(), plan.n.runs(plan.recipe.dy[1]), dy.dtype, plan.backend, plan.backends,
                         "input_grad")


def weight_grad(dy: Tensor, x: Tensor | Quantized, plan: LinearPlan, tokens: Dim, dyq: Quantized,
                dtype: torch.dtype) -> Tensor:
    """dW = dyᵀ·x [N, K]; `x` as saved (fp8 when the recipe reuses the forward's)."""
    r = plan.recipe
    if r.dy_wgrad != r.dy:
        dyq = quantize(dy, (tokens, plan.n), r.dy_wgrad, r.grad_fmt, r.pow2)
    xq = x if isinstance(x, Quantized) else quantize(x, (tokens, plan.k), r.x_wgrad, E4M3, r.pow2)
    return scaled_matmul(dyq.t(), xq.t(), tokens.runs(r.dy_wgrad[0]), dtype, plan.backend, plan.backends,
                         "weight_grad")


def predict_backends(plan: LinearPlan, tokens: Dim, dtype: torch.dtype, device: torch.device) -> dict[str, str]:
    """The back end each of the layer's three matmuls takes for `tokens` rows of input in
    `dtype` on `device`: the layer's own code run on fake tensors (nothing computed, nothing
    communicated), so it answers as the run does, compiled or not, and warns as it would."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def alone(d: Dim) -> Dim:
        return replace(d, split=None)
    local = replace(plan, k=alone(plan.k), n=alone(plan.n), saved_fp8=[0], backends={})
    tokens = alone(tokens)
    with FakeTensorMode():
        x, w = (torch.empty(rows, local.k.size, dtype=dtype, device=device) for rows in (tokens.size, local.n.size))
        dy = torch.empty(tokens.size, local.n.size, dtype=dtype, device=device)
        xq = forward_matmul(x, w, local, tokens)[1]
        dyq = quantize_grad(dy, local, tokens)
        input_grad(dy, w, local, tokens, dyq)
        weight_grad(dy, xq if local.recipe.saves_fp8_input else x, local, tokens, dyq, dtype)
    return local.backends


def quantize_grad(dy: Tensor, plan: LinearPlan, tokens: Dim) -> Quantized:
    r = plan.recipe
    return quantize(dy, (tokens, plan.n), r.dy, r.grad_fmt, r.pow2)


def wanted(ctx, i: int) -> bool:
    """Whether backward must compute the gradient of input i: the input needs one and this
    backward pass goes there. The zero-bubble split (parallel/pipeline/weightgrad.py) asks
    first for the input gradient alone, then for the weights' alone; a built-in matmul then
    computes only what is asked, and so does this."""
    if not ctx.needs_input_grad[i]:
        return False
    if torch.compiler.is_compiling():  # a traced backward has no engine to ask; AOTAutograd prunes it
        return True
    node = ctx.next_functions[i][0]
    try:
        return node is not None and torch._C._will_engine_execute_node(node)
    except (AttributeError, RuntimeError):  # not inside a backward pass the engine tracks
        return True


class Fp8Linear(torch.autograd.Function):
    """y = x·Wᵀ + b with the three matmuls in fp8 (module docstring). One autograd node, so
    the zero-bubble split (parallel/pipeline/weightgrad.py) sees the weight used once."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, plan: LinearPlan, tokens: Dim) -> Tensor:
        y, xq = forward_matmul(x, weight, plan, tokens)
        if bias is not None:
            y = y + bias
        ctx.plan, ctx.tokens, ctx.has_bias = plan, tokens, bias is not None
        if plan.recipe.saves_fp8_input:
            ctx.save_for_backward(xq.data, xq.scale, weight)
            plan.saved_fp8[0] += xq.nbytes()
        else:
            ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        plan, tokens = ctx.plan, ctx.tokens
        if plan.recipe.saves_fp8_input:
            data, scale, weight = ctx.saved_tensors
            x = Quantized(data, scale)  # tensorwise: one cell
        else:
            x, weight = ctx.saved_tensors
        dyq = quantize_grad(dy, plan, tokens)
        dx = dw = db = None
        if wanted(ctx, 0):
            dx = input_grad(dy, weight, plan, tokens, dyq)
        if wanted(ctx, 1):
            dw = weight_grad(dy, x, plan, tokens, dyq, weight.dtype)
        if ctx.has_bias and wanted(ctx, 2):
            db = dy.sum(0)
        return dx, dw, db, None, None


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, plan: LinearPlan) -> Tensor:
    """`F.linear` in fp8: x [..., K] (its leading dimensions are the tokens), W [N, K]."""
    y = Fp8Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias, plan, plan.tokens(tuple(x.shape[:-1])))
    return y.view(*x.shape[:-1], y.shape[-1])


def segments_of(counts: Tensor) -> list[tuple[int, int, int]]:
    """(expert, start, end) of every group of rows, from counts [E] (rows per expert) or
    [E, S] (rows per expert from each of S sources: micro-batches of other ranks under
    expert parallelism, each quantized on its own, as one process would)."""
    per = counts if counts.dim() == 2 else counts[:, None]
    out, start = [], 0
    for g, row in enumerate(per.tolist()):
        for n in row:
            out.append((g, start, start + n))
            start += n
    return out


class Fp8Experts(torch.autograd.Function):
    """Rows grouped by expert times each expert's weight (w [G, N, K]), in fp8. Each group of
    rows is its own token dimension: one expert's tokens of one micro-batch, the tensor a
    single process would quantize."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, segments: list[tuple[int, int, int]], plan: LinearPlan) -> Tensor:
        x = x.contiguous()
        out = x.new_zeros(x.shape[0], w.shape[1])
        weights: dict[int, Quantized] = {}
        for g, a, b in segments:
            if b > a:
                if g not in weights:
                    weights[g] = _quantize_weight(w[g], plan, plan.recipe.w)
                out[a:b] = forward_matmul(x[a:b], w[g], plan, Dim.whole(b - a), weights[g])[0]
        ctx.plan, ctx.segments = plan, segments
        ctx.save_for_backward(x, w)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w = ctx.saved_tensors
        plan, grad = ctx.plan, grad.contiguous()
        dx = x.new_zeros(x.shape) if wanted(ctx, 0) else None
        need_dw = wanted(ctx, 1)
        dw = torch.zeros(w.shape, dtype=torch.float32 if w.dtype != torch.float64 else w.dtype, device=w.device)
        weights: dict[int, Quantized] = {}
        for g, a, b in ctx.segments:
            if b == a:
                continue
            tokens = Dim.whole(b - a)
            dyq = quantize_grad(grad[a:b], plan, tokens)
            if dx is not None:
                if g not in weights:
                    weights[g] = _quantize_weight(w[g], plan, plan.recipe.w_dgrad)
                dx[a:b] = input_grad(grad[a:b], w[g], plan, tokens, dyq, weights[g])
            if need_dw:
                dw[g] += weight_grad(grad[a:b], x[a:b], plan, tokens, dyq, dw.dtype)
        return dx, dw.to(w.dtype) if need_dw else None, None, None


def fp8_expert_matmul(x: Tensor, w: Tensor, counts: Tensor, plan: LinearPlan) -> Tensor:
    return Fp8Experts.apply(x, w, segments_of(counts), plan)
