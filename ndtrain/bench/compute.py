"""This machine's compute, measured for the planner (plan/compute.Measured) on every local
rank at once, each with its share of the cores, as in training:
- matmul rates: a 1024³ matmul, then each dimension alone from 16 to 4096 (the others at
  1024), as `F.linear` computes x·Wᵀ in the model;
- the fused causal attention kernel (`F.scaled_dot_product_attention`), forward and
  backward, at sequences of 64 to 1024 and head sizes of 32 to 128;
- the bandwidth of a large elementwise operation (an addition of 4M-element tensors: three
  passes of 16 MB);
- the cost of one operation, forward and backward: a two-block decoder of width 32 on 8
  tokens (its arithmetic negligible), timed, over the operations it dispatches; and the
  fixed cost per block of zero bubble's split backward, the same decoder's split backward
  (parallel/pipeline/weightgrad.py) against its plain one; and per expert an MoE block
  visits, the same decoder with MoE blocks (8 experts, top-2) against the dense one;
- the optimizer step per parameter: zeroing the gradients, the global-norm clip's norm and
  scaling, AdamW as `train/optim.py` builds it, on 4M parameters in tensors of a model's
  sizes.
Every rank runs each measurement at the same moment (a barrier before each), and the
slowest rank's figure is kept. None of it looks at a training step: the planner composes
the step from these parts.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ndtrain.plan.compute import BASE, DIMS, Measured

SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
TARGET_S = 0.02  # timed seconds per repeat
OPTIMIZER_PARAMS = 4 * 2**20


def _together() -> None:
    if dist.is_initialized():
        dist.barrier()


def _slowest(value: float, largest: bool = True) -> float:
    """The largest (or smallest) of a figure over the ranks."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if largest else dist.ReduceOp.MIN)
    return float(t)


def seconds_per_call(fn, repeats: int = 3) -> float:
    """The median over `repeats` of one call's time, each repeat at least TARGET_S long
    (the slowest rank's)."""
    fn()
    _together()
    t0 = time.perf_counter()
    fn()
    calls = max(1, int(TARGET_S / max(time.perf_counter() - t0, 1e-7)))
    times = []
    for _ in range(repeats):
        _together()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return _slowest(statistics.median(times))


def matmul_rate(m: int, k: int, n: int) -> float:
    x, w = torch.randn(m, k), torch.randn(n, k)
    return 2.0 * m * k * n / seconds_per_call(lambda: F.linear(x, w))


def matmul_profiles() -> tuple[float, dict]:
    """(the BASE³ rate, each dimension's rates relative to it)."""
    base = matmul_rate(BASE, BASE, BASE)
    profiles = {}
    for d in DIMS:
        points = []
        for size in SIZES:
            shape = {x: (size if x == d else BASE) for x in DIMS}
            rate = base if size == BASE else matmul_rate(shape["m"], shape["k"], shape["n"])
            points.append((size, rate / base))
        profiles[d] = tuple(points)
    return base, profiles


def bandwidth() -> float:
    a, b, c = torch.randn(4 * 2**20), torch.randn(4 * 2**20), torch.empty(4 * 2**20)
    return 3 * a.numel() * 4 / seconds_per_call(lambda: torch.add(a, b, out=c))


ATTENTION_SEQ = (64, 256, 1024)
ATTENTION_DIM = (32, 64, 128)


def attention_rates() -> tuple:
    """((sequence, head_dim, forward FLOP/s, backward FLOP/s), ...) of the causal fused kernel,
    8 heads of one row (FLOPs: 2·s²·d per head forward, the causal half; twice that backward)."""
    out = []
    for s in ATTENTION_SEQ:
        for d in ATTENTION_DIM:
            q, k, v = (torch.randn(1, 8, s, d, requires_grad=True) for _ in range(3))
            flops = 2.0 * s * s * d * 8

            def forward():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            out_grad = torch.randn(1, 8, s, d)

            def both():
                torch.autograd.backward(forward(), out_grad)

            f = seconds_per_call(forward)
            b = max(seconds_per_call(both) - f, 1e-9)
            out.append((s, d, flops / f, 2 * flops / b))
    return tuple(out)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _decoder(moe: bool):
    """A two-block decoder of width 32 without its embedding, and 8 tokens: its arithmetic costs
    nothing next to its dispatch. `moe`: MoE blocks of 8 experts of 64, top-2."""
    from ndtrain.model.args import ModelArgs
    from ndtrain.model.llama import Transformer

    args = ModelArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64, max_seq_len=8,
                     moe_experts=8 if moe else 0, moe_top_k=2, moe_ffn_dim=64)
    torch.manual_seed(0)
    return Transformer(args, embed=False), args


def op_costs() -> tuple[float, float, float, tuple[float, float]]:
    """(seconds per operation of a decoder's forward, of its backward; per block of zero
    bubble's split backward; per expert an MoE block's loop visits, forward and backward),
    all from the small decoders of `_decoder`: the split (parallel/pipeline/weightgrad.py:
    B, then W) against the plain backward, over the blocks; the MoE decoder against the
    dense one, over the experts its blocks visit."""
    from ndtrain.model.loss import token_loss_sum
    from ndtrain.parallel.pipeline.weightgrad import SplitBackward

    x, y = torch.randn(1, 8, 32), torch.randint(0, 64, (1, 8))
    times = {}
    for moe in (False, True):
        model, args = _decoder(moe)

        def forward():
            return token_loss_sum(model(x.requires_grad_()), y)

        def both():
            forward().backward()

        times[moe] = (seconds_per_call(forward), seconds_per_call(both))
        if not moe:
            with _Count() as f_ops:
                loss = forward()
            with _Count() as b_ops:
                loss.backward()

            def split():
                inp = x.detach().requires_grad_()
                SplitBackward(token_loss_sum(model(inp), y), inp, None).weights()

            fs = seconds_per_call(split)
    (f, fb), (mf, mfb) = times[False], times[True]
    visits = 2 * 8  # blocks × experts
    expert = (max(mf - f, 0.0) / visits, max((mfb - mf) - (fb - f), 0.0) / visits)
    return f / f_ops.n, max(fb - f, 0.0) / b_ops.n, max(fs - fb, 0.0) / args.n_layers, expert


def optimizer_cost(train) -> float:
    """Seconds per parameter of zero_grad, the clip (norm and scaling) and AdamW."""
    from ndtrain.train.optim import build_optimizer

    sizes = [1024 * 1024, 1024 * 1024, 1024 * 512, 1024 * 512, 1024] * 2
    scale = OPTIMIZER_PARAMS / sum(sizes)
    params = [torch.nn.Parameter(torch.randn(int(n * scale))) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = build_optimizer([{"params": params, "weight_decay": train.weight_decay}], train, torch.device("cpu"))
    grads = [p.grad for p in params]

    def step():
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        torch._foreach_mul_(grads, (1.0 / (norm + 1e-6)).clamp(max=1.0))
        optimizer.step()
        for g in grads:
            g.zero_()

    return seconds_per_call(step, repeats=2) / sum(p.numel() for p in params)


def measure(train, ranks: int, threads: int) -> Measured:
    """Every figure, on every rank at once (collective when distributed)."""
    rate, profiles = matmul_profiles()
    forward_op, backward_op, split, expert = op_costs()
    return Measured(rate, profiles, bandwidth(), attention_rates(), forward_op, backward_op, optimizer_cost(train),
                    split, expert, ranks, threads)


def median(models: list[Measured]) -> Measured:
    """Figure by figure, the median of several measurements (rounds)."""
    first = models[0]
    mid = lambda xs: statistics.median(xs)  # noqa: E731
    profiles = {d: tuple((size, mid([m.profiles[d][i][1] for m in models])) for i, (size, _) in enumerate(pts))
                for d, pts in first.profiles.items()}
    attention = tuple((p[0], p[1], mid([m.attention[i][2] for m in models]), mid([m.attention[i][3] for m in models]))
                      for i, p in enumerate(first.attention))
    return Measured(mid([m.rate for m in models]), profiles, mid([m.bandwidth for m in models]), attention,
                    mid([m.forward_op_s for m in models]), mid([m.backward_op_s for m in models]),
                    mid([m.optimizer_s for m in models]), mid([m.split_s for m in models]),
                    tuple(mid([m.expert_s[i] for m in models]) for i in (0, 1)), first.ranks, first.threads)
