"""The fp8 CUDA calls, checked on the CPU: every `torch._scaled_mm` (and grouped product) that
ndtrain's fp8 code makes, run through ndtrain's own functions on fake CUDA tensors with the
shapes of a real run. torch's meta kernels then enforce CUDA's rules (mat1 row-major, mat2
column-major, K and N multiples of 16, the scale shapes of each scaling).

The meta kernel does not check how a blockwise scale is laid in memory; the H200 did
(docs/benchmarks-gpu.md): scale_a [M, K/128] column-major; scale_b [K/128, N/128] column-major
for 128×128 blocks, [K/128, N] row-major for 1×128 tiles; any other layout was refused. The
recorder below asserts those layouts on every blockwise call.

FakeTensorMode cannot tell a device's capability, so `kernels.fp8.device_capability` is
patched (sm90 unless a test says otherwise). Shapes: the 1B preset (dim 2048, MLP 8192,
4 × 2048 tokens per micro-batch), its shards over tp = 8, and TinyLlama's MLP (5632 over
tp = 8: 704 per rank, so 128-blocks straddle ranks).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ndtrain.kernels.fp8 as fp8
from ndtrain.kernels.fp8 import BLOCK, Dim
from ndtrain.kernels.fp8_linear import RECIPES, Fp8Experts, Fp8Linear, LinearPlan, predict_backends, segments_of

FP8 = {name: r for name, r in RECIPES.items() if not r.micro}  # the micro-scaled ones: tests/test_mx.py

CUDA = torch.device("cuda")
TOKENS = 4 * 2048
DIM, FFN = 2048, 8192


class NoReduce:
    """One process standing for a tensor-parallel rank: the amax reduction a shard would make
    (its result does not change the shapes the kernels see)."""

    def max_(self, t):
        pass


def shard(local: int, full: int, rank: int) -> Dim:
    return Dim(local, full, rank * local, split=NoReduce(), aligned=local)


@pytest.fixture
def calls(monkeypatch):
    """sm90, a fresh warn-once memory, and every `torch._scaled_mm` call recorded."""
    monkeypatch.setattr(fp8, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(fp8, "_WARNED", set())
    seen = []
    real = torch._scaled_mm

    def recorder(a, b, scale_a, scale_b, **kw):
        seen.append({"a": tuple(a.shape), "b": tuple(b.shape), "sa": (tuple(scale_a.shape), scale_a.stride()),
                     "sb": (tuple(scale_b.shape), scale_b.stride())})
        return real(a, b, scale_a=scale_a, scale_b=scale_b, **kw)
    monkeypatch.setattr(torch, "_scaled_mm", recorder)
    return seen


def column_major(shape):
    return shape, (1, shape[0])


def row_major(shape):
    return shape, (shape[1], 1)


def assert_laid_as_measured(call):
    """A blockwise call's scales, laid as the H200 took them (module docstring)."""
    m, k = call["a"]
    n = call["b"][1]
    blocks = k // BLOCK
    assert call["sa"] == column_major((m, blocks)), call
    if call["sb"][0] == (blocks, n // BLOCK):
        assert call["sb"] == column_major((blocks, n // BLOCK)), call
    else:
        assert call["sb"] == row_major((blocks, n)), call


class Ctx:
    """What `Fp8Linear` asks of autograd's context: a CPU-only torch cannot run autograd's
    engine on fake CUDA tensors (it aborts), so the test calls forward and backward itself."""

    needs_input_grad = (True, True, False, False, False)
    next_functions = (((torch.ones(1, requires_grad=True) * 2).grad_fn, 0),) * 5  # outside a backward pass: wanted


    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def fake_step(plan: LinearPlan, tokens: int, dtype=torch.bfloat16, token_dim: Dim | None = None):
    """`Fp8Linear`'s forward and backward on fake CUDA tensors; the warnings they gave."""
    with warnings.catch_warnings(record=True) as caught, FakeTensorMode(allow_non_fake_inputs=True):
        warnings.simplefilter("always")
        x = torch.empty(tokens, plan.k.size, device=CUDA, dtype=dtype)
        w = torch.empty(plan.n.size, plan.k.size, device=CUDA, dtype=dtype)
        ctx = Ctx()
        y = Fp8Linear.forward(ctx, x, w, None, plan, token_dim or Dim.whole(tokens))
        assert y.shape == (tokens, plan.n.size) and y.device.type == "cuda"
        dx, dw, *_ = Fp8Linear.backward(ctx, torch.empty_like(y))
        assert dx.shape == x.shape and dw.shape == w.shape
    return [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]


ONE_CALL = {"forward": "scaled_mm", "input_grad": "scaled_mm", "weight_grad": "scaled_mm"}
SHAPES = {  # (k, n) as this rank holds them
    "w1 [8192, 2048]": lambda: (Dim.whole(DIM), Dim.whole(FFN)),
    "w2 [2048, 8192]": lambda: (Dim.whole(FFN), Dim.whole(DIM)),
    "w1 column shard tp8 rank 3": lambda: (Dim.whole(DIM), shard(FFN // 8, FFN, 3)),
    "w2 row shard tp8 rank 3": lambda: (shard(FFN // 8, FFN, 3), Dim.whole(DIM)),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("recipe", sorted(FP8))
def test_every_matmul_is_one_scaled_mm_on_sm90(calls, recipe, shape):
    """Whole or 128-aligned shards: each of the three matmuls is one `_scaled_mm` that CUDA's
    rules accept, with blockwise scales laid as measured, and nothing warns."""
    k, n = SHAPES[shape]()
    plan = LinearPlan(RECIPES[recipe], k, n)
    assert fake_step(plan, TOKENS) == []
    assert plan.backends == ONE_CALL
    assert len(calls) == 3
    if recipe == "blockwise":
        for call in calls:
            assert_laid_as_measured(call)
        forms = [c["sb"][0][1] == c["b"][1] for c in calls]
        assert forms == [False, False, True], "128×128 for forward and input grad, 1×128 for the weight grad"


def test_a_shard_that_cuts_128_blocks_runs_per_run_and_says_so(calls):
    """TinyLlama's MLP (5632) over tp 8: rank 1 holds features 704..1408, so its first and
    last 128-blocks are shared with its neighbours. The row-parallel w2's forward and input
    gradient run one `_scaled_mm` per 128-run, each accepted by CUDA's rules; a warning names
    the product and the reason, once each."""
    plan = LinearPlan(RECIPES["blockwise"], shard(704, 5632, 1), Dim.whole(DIM))
    warned = fake_step(plan, TOKENS)
    assert plan.backends == {"forward": "scaled_mm_runs", "input_grad": "scaled_mm_runs", "weight_grad": "scaled_mm"}
    assert len(warned) == 2
    assert "[8192×704]·[704×2048]" in warned[0] and "cut by a shard" in warned[0]
    widths = sorted({c["a"][1] for c in calls[:-1]})
    assert widths == [64, 128], "runs 704..768 (64 wide), then whole blocks"
    assert fake_step(plan, TOKENS) == [], "once per reason"


def test_context_parallel_tokens_run_the_weight_gradient_per_run_and_say_so(calls):
    """cp = 2: this rank holds chunks 0 and 3 of each sequence's 4 (zigzag), 512 tokens each, so
    the weight gradient's 128-token tiles are whole but out of order: one `_scaled_mm` per
    tile, warned. Forward and input gradient reduce over features: one call each."""
    from ndtrain.parallel.context.layout import zigzag_index
    seq, cp = 2048, 2
    index = (torch.arange(4)[:, None] * seq + zigzag_index(seq, cp, 0)[None, :]).flatten()
    tokens = Dim(index.numel(), 4 * seq, index=index, split=NoReduce(), aligned=True)
    plan = LinearPlan(RECIPES["blockwise"], Dim.whole(DIM), Dim.whole(FFN))
    tokens.runs(BLOCK)  # read from the (real, host) index once, as a run's first step does; fake mode can't
    warned = fake_step(plan, tokens.size, token_dim=tokens)
    assert plan.backends == {"forward": "scaled_mm", "input_grad": "scaled_mm", "weight_grad": "scaled_mm_runs"}
    assert len(calls) == 2 + tokens.size // BLOCK
    assert len(warned) == 1 and "not in order" in warned[0]
    assert predict_backends(plan, tokens, torch.bfloat16, CUDA) == plan.backends


@pytest.mark.parametrize("recipe, expected", [
    ("tensorwise", "scaled_mm"), ("rowwise", "scaled_mm_runs"), ("blockwise", "scaled_mm_runs")])
def test_sm89_gets_tensorwise_in_one_call_and_the_others_per_run(calls, monkeypatch, recipe, expected):
    monkeypatch.setattr(fp8, "device_capability", lambda device: (8, 9))
    plan = LinearPlan(RECIPES[recipe], Dim.whole(DIM), Dim.whole(FFN))
    warned = fake_step(plan, TOKENS)
    assert set(plan.backends.values()) == {expected}
    assert all("needs sm90, this GPU is sm89" in w for w in warned) and len(warned) == (expected != "scaled_mm")


def test_below_sm89_everything_emulates_and_says_so(calls, monkeypatch):
    monkeypatch.setattr(fp8, "device_capability", lambda device: (8, 0))
    plan = LinearPlan(RECIPES["tensorwise"], Dim.whole(DIM), Dim.whole(FFN))
    warned = fake_step(plan, TOKENS)
    assert set(plan.backends.values()) == {"emulate"} and calls == []
    assert len(warned) == 1 and "sm80 has no fp8 tensor cores" in warned[0]


def test_m_need_not_be_a_multiple_of_16_but_k_and_n_must(calls):
    """100 tokens: forward and input gradient (M = 100) still run `_scaled_mm`; the weight
    gradient reduces over the tokens (K = 100) and must emulate, with a warning."""
    plan = LinearPlan(RECIPES["tensorwise"], Dim.whole(DIM), Dim.whole(FFN))
    warned = fake_step(plan, 100)
    assert plan.backends == {"forward": "scaled_mm", "input_grad": "scaled_mm", "weight_grad": "emulate"}
    assert len(warned) == 1 and "K and N multiples of 16 (K=100, N=2048)" in warned[0]
    assert [c["a"][0] for c in calls] == [100, 100]


def test_predicted_backends_are_the_ones_a_run_records(calls):
    """The dry run and metrics.jsonl report `predict_backends` (fake tensors, usable under
    torch.compile); here against the record a (fake) run leaves, in every case above."""
    for recipe in sorted(FP8):
        for k, n in [SHAPES[s]() for s in sorted(SHAPES)] + [(shard(704, 5632, 1), Dim.whole(DIM))]:
            for tokens in (TOKENS, 100):
                plan = LinearPlan(RECIPES[recipe], k, n)
                fake_step(plan, tokens)
                assert predict_backends(plan, Dim.whole(tokens), torch.bfloat16, CUDA) == plan.backends


# -- routed experts ---------------------------------------------------------------------------------

EXPERTS, HIDDEN = 8, 1024  # the probe's MoE shape: 8 experts over the 8192 tokens, 1024 wide
SIZES = [1600, 512, 1024, 1024, 640, 1408, 896, 1088]


@pytest.fixture
def grouped_calls(monkeypatch, calls):
    """`torch._scaled_grouped_mm` recorded (on top of `calls`)."""
    seen = []
    real = torch._scaled_grouped_mm

    def recorder(a, b, scale_a, scale_b, **kw):
        seen.append({"a": tuple(a.shape), "b": (tuple(b.shape), b.stride()), "sa": tuple(scale_a.shape),
                     "sb": tuple(scale_b.shape), "offs": kw["offs"].dtype, "a_stride": a.stride(),
                     "dtypes": (a.dtype, b.dtype, scale_a.dtype, scale_b.dtype), "offs_shape": tuple(kw["offs"].shape)})
        return real(a, b, scale_a, scale_b, **kw)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", recorder)
    return seen


def fake_experts(recipe: str, dims=(DIM, HIDDEN), sources: int = 1, counts=None):
    """`Fp8Experts` forward and backward on fake CUDA tensors, w [E, N, K]; the warnings."""
    k, n = dims
    if counts is None:
        counts = torch.tensor(SIZES)[:, None].expand(EXPERTS, sources) // sources
    plan, segments, rows = LinearPlan(RECIPES[recipe], Dim.whole(k), Dim.whole(n)), segments_of(counts), int(counts.sum())
    with warnings.catch_warnings(record=True) as caught, FakeTensorMode():
        warnings.simplefilter("always")
        x = torch.empty(rows, k, device=CUDA, dtype=torch.bfloat16)
        w = torch.empty(counts.shape[0], n, k, device=CUDA, dtype=torch.bfloat16)
        ctx = Ctx()
        y = Fp8Experts.forward(ctx, x, w, segments, plan)
        assert y.shape == (x.shape[0], n) and y.device.type == "cuda"
        dx, dw = Fp8Experts.backward(ctx, torch.empty_like(y))[:2]
        assert dx.shape == x.shape and dw.shape == w.shape
    return plan, [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]


@pytest.mark.parametrize("sources", [1, 2])
def test_rowwise_experts_run_one_scaled_grouped_mm_forward_and_input_grad(grouped_calls, calls, sources):
    """sm90, rowwise: forward [T, K]·[E, K, N] and input gradient [T, N]·[E, N, K], each one
    `_scaled_grouped_mm` that CUDA's rules take (mat_b column-major per expert, scales [T]
    and [E, N]); the weight gradient loops over the groups (expert × source) with one
    `_scaled_mm` each (unit scales and fp32 output, since it sums the groups' products of an
    expert in fp32 and rowwise `_scaled_mm` writes bf16 only), and says so once."""
    plan, warned = fake_experts("rowwise", sources=sources)
    tokens = sum(SIZES) // sources * sources
    assert [(c["a"], c["b"][0], c["sa"], c["sb"]) for c in grouped_calls] == [
        ((tokens, DIM), (EXPERTS, DIM, HIDDEN), (tokens,), (EXPERTS, HIDDEN)),
        ((tokens, HIDDEN), (EXPERTS, HIDDEN, DIM), (tokens,), (EXPERTS, DIM))]
    assert all(c["b"][1][1] == 1 and c["offs"] == torch.int32 for c in grouped_calls), "mat_b column-major"
    assert len(calls) == EXPERTS * sources, "one weight-gradient _scaled_mm per group"
    assert plan.backends == {"forward": "scaled_grouped_mm", "input_grad": "scaled_grouped_mm",
                             "weight_grad": "scaled_mm_runs"}
    assert len(warned) == 1 and "rowwise _scaled_mm writes bf16" in warned[0]


@pytest.mark.parametrize("recipe, weight_grad, calls_per_expert, lines", [
    ("tensorwise", "scaled_mm", 3, 1),
    # the weight gradient reduces over each group's tokens (1600: not whole 128-blocks) and
    # sums an expert's groups in fp32 (512: whole blocks, but torch's blockwise writes bf16)
    ("blockwise", "scaled_mm_runs", None, 3)])
def test_other_recipes_loop_over_the_experts_and_say_so(grouped_calls, calls, recipe, weight_grad, calls_per_expert,
                                                        lines):
    plan, warned = fake_experts(recipe)
    assert grouped_calls == []
    assert plan.backends == {"forward": "scaled_mm", "input_grad": "scaled_mm", "weight_grad": weight_grad}
    if calls_per_expert:
        assert len(calls) == calls_per_expert * EXPERTS
    else:
        assert len(calls) == 2 * EXPERTS + sum(-(-t // BLOCK) for t in SIZES)
    assert "grouped fp8 product takes rowwise scales only" in warned[0]
    assert len(warned) == lines


@pytest.mark.parametrize("cap, why, loop", [
    ((8, 9), "_scaled_grouped_mm needs sm90", {"scaled_mm_runs"}),  # no rowwise _scaled_mm on sm89 either
    ((10, 0), "_scaled_grouped_mm runs on sm90 only, this GPU is sm100", {"scaled_mm", "scaled_mm_runs"})])
def test_rowwise_experts_off_sm90_loop_and_say_so(grouped_calls, calls, monkeypatch, cap, why, loop):
    """torch 2.13's rowwise grouped fp8 kernel is sm90's: on sm89 and on sm100 the experts loop."""
    monkeypatch.setattr(fp8, "device_capability", lambda device: cap)
    plan, warned = fake_experts("rowwise")
    assert grouped_calls == [] and set(plan.backends.values()) == loop
    assert any(why in w for w in warned), warned


# MXFP8 on sm100 (kernels/mx_experts.py): tiny-moe's experts (dim 64, 8 experts of 64; rows
# from 2 sources, as under ep2: groups of 0 to 414 rows, most not whole 32-blocks) and the
# probe's 8 experts at dim 2048 (w1 [8, 1024, 2048] and w2 [8, 2048, 1024]).
TINY_COUNTS = torch.tensor([[130, 61], [0, 0], [77, 12], [301, 290], [5, 64], [64, 33], [33, 414], [414, 150]])
MX_EXPERTS = {"tiny-moe w1": ((64, 64), TINY_COUNTS),
              "dim 2048 w1": ((DIM, HIDDEN), torch.tensor(SIZES)[:, None]),
              "dim 2048 w2, 2 sources": ((HIDDEN, DIM), torch.tensor(SIZES)[:, None].expand(EXPERTS, 2) // 2 + 3)}


@pytest.fixture
def sm100(monkeypatch, grouped_calls):
    """sm100 and a torch built with its MXFP8 grouped kernel (USE_MSLK)."""
    from ndtrain.kernels import mx_experts
    monkeypatch.setattr(fp8, "device_capability", lambda device: (10, 0))
    monkeypatch.setattr(mx_experts, "grouped_built", lambda: True)
    return grouped_calls


def up(n, m):
    return -(-n // m) * m


@pytest.mark.parametrize("case", sorted(MX_EXPERTS))
def test_mxfp8_experts_run_one_scaled_grouped_mm_per_matmul_on_sm100(sm100, calls, case):
    """Forward (2-D × 3-D), input gradient (2-D × 3-D) and weight gradient (2-D × 2-D, the
    tokens grouped along K) are one `_scaled_grouped_mm` each that torch's meta kernel takes:
    E4M3 operands, float8_e8m0fnu scales, mat_a row-major, mat_b column-major, int32 offsets.
    Each group of rows padded to a multiple of 32 (T'); the scale sizes the kernel reads (the
    meta checks the 3-D operand's only): per expert's rows padded to 128 for a 2-D operand
    grouped by rows, per expert's tokens/32 padded to 4 for one grouped along K. The plan
    reports the grouped op for all three, nothing warns, no `_scaled_mm` runs."""
    (k, n), counts = MX_EXPERTS[case]
    plan, warned = fake_experts("mxfp8", (k, n), counts=counts)
    e8m0, e4m3 = torch.float8_e8m0fnu, torch.float8_e4m3fn
    per_expert = [sum(up(c, 32) for c in row) for row in counts.tolist()]
    t = sum(per_expert)
    rows128 = sum(up(p, 128) for p in per_expert)
    cols4 = sum(up(p // 32, 4) for p in per_expert)
    g = len(per_expert)
    assert [(c["a"], c["a_stride"], c["b"], c["sa"], c["sb"]) for c in sm100] == [
        ((t, k), (k, 1), ((g, k, n), (n * k, 1, k)), (rows128, up(k // 32, 4)), (g, up(n, 128) * up(k // 32, 4))),
        ((t, n), (n, 1), ((g, n, k), (n * k, 1, n)), (rows128, up(n // 32, 4)), (g, up(k, 128) * up(n // 32, 4))),
        ((n, t), (t, 1), ((t, k), (1, t)), (up(n, 128), cols4), (up(k, 128), cols4))]
    assert all(c["dtypes"] == (e4m3, e4m3, e8m0, e8m0) and c["offs"] == torch.int32 and c["offs_shape"] == (g,)
               for c in sm100)
    assert plan.backends == dict.fromkeys(("forward", "input_grad", "weight_grad"), "scaled_grouped_mm")
    assert warned == [] and calls == []


@pytest.mark.parametrize("recipe, cap, built, reason", [
    ("nvfp4", (10, 0), True, "takes E4M3 operands only, not NVFP4's float4_e2m1fn_x2"),
    ("mxfp8", (9, 0), True, "MXFP8 _scaled_grouped_mm needs sm100, this GPU is sm90"),
    ("mxfp8", (10, 0), False, "built without its MXFP8 grouped kernel (USE_MSLK)")])
def test_micro_scaled_experts_that_cannot_group_loop_and_say_why(sm100, monkeypatch, recipe, cap, built, reason):
    """NVFP4 (torch 2.13's grouped product takes no fp4 operands), MXFP8 off sm100 or without
    the kernel: the per-group loop, no grouped call, one warning naming the reason."""
    from ndtrain.kernels import mx_experts
    monkeypatch.setattr(fp8, "device_capability", lambda device: cap)
    monkeypatch.setattr(mx_experts, "grouped_built", lambda: built)
    plan, warned = fake_experts(recipe, (64, 64), counts=torch.tensor([[5, 3], [0, 0], [40, 0]]))
    assert sm100 == [] and "scaled_grouped_mm" not in plan.backends.values()
    assert sum(reason in w for w in warned) == 1 and f"{recipe} routed experts run one product per expert" in warned[0]


def test_the_bf16_grouped_mm_as_the_moe_block_calls_it():
    """The plain model's experts in bf16 on CUDA: one `torch._grouped_mm` (model/moe.py)."""
    from ndtrain.model.moe import expert_matmul, grouped
    with FakeTensorMode():
        x = torch.empty(sum(SIZES), DIM, device=CUDA, dtype=torch.bfloat16)
        w = torch.empty(EXPERTS, HIDDEN, DIM, device=CUDA, dtype=torch.bfloat16)
        counts = torch.empty(EXPERTS, device=CUDA, dtype=torch.int64)
        assert grouped(x, w)
        assert expert_matmul(x, w, counts).shape == (sum(SIZES), HIDDEN)


def test_quantizing_divides_by_device_tensors_never_by_host_scalars():
    """CUDA divides by a host scalar as a multiplication by its reciprocal, one ulp off true
    division (an H200 quantized 8 of 16,384 values differently from the CPU for that reason,
    docs/benchmarks-gpu.md). Every division the quantizers make on fake CUDA tensors, for
    every recipe and both formats, has its divisor on the GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from ndtrain.kernels.fp8 import E4M3, E5M2, Dim, quantize

    divisors = []

    class Divisions(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.div, torch.ops.aten.div_, torch.ops.aten.reciprocal):
                divisors.append((str(func), args[1].device.type if len(args) > 1 and
                                 isinstance(args[1], torch.Tensor) else type(args[-1]).__name__))
            return func(*args, **(kwargs or {}))

    with FakeTensorMode(), Divisions():
        x = torch.empty((256, 512), dtype=torch.bfloat16, device="cuda")
        for recipe in FP8.values():
            for fmt in (E4M3, E5M2):
                for blocks in (recipe.x, recipe.w, recipe.dy_wgrad):
                    quantize(x, (Dim.whole(256), Dim.whole(512)), blocks, fmt, recipe.pow2)
        from ndtrain.kernels import mx  # and the micro-scaled formats' (MXFP8, NVFP4 with its rounding)
        dims = (Dim.whole(256), Dim.whole(512))
        mx.quantize_mx(x, dims, (1, 32))
        mx.quantize_nv(x, dims, (16, 16), torch.empty((256, 512), device="cuda"))
    assert divisors and all(device == "cuda" for _, device in divisors), divisors
