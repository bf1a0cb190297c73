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

from ndtrain.kernels import fp8 as kernels
from ndtrain.kernels import mx, mx_experts
from ndtrain.kernels.fp8 import (BLOCK, E4M3, E5M2, SCALED_MM_SM, WHOLE, Dim, Quantized, quantize, row_major,
                                scaled_matmul, warn_once)


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
    kind: str = "fp8"  # "mxfp8", "nvfp4": the micro-scaled formats (kernels/mx.py)

    @property
    def saves_fp8_input(self) -> bool:
        return self.x == self.x_wgrad

    @property
    def micro(self) -> bool:
        return self.kind != "fp8"


_W, _B, _X, _N = WHOLE, BLOCK, mx.MX_BLOCK, mx.NV_BLOCK
RECIPES = {
    "tensorwise": Recipe("tensorwise", (_W, _W), (_W, _W), (_W, _W), (_W, _W), (_W, _W), (_W, _W), E5M2, False),
    "rowwise": Recipe("rowwise", (1, _W), (1, _W), (1, _W), (_W, 1), (_W, 1), (_W, 1), E4M3, True),
    "blockwise": Recipe("blockwise", (1, _B), (_B, _B), (1, _B), (_B, _B), (_B, 1), (_B, 1), E4M3, False),
    # MXFP8: every operand in 1×32 blocks along its matmul's reduction (E4M3, E8M0 scales).
    "mxfp8": Recipe("mxfp8", (1, _X), (1, _X), (1, _X), (_X, 1), (_X, 1), (_X, 1), E4M3, True, "mxfp8"),
    # NVFP4: 1×16 blocks, the weight in 16×16 blocks (one quantization for both of its matmuls).
    "nvfp4": Recipe("nvfp4", (1, _N), (_N, _N), (1, _N), (_N, _N), (_N, 1), (_N, 1), E4M3, False, "nvfp4"),
    "nvfp4-1d": Recipe("nvfp4-1d", (1, _N), (1, _N), (1, _N), (_N, 1), (_N, 1), (_N, 1), E4M3, False, "nvfp4"),
}


@dataclass
class Rounding:
    """What identifies a stochastic rounding's random numbers (NVFP4's gradients): the seed,
    the step, and the micro-batch's index in the step's global batch (`first` of this data-
    parallel rank, plus `micro`, set by the schedule before each forward). With the layer's
    name and each element's global token and feature index (kernels/mx.uniform), no rank's
    generator is involved: every layout draws the numbers one process draws."""

    seed: int
    step: int = 0
    first: int = 0
    micro: int = 0
    per_rank: int = 0  # micro-batches per data-parallel rank and step (routed experts' sources)

    def key(self, layer: str, what: str, ranks_away: int = 0) -> tuple[int, int]:
        """(the stream's key, the micro-batch's index in the step) for `layer`'s `what`;
        `ranks_away`: of the micro-batch that the data-parallel rank that many ranks after
        this one runs now (the source of an expert's rows under expert parallelism)."""
        g = self.first + ranks_away * self.per_rank + self.micro
        return mx.stream_key(self.seed, self.step, g, layer, what), g


ROUNDING = "ndtrain_rounding"  # the attribute of a model (or pipeline chunk) that holds its Rounding


def set_micro(model: torch.nn.Module, i: int) -> None:
    """Before the forward of this rank's micro-batch i (the schedules call it): the index
    that keys NVFP4's stochastic rounding, where the model has one."""
    rounding = model.__dict__.get(ROUNDING)
    if rounding is not None:
        rounding.micro = i


@dataclass(frozen=True)
class Nvfp4:
    """NVFP4's recipe pieces (arXiv 2509.25149): the 16×16 random Hadamard transform of the
    weight gradient's inputs, and stochastic rounding of the gradients (`rounding`: None
    rounds to nearest)."""

    hadamard: bool = True
    rounding: Rounding | None = None
    seed: int = 0


@dataclass
class LinearPlan:
    """How one linear layer runs in fp8 on this rank: its recipe, its input and output
    feature dimensions as held here (`k`, `n`: a tensor-parallel shard, or whole), and
    `tokens(shape)`, the token dimension of an input whose leading dimensions are `shape`
    (split over context-parallel ranks, or whole). `backend`: None chooses by device and
    dtype (kernels/fp8.choose). `saved_fp8` adds up the bytes of fp8 tensors that
    forwards kept for backward (the memory report's fp8 copies). `backends`: the back end
    each of its matmuls last ran on ("forward", "input_grad", "weight_grad")."""

    recipe: Recipe
    k: Dim
    n: Dim
    tokens: Callable[[tuple[int, ...]], Dim] = field(default=lambda shape: Dim.whole(_numel(shape)))
    backend: str | None = None
    saved_fp8: list[int] = field(default_factory=lambda: [0])
    backends: dict[str, str] = field(default_factory=dict)
    nv: Nvfp4 | None = None  # NVFP4's options (recipe kind "nvfp4")


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
    return _quantize(w, (plan.n, plan.k), blocks, E4M3, plan.recipe)


def _quantize(x: Tensor, dims: tuple[Dim, Dim], blocks: tuple[int, int], fmt: torch.dtype, r: Recipe,
              u: Tensor | None = None) -> Quantized:
    """x in the recipe's format: fp8 cells (kernels/fp8.py) or a micro-scaled format (kernels/mx.py;
    `u`: NVFP4's stochastic rounding's numbers)."""
    if r.kind == "mxfp8":
        return mx.quantize_mx(x, dims, blocks)
    if r.kind == "nvfp4":
        return mx.quantize_nv(x, dims, blocks, u)
    return quantize(x, dims, blocks, fmt, r.pow2)


def _product(a: Quantized, b: Quantized, runs, out_dtype: torch.dtype, plan: LinearPlan, key: str) -> Tensor:
    if a.kind != "fp8":
        return mx.scaled_matmul(a, b, out_dtype, plan.backend, plan.backends, key)
    return scaled_matmul(a, b, runs, out_dtype, plan.backend, plan.backends, key)


def forward_matmul(x: Tensor, w: Tensor, plan: LinearPlan, tokens: Dim,
                   wq: Quantized | None = None) -> tuple[Tensor, Quantized]:
    """y = x·Wᵀ for x [T, K] and W [N, K]; returns y and x quantized."""
    r = plan.recipe
    xq = _quantize(x, (tokens, plan.k), r.x, E4M3, r)
    wq = wq if wq is not None else _weight_of(w, plan, r.w)
    return _product(xq, wq, plan.k.runs(r.x[1]), x.dtype, plan, "forward"), xq


def input_grad(dy: Tensor, w: Tensor, plan: LinearPlan, tokens: Dim, dyq: Quantized,
               wq: Quantized | None = None) -> Tensor:
    """dx = dy·W [T, K] from dy quantized for it."""
    wq = wq if wq is not None else _weight_of(w, plan, plan.recipe.w_dgrad)
    return _product(dyq, wq.t(), plan.n.runs(plan.recipe.dy[1]), dy.dtype, plan, "input_grad")


def _hadamard_tokens(t: Tensor, plan: LinearPlan, tokens: Dim) -> tuple[Tensor, Dim]:
    """NVFP4's weight-gradient operand along the tokens: the 16×16 random Hadamard transform of
    each run of 16 tokens where the recipe has it (runs of global token indices: the config
    refuses a context-parallel chunk that is not a multiple of 16), and its token dimension."""
    nv = plan.nv
    if plan.recipe.kind != "nvfp4" or nv is None or not nv.hadamard:
        return t, tokens
    h = mx.hadamard(mx.NV_BLOCK, mx.stream_key(nv.seed, "hadamard"), torch.float64, t.device)
    out = mx.transform_tokens(t if t.dtype == torch.float64 else t.float(), h)
    if out.shape[0] == tokens.size:
        return out, tokens
    if tokens.split is not None or tokens.index is not None or tokens.size != tokens.full:
        raise ValueError("the Hadamard transform needs a split token dimension cut in runs of 16")
    return out, Dim.whole(out.shape[0])


def wgrad_input(x: Tensor, plan: LinearPlan, tokens: Dim) -> Quantized:
    """x as the weight gradient takes it (cells along the tokens; Hadamard-transformed under
    NVFP4): what a micro-scaled forward keeps for backward instead of x."""
    r = plan.recipe
    xt, tt = _hadamard_tokens(x, plan, tokens)
    return _quantize(xt, (tt, plan.k), r.x_wgrad, E4M3, r)


def _uniform(sr: tuple[int, int] | None, tokens: Dim, features: Dim, device: torch.device) -> Tensor | None:
    """Stochastic rounding's numbers for a gradient [tokens, features], or None (to nearest)."""
    if sr is None:
        return None
    key, micro = sr
    return mx.uniform(key, micro * tokens.full, tokens, features, device)


def weight_grad(dy: Tensor, x: Tensor | Quantized, plan: LinearPlan, tokens: Dim, dyq: Quantized,
                dtype: torch.dtype, sr: tuple[int, int] | None = None) -> Tensor:
    """dW = dyᵀ·x [N, K]; `x` as saved (fp8 when the recipe reuses the forward's; under a
    micro-scaled recipe, `wgrad_input`'s). `sr`: NVFP4's stochastic rounding of dy."""
    r = plan.recipe
    if r.micro:
        xq = x if isinstance(x, Quantized) else wgrad_input(x, plan, tokens)
        dyt, tt = _hadamard_tokens(dy, plan, tokens)
        dyq = _quantize(dyt, (tt, plan.n), r.dy_wgrad, r.grad_fmt, r, _uniform(sr, tt, plan.n, dy.device))
        return _product(dyq.t(), xq.t(), None, dtype, plan, "weight_grad")
    if r.dy_wgrad != r.dy:
        dyq = quantize(dy, (tokens, plan.n), r.dy_wgrad, r.grad_fmt, r.pow2)
    xq = x if isinstance(x, Quantized) else quantize(x, (tokens, plan.k), r.x_wgrad, E4M3, r.pow2)
    return scaled_matmul(dyq.t(), xq.t(), tokens.runs(r.dy_wgrad[0]), dtype, plan.backend, plan.backends,
                         "weight_grad")


# The CPU's answers, per process: off CUDA the back end depends on the recipe, the forced back
# end, the dtype and the shapes only (there is no device capability to ask), and the fake-tensor
# run costs about a second a layer shape on a loaded 2-core machine, paid by every run a test
# process makes (a proof's reference, its twin, each layout).
_CPU_ANSWERS: dict[tuple, dict[str, str]] = {}


def predict_backends(plan: LinearPlan, tokens: Dim, dtype: torch.dtype, device: torch.device) -> dict[str, str]:
    """The back end each of the layer's three matmuls takes for `tokens` rows of input in
    `dtype` on `device`: the layer's own code run on fake tensors (nothing computed, nothing
    communicated), so it answers as the run does, compiled or not, and warns as it would
    (on the CPU, the first time a process asks: `_CPU_ANSWERS`)."""
    key = None
    if device.type == "cpu":
        key = (plan.recipe, plan.k, plan.n, plan.backend, tokens, tokens.index is None, dtype)
        if key in _CPU_ANSWERS:
            return dict(_CPU_ANSWERS[key])
    answer = _predict(plan, tokens, dtype, device)
    if key is not None:
        _CPU_ANSWERS[key] = dict(answer)
    return answer


def _predict(plan: LinearPlan, tokens: Dim, dtype: torch.dtype, device: torch.device) -> dict[str, str]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    local = replace(plan, k=plan.k.alone(), n=plan.n.alone(), saved_fp8=[0], backends={})
    tokens = tokens.alone()
    with FakeTensorMode(allow_non_fake_inputs=True):  # a permuted Dim's index is a real CPU tensor
        x, w = (torch.empty(rows, local.k.size, dtype=dtype, device=device) for rows in (tokens.size, local.n.size))
        dy = torch.empty(tokens.size, local.n.size, dtype=dtype, device=device)
        xq = forward_matmul(x, w, local, tokens)[1]
        dyq = quantize_grad(dy, local, tokens)
        input_grad(dy, w, local, tokens, dyq)
        weight_grad(dy, xq if local.recipe.saves_fp8_input else x, local, tokens, dyq, dtype)
    return local.backends


def quantize_grad(dy: Tensor, plan: LinearPlan, tokens: Dim, sr: tuple[int, int] | None = None) -> Quantized:
    r = plan.recipe
    return _quantize(dy, (tokens, plan.n), r.dy, r.grad_fmt, r, _uniform(sr, tokens, plan.n, dy.device))


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
    the zero-bubble split (parallel/pipeline/weightgrad.py) sees the weight used once.
    `layer`: its name, which keys NVFP4's stochastic rounding."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, plan: LinearPlan, tokens: Dim,
                layer: str = "") -> Tensor:
        y, xq = forward_matmul(x, weight, plan, tokens)
        if bias is not None:
            y = y + bias
        ctx.plan, ctx.tokens, ctx.has_bias = plan, tokens, bias is not None
        saved = None
        if plan.recipe.micro:  # the weight gradient's operand, quantized now (what the formats keep)
            saved = wgrad_input(x, plan, tokens)
            ctx.meta = (saved.rows, saved.cols, saved.local, saved.kind, saved.outer)
            rounding = plan.nv.rounding if plan.nv is not None else None
            ctx.sr = (rounding.key(layer, "input_grad"), rounding.key(layer, "weight_grad")) if rounding else (None, None)
            ctx.save_for_backward(saved.data, saved.scale, weight)
        elif plan.recipe.saves_fp8_input:
            saved = xq
            ctx.save_for_backward(xq.data, xq.scale, weight)
        else:
            ctx.save_for_backward(x, weight)
        if saved is not None and not torch.compiler.is_compiling():  # a Python counter in a graph: a recompile per call
            plan.saved_fp8[0] += saved.nbytes()
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        plan, tokens = ctx.plan, ctx.tokens
        sr = (None, None)
        if plan.recipe.micro:
            data, scale, weight = ctx.saved_tensors
            x = Quantized(data, scale, *ctx.meta)
            sr = ctx.sr
        elif plan.recipe.saves_fp8_input:
            data, scale, weight = ctx.saved_tensors
            x = Quantized(data, scale)  # tensorwise: one cell
        else:
            x, weight = ctx.saved_tensors
        dyq = quantize_grad(dy, plan, tokens, sr[0])
        dx = dw = db = None
        if wanted(ctx, 0):
            dx = input_grad(dy, weight, plan, tokens, dyq)
        if wanted(ctx, 1):
            dw = weight_grad(dy, x, plan, tokens, dyq, weight.dtype, sr[1])
        if ctx.has_bias and wanted(ctx, 2):
            db = dy.sum(0)
        return dx, dw, db, None, None, None


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, plan: LinearPlan, layer: str = "") -> Tensor:
    """`F.linear` in fp8: x [..., K] (its leading dimensions are the tokens), W [N, K]. The
    layer's name goes in only where it keys NVFP4's stochastic rounding: torch 2.11's Dynamo
    guards on a string passed to `apply`, and recompiled every block for its name."""
    rounding = plan.nv is not None and plan.nv.rounding is not None
    y = Fp8Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias, plan, plan.tokens(tuple(x.shape[:-1])),
                        layer if rounding else "")
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


def grouped_fp8(x: Tensor, w: Tensor, plan: LinearPlan) -> str | None:
    """None where an expert product runs grouped: rowwise on CUDA sm90 only (bf16, K and N
    multiples of 16), its forward and input gradient one `torch._scaled_grouped_mm` each;
    MXFP8 on sm100, all three (kernels/mx_experts.py). Else why not, or "" off CUDA (nothing
    to warn). Of the fp8 recipes rowwise only: torch's grouped fp8 product takes one scale per
    row of x and per output column of each expert, which is what rowwise quantizes;
    tensorwise's one scale for all rows and blockwise's 128-tiles it cannot take."""
    if plan.recipe.micro:
        return mx_experts.why_not(x, w, plan)
    if not x.is_cuda or plan.backend is not None:
        return ""
    if plan.recipe.name != "rowwise":
        return (f"torch's grouped fp8 product takes rowwise scales only, so the {plan.recipe.name} routed experts "
                "run one _scaled_mm per expert and source")
    cap = kernels.device_capability(x.device)  # looked up here, so the fake-tensor checks can patch it
    if cap < SCALED_MM_SM["rowwise"]:
        return f"rowwise _scaled_grouped_mm needs sm90, this GPU is sm{cap[0]}{cap[1]}; the experts loop"
    if cap[0] != 9:  # torch 2.13's grouped fp8 kernel is sm90's (its own tests and benchmarks: not on sm100)
        return f"rowwise _scaled_grouped_mm runs on sm90 only, this GPU is sm{cap[0]}{cap[1]}; the experts loop"
    if x.dtype != torch.bfloat16 or w.shape[1] % 16 or w.shape[2] % 16:
        return "_scaled_grouped_mm writes bf16 and needs K and N multiples of 16; the experts loop"
    return None


def _expert_offsets(segments: list[tuple[int, int, int]], experts: int, device: torch.device) -> Tensor:
    """The end row of each expert's rows (int32), what the grouped products take as `offs`."""
    ends = [0] * experts
    for g, _, b in segments:
        ends[g] = b
    for g in range(1, experts):
        ends[g] = max(ends[g], ends[g - 1])
    return torch.tensor(ends, dtype=torch.int32, device=device)


def _grouped_forward(x: Tensor, w: Tensor, offs: Tensor, plan: LinearPlan) -> Tensor:
    """Every expert's rows times its weight in one `_scaled_grouped_mm` (rowwise): x's scales
    per row, each expert's per output row: the cells the loop quantizes, one call."""
    r, (g, n, k) = plan.recipe, w.shape
    xq = quantize(x, (Dim.whole(x.shape[0]), plan.k), r.x, E4M3, r.pow2)
    wq = quantize(w.reshape(g * n, k), (Dim.whole(g * n), plan.k), r.w, E4M3, r.pow2)
    return torch._scaled_grouped_mm(xq.data, wq.data.view(g, n, k).transpose(-2, -1), xq.scale.view(-1),
                                    wq.scale.view(g, n), offs=offs, out_dtype=torch.bfloat16)


def _grouped_input_grad(dy: Tensor, w: Tensor, offs: Tensor, plan: LinearPlan) -> Tensor:
    """dx = dy·W per expert in one `_scaled_grouped_mm`: dy's scales per row, each expert's W
    per input column (along N, the reduction), quantized together as [N, G·K]."""
    r, (g, n, k) = plan.recipe, w.shape
    dyq = quantize(dy, (Dim.whole(dy.shape[0]), plan.n), r.dy, r.grad_fmt, r.pow2)
    wq = quantize(w.permute(1, 0, 2).reshape(n, g * k), (plan.n, Dim.whole(g * k)), r.w_dgrad, E4M3, r.pow2)
    b = row_major(wq.data.view(n, g, k).permute(1, 2, 0)).transpose(-2, -1)  # [G, N, K], column-major
    return torch._scaled_grouped_mm(dyq.data, b, dyq.scale.view(-1), wq.scale.view(g, k), offs=offs,
                                    out_dtype=torch.bfloat16)


class Fp8Experts(torch.autograd.Function):
    """Rows grouped by expert times each expert's weight (w [G, N, K]), in fp8. Each group of
    rows is its own token dimension: one expert's tokens of one micro-batch, the tensor a
    single process would quantize. Rowwise on CUDA sm90: the forward and the input gradient
    are one `_scaled_grouped_mm` each (their scales are per row, whatever the group); the
    weight gradient loops, since its scales run along each group's tokens. MXFP8 on sm100:
    all three are one `_scaled_grouped_mm` each, on the groups padded to whole 32-blocks of
    tokens (kernels/mx_experts.py). Otherwise every product loops over the groups
    (`grouped_fp8` says why, once). `keys`: each group's NVFP4 stochastic rounding keys
    (`expert_keys`), or None to round to nearest."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, segments: list[tuple[int, int, int]], plan: LinearPlan,
                keys: list | None = None) -> Tensor:
        x = row_major(x)
        why = grouped_fp8(x, w, plan)
        if why:
            warn_once(why, topic=plan.recipe.kind)
        ctx.plan, ctx.segments, ctx.grouped, ctx.keys = plan, segments, why is None, keys
        ctx.save_for_backward(x, w)
        if why is None and plan.recipe.micro:
            ctx.layout = mx_experts.Padded.of(segments, w.shape[0])
            if not torch.compiler.is_compiling():
                plan.backends["forward"] = "scaled_grouped_mm"
            return mx_experts.forward(x, w, ctx.layout, plan)
        if why is None:
            ctx.offs = _expert_offsets(segments, w.shape[0], x.device)
            if not torch.compiler.is_compiling():
                plan.backends["forward"] = "scaled_grouped_mm"
            return _grouped_forward(x, w, ctx.offs, plan)
        parts, weights = [], {}
        for g, a, b in segments:
            if g not in weights:
                weights[g] = _quantize_weight(w.select(0, g), plan, plan.recipe.w)
            rows = x.narrow(0, a, b - a)
            parts.append(forward_matmul(rows, w.select(0, g), plan, Dim.whole(b - a), weights[g])[0] if b > a
                         else rows.new_zeros(0, w.shape[1]))
        return torch.cat(parts) if parts else x.new_zeros(0, w.shape[1])

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w = ctx.saved_tensors
        plan, grad = ctx.plan, row_major(grad)
        need_dx, need_dw = wanted(ctx, 0), wanted(ctx, 1)
        if ctx.grouped and plan.recipe.micro:
            if not torch.compiler.is_compiling():
                plan.backends.update({k: "scaled_grouped_mm" for k, need in (("input_grad", need_dx),
                                                                              ("weight_grad", need_dw)) if need})
            dx = mx_experts.input_grad(grad, w, ctx.layout, plan) if need_dx else None
            dw = mx_experts.weight_grad(grad, x, ctx.layout, plan).to(w.dtype) if need_dw else None
            return dx, dw, None, None, None
        acc = torch.float32 if w.dtype != torch.float64 else w.dtype
        dw = [torch.zeros(w.shape[1:], dtype=acc, device=w.device) for _ in range(w.shape[0])]
        dx = []
        if need_dx and ctx.grouped:
            dx = [_grouped_input_grad(grad, w, ctx.offs, plan)]
            if not torch.compiler.is_compiling():
                plan.backends["input_grad"] = "scaled_grouped_mm"
        weights: dict[int, Quantized] = {}
        for i, (g, a, b) in enumerate(ctx.segments):
            rows, dy = x.narrow(0, a, b - a), grad.narrow(0, a, b - a)
            if b == a:
                if need_dx and not ctx.grouped:
                    dx.append(x.new_zeros(0, x.shape[1]))
                continue
            tokens, sr = Dim.whole(b - a), ctx.keys[i] if ctx.keys else (None, None)
            dyq = quantize_grad(dy, plan, tokens, sr[0])
            if need_dx and not ctx.grouped:
                if g not in weights:
                    weights[g] = _quantize_weight(w.select(0, g), plan, plan.recipe.w_dgrad)
                dx.append(input_grad(dy, w.select(0, g), plan, tokens, dyq, weights[g]))
            if need_dw:
                dw[g] = dw[g] + weight_grad(dy, rows, plan, tokens, dyq, acc, sr[1])
        dx = (torch.cat(dx) if dx else x.new_zeros(x.shape)) if need_dx else None
        return dx, torch.stack(dw).to(w.dtype) if need_dw else None, None, None, None


def expert_keys(counts: Tensor, plan: LinearPlan, layer: str, first_expert: int = 0,
                sources: tuple[int, ...] = (0,)) -> list | None:
    """NVFP4's stochastic rounding keys of each group of rows (`segments_of`'s order): the
    input- and weight-gradient streams of expert `first_expert + g` (its global index) of
    `layer`, for the micro-batch its rows came from: `sources[s]` data-parallel ranks away for
    source s (under expert parallelism, each rank of the ep group; else this rank's own). So
    an expert's rows draw the numbers one process draws for that micro-batch and expert,
    whichever rank holds the expert. Each group's numbers start at its first row (the key
    names the micro-batch): row i, feature f of the group padded with zero rows to whole
    blocks draws the same number, padded or not. None without stochastic rounding."""
    rounding = plan.nv.rounding if plan.nv is not None else None
    if rounding is None:
        return None
    per = counts if counts.dim() == 2 else counts[:, None]
    keys = []
    for g in range(per.shape[0]):
        name = f"{layer}.{first_expert + g}"
        for s in range(per.shape[1]):
            away = sources[s] if per.shape[1] > 1 else 0
            keys.append(tuple((rounding.key(name, what, away)[0], 0) for what in ("input_grad", "weight_grad")))
    return keys


def fp8_expert_matmul(x: Tensor, w: Tensor, counts: Tensor, plan: LinearPlan, keys: list | None = None) -> Tensor:
    return Fp8Experts.apply(x, w, segments_of(counts), plan, keys)
