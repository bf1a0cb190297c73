"""FP8: the quantizers, the scaled matmul and its back ends, the fp8 linear's three matmuls,
shards that agree on their scales, and the configuration rules (issue 21).

Error bounds used below (u: unit roundoff of the accumulation, 2^-24 in fp32, 2^-53 in fp64;
γ_n = n·u / (1 − n·u)):
- Accumulation. Products of two fp8 values are exact in fp32 (4 + 4 significant bits). A
  run of at most 128 of them summed in fp32 is within γ_127 of its exact sum (any order);
  the scale product s_a·s_b and the multiply-add into the accumulator add 3 roundings, and
  each of the C runs' additions one more. So |emulated − exact| ≤ γ_{130+C} · Σ_k |a_k||b_k|,
  the sum taken over the dequantized operands.
- Quantization. E4M3 keeps 3 fraction bits: a normal value rounds within 2^-4 of itself
  (relative); below the smallest normal (2^-6 of a cell's scale unit) the spacing is 2^-9,
  so a subnormal is within 2^-10·s. Per element |x − deq(x)| ≤ max(2^-4·|x|, 2^-10·s), and
  |A·Bᵀ − deq(A)·deq(B)ᵀ| ≤ Σ_k (e_a|b| + |a|e_b + e_a·e_b).
"""

from __future__ import annotations

import math

import pytest
import torch

from ndtrain.kernels.fp8 import (BLOCK, CPU_ROWWISE, E4M3, E5M2, FMAX, WHOLE, Dim, amax_to_scale, quantize,
                                 quantize_with, scaled_matmul)
from ndtrain.kernels.fp8_linear import RECIPES, LinearPlan, fp8_linear, segments_of

FP8 = {name: r for name, r in RECIPES.items() if not r.micro}  # the micro-scaled ones: tests/test_mx.py
from ndtrain.testing import run_ranks


def gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def whole(x: torch.Tensor) -> tuple[Dim, Dim]:
    return Dim.whole(x.shape[0]), Dim.whole(x.shape[1])


def reference_dequantized(x: torch.Tensor, blocks: tuple[int, int], fmt=E4M3, pow2=False) -> torch.Tensor:
    """An independent quantizer: pad to whole cells, reshape, amax per cell, scale, round, and
    back to fp64. What kernels/fp8.quantize must agree with bit for bit."""
    rows, cols = x.shape
    rb, cb = blocks[0] or rows, blocks[1] or cols
    pr, pc = -(-rows // rb) * rb, -(-cols // cb) * cb
    padded = torch.zeros(pr, pc, dtype=torch.float64)
    padded[:rows, :cols] = x.double()
    cells = padded.view(pr // rb, rb, pc // cb, cb)
    amax = cells.abs().amax(dim=(1, 3), keepdim=True)
    scale = amax.float().clamp_min(1e-12) / FMAX[fmt]
    if pow2:
        scale = 2.0 ** torch.ceil(torch.log2(scale.double())).float()
    q = (cells / scale.double()).clamp(-FMAX[fmt], FMAX[fmt]).to(fmt)
    return (q.double() * scale.double()).view(pr, pc)[:rows, :cols]


def random_wide(shape, seed: int) -> torch.Tensor:
    """Values over about six binades, signs mixed: fp8's rounding in every regime."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * torch.exp(2 * torch.randn(shape, generator=g,
                                                                                             dtype=torch.float64))


# -- scales ----------------------------------------------------------------------------------


def test_tensorwise_scale_is_amax_over_fmax_and_the_largest_value_lands_on_fmax():
    x = random_wide((33, 70), 0)
    for fmt in (E4M3, E5M2):
        q = quantize(x, whole(x), (WHOLE, WHOLE), fmt)
        assert q.scale.shape == (1, 1)
        assert q.scale.item() == (x.abs().max().float() / FMAX[fmt]).item()
        assert q.data.float().abs().max().item() == FMAX[fmt]
        assert torch.equal(q.dequantized(), reference_dequantized(x, (WHOLE, WHOLE), fmt))


def test_rowwise_power_of_two_scales_cover_each_row_without_overflow():
    x = random_wide((40, 90), 1)
    q = quantize(x, whole(x), (1, WHOLE), E4M3, pow2=True)
    assert q.scale.shape == (40, 1)
    s = q.scale.flatten().double()
    assert torch.equal(torch.exp2(torch.log2(s).round()), s), "not powers of two"
    amax = x.abs().amax(1)
    assert ((amax / s <= FMAX[E4M3]) & (amax / s > FMAX[E4M3] / 2)).all(), "the smallest power of two that fits"
    assert torch.equal(q.dequantized(), reference_dequantized(x, (1, WHOLE), E4M3, pow2=True))


def test_saturation_clamps_to_the_largest_finite_value():
    x = torch.tensor([[1e6, -1e6, 3.0, float(FMAX[E4M3]) * 1.06]], dtype=torch.float64)
    for fmt in (E4M3, E5M2):
        q = quantize_with(x, torch.tensor(1.0), fmt).float()
        assert q.isfinite().all()
        assert q[0, :2].tolist() == [FMAX[fmt], -FMAX[fmt]]
        assert q[0, 2].item() == 3.0
    assert quantize_with(x, torch.tensor(1.0), E4M3).float()[0, 3].item() == FMAX[E4M3]
    # current scaling: amax / (amax / fmax) can round above fmax by one unit; the clamp holds it
    scale = amax_to_scale(torch.tensor(448.0 * 3.0000001), E4M3)
    assert quantize_with(torch.tensor([448.0 * 3.0000001]), scale, E4M3).float().item() == FMAX[E4M3]


# -- cells: tiles, blocks, boundaries, zeros -------------------------------------------------------


@pytest.mark.parametrize("blocks", [(1, BLOCK), (BLOCK, BLOCK), (BLOCK, 1)])
def test_tile_and_block_boundaries_fall_every_128(blocks):
    """300 columns are tiles [0,128) [128,256) [256,300); 200 rows are blocks of 128 and 72.
    A spike just before a boundary scales only its own cell."""
    x = random_wide((200, 300), 2)
    x[5, 127] = 1e7
    q = quantize(x, whole(x), blocks)
    rows, cols = (200 if blocks[0] == 1 else 2), (300 if blocks[1] == 1 else 3)
    assert q.scale.shape == (rows, cols)
    assert torch.equal(q.dequantized(), reference_dequantized(x, blocks))
    spike = q.scales()
    assert spike[5, 127] == amax_to_scale(torch.tensor(1e7), E4M3)
    if blocks[1] == BLOCK:
        assert spike[5, 128] < spike[5, 127] / 10, "column 128 is in the next tile"


def test_a_zero_tile_quantizes_to_zeros_with_a_finite_scale():
    x = random_wide((4, 300), 3)
    x[:, 128:256] = 0.0
    q = quantize(x, whole(x), (1, BLOCK))
    assert (q.data[:, 128:256].float() == 0).all()
    assert q.scale.isfinite().all() and (q.scale > 0).all()
    w = random_wide((8, 300), 4)
    out = scaled_matmul(q, quantize(w, whole(w), (BLOCK, BLOCK)), Dim.whole(300).runs(BLOCK), torch.float32)
    assert out.isfinite().all()


# -- the scaled matmul --------------------------------------------------------------------------


def accumulation_bound(a, b, runs: int, u: float) -> torch.Tensor:
    return gamma(BLOCK + 2 + runs, u) * (a.dequantized().abs() @ b.dequantized().abs().t())


def quantization_bound(x: torch.Tensor, blocks, fmt=E4M3) -> torch.Tensor:
    q = quantize(x, whole(x), blocks, fmt)
    return torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * q.scales().double())


def test_blockwise_emulation_against_fp64_within_the_derived_bounds():
    """The fp32 emulation (a partial sum per 128-run, scaled, accumulated in fp32) against the
    same fp8 operands multiplied in fp64, and against the unquantized product."""
    a, b = random_wide((64, 300), 5), random_wide((48, 300), 6)
    qa, qb = quantize(a, whole(a), (1, BLOCK)), quantize(b, whole(b), (BLOCK, BLOCK))
    runs = Dim.whole(300).runs(BLOCK)
    assert [r[:2] for r in runs] == [(0, 128), (128, 256), (256, 300)]
    emulated = scaled_matmul(qa, qb, runs, torch.float32, backend="emulate").double()
    exact = qa.dequantized() @ qb.dequantized().t()
    acc = accumulation_bound(qa, qb, len(runs), 2.0**-24)
    assert ((emulated - exact).abs() <= acc).all()
    ea, eb = quantization_bound(a, (1, BLOCK)), quantization_bound(b, (BLOCK, BLOCK))
    quant = ea @ b.abs().t() + a.abs() @ eb.t() + ea @ eb.t()
    true = a @ b.t()
    ratio = ((emulated - true).abs() / (quant + acc)).max().item()
    assert ratio <= 1.0
    print(f"blockwise emulation: worst error {ratio:.2f} of the derived bound")


@pytest.mark.parametrize("blocks", [((WHOLE, WHOLE), (WHOLE, WHOLE)), ((1, WHOLE), (1, WHOLE))])
def test_cpu_scaled_mm_agrees_with_the_exact_product(blocks):
    """torch._scaled_mm on the CPU against fp64: tensorwise one call; rowwise one call where this
    torch's CPU kernel takes a scale per row (2.13), else one call with unit scales (2.11)."""
    a, b = random_wide((32, 96), 7), random_wide((24, 96), 8)
    qa, qb = quantize(a, whole(a), blocks[0]), quantize(b, whole(b), blocks[1])
    runs = Dim.whole(96).runs(WHOLE)
    out = scaled_matmul(qa, qb, runs, torch.float32, backend="scaled_mm").double()
    assert ((out - qa.dequantized() @ qb.dequantized().t()).abs() <= accumulation_bound(qa, qb, 1, 2.0**-24)).all()


def test_the_run_by_run_scaled_mm_path_agrees_with_the_emulation():
    """Blockwise through `_scaled_mm` one 128-run at a time with unit scales and fp32 output
    (the CUDA path's arithmetic), run on the CPU kernel, against fp64."""
    a, b = random_wide((16, 400), 9), random_wide((32, 400), 10)
    qa, qb = quantize(a, whole(a), (1, BLOCK)), quantize(b, whole(b), (BLOCK, BLOCK))
    runs = Dim.whole(400).runs(BLOCK)
    out = scaled_matmul(qa, qb, runs, torch.float32, backend="scaled_mm").double()
    exact = qa.dequantized() @ qb.dequantized().t()
    assert ((out - exact).abs() <= accumulation_bound(qa, qb, len(runs), 2.0**-24)).all()


# -- the fp8 linear: each matmul on the operands the recipe names ------------------------------


@pytest.mark.parametrize("recipe", sorted(FP8))
def test_fp8_linear_runs_each_matmul_on_the_recipes_operands(recipe):
    """Forward, input gradient and weight gradient against the independent quantizer applied
    as the recipe table says (kernels/fp8_linear.py), all in fp64: equal up to fp64
    summation order, γ_K·Σ|a||b| with K ≤ 300 (u = 2^-53)."""
    r = RECIPES[recipe]
    x, w, dy = random_wide((40, 300), 11), random_wide((200, 300), 12), random_wide((40, 200), 13)
    x.requires_grad_(True)
    w.requires_grad_(True)
    plan = LinearPlan(r, Dim.whole(300), Dim.whole(200))
    y = fp8_linear(x, w, None, plan)
    y.backward(dy)

    def deq(t, blocks, fmt=E4M3):
        return reference_dequantized(t.detach(), blocks, fmt, r.pow2)
    checks = {"forward": (y, deq(x, r.x), deq(w, r.w).t()),
              "input gradient": (x.grad, deq(dy, r.dy, r.grad_fmt), deq(w, r.w_dgrad)),
              "weight gradient": (w.grad, deq(dy, r.dy_wgrad, r.grad_fmt).t(), deq(x, r.x_wgrad))}
    for what, (got, left, right) in checks.items():
        bound = gamma(300 + 8, 2.0**-53) * (left.abs() @ right.abs())
        assert ((got.detach() - left @ right).abs() <= bound).all(), f"{recipe} {what}"
    assert (r.grad_fmt == E5M2) == (recipe == "tensorwise")


def test_segments_split_an_experts_rows_by_source():
    assert segments_of(torch.tensor([2, 0, 3])) == [(0, 0, 2), (1, 2, 2), (2, 2, 5)]
    assert segments_of(torch.tensor([[1, 2], [0, 3]])) == [(0, 0, 1), (0, 1, 3), (1, 3, 3), (1, 3, 6)]


# -- shards agree on their scales ---------------------------------------------------------------


class _Counting:
    """A MaxReducer over the default group that counts its calls."""

    def __init__(self):
        self.calls = 0

    def max_(self, t):
        import torch.distributed as dist
        self.calls += 1
        dist.all_reduce(t, op=dist.ReduceOp.MAX)


def _quantize_shards(cols_per_rank: int) -> dict:
    """Rank r holds columns [r·c, (r+1)·c) of a [6, 2c] tensor; blockwise 1×128 tiles."""
    import torch.distributed as dist
    rank, c = dist.get_rank(), cols_per_rank
    x = random_wide((6, 2 * c), 14)
    reducer = _Counting()
    dim = Dim(c, 2 * c, rank * c, split=reducer, aligned=c)
    q = quantize(x[:, rank * c:(rank + 1) * c].contiguous(), (Dim.whole(6), dim), (1, BLOCK))
    return {"deq": q.dequantized(), "calls": reducer.calls}


def _shard_cases() -> dict:
    return {c: _quantize_shards(c) for c in (150, 256)}


def test_shards_reduce_only_the_cells_that_span_them():
    """150 columns per rank: tile [128, 256) spans both ranks and takes their common amax, so
    the shards equal the whole tensor's quantization bit for bit. 256 per rank: tiles never
    span ranks and no collective runs."""
    results = run_ranks(_shard_cases, 2)
    for c, calls in ((150, 1), (256, 0)):
        whole_q = reference_dequantized(random_wide((6, 2 * c), 14), (1, BLOCK))
        got = torch.cat([results[r][c]["deq"] for r in range(2)], dim=1)
        assert torch.equal(got, whole_q), f"{c} columns per rank"
        assert all(results[r][c]["calls"] == calls for r in range(2))


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, key", [
    (["train.fp8_recipe=rowwise"], "train.fp8_recipe"),
    (["train.precision=fp8", "train.fp8_recipe=nvfp4"], "train.fp8_recipe"),  # nvfp4 is a precision, not a recipe
    (["train.precision=fp8", "train.fp8_base=fp16"], "train.fp8_base"),
    (["train.precision=fp8", "train.fp8_all_gather=true", "parallel.dp=2"], "train.fp8_all_gather"),
    (["train.precision=fp8", "train.fp8_all_gather=true", "train.fp8_recipe=rowwise", "parallel.dp=2",
      "parallel.zero=3"], "train.fp8_all_gather"),
    (["train.precision=fp8", "parallel.tp=4"], "parallel.tp"),
    (["train.precision=fp8", "model.preset=tiny-moe", "parallel.tp=2"], "parallel.tp"),
    (["train.precision=fp8", "model.preset=tiny-moe", "parallel.cp=2"], "parallel.cp"),
])
def test_config_refuses_what_fp8_cannot_do(overrides, key):
    from ndtrain.config import ConfigError, load_config, validate
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, ["model.preset=tiny"] + overrides), check_paths=False)
    assert e.value.key == key


def test_precision_fp8_computes_in_its_base_dtype():
    from ndtrain.parallel.precision import compute_dtype, has_masters
    assert compute_dtype("fp8") == torch.bfloat16 and has_masters(compute_dtype("fp8"))
    assert compute_dtype("fp8", "fp64") == torch.float64
    assert math.isclose(FMAX[E4M3], torch.finfo(E4M3).max) and math.isclose(FMAX[E5M2], torch.finfo(E5M2).max)


# -- CUDA: the same quantization, the real kernels --------------------------------------------

needs_fp8_gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                   reason="needs a CUDA device with fp8 tensor cores (sm89+)")


@pytest.mark.cuda
@needs_fp8_gpu
@pytest.mark.parametrize("recipe", sorted(FP8))
def test_cuda_quantizes_like_the_cpu_and_its_matmuls_agree(recipe):
    """Every operand the recipe quantizes has the same fp8 bits and scales on the GPU as on the
    CPU. The three matmuls (GPU: torch._scaled_mm; CPU: the fp64 product of the same fp8
    operands) then differ by the GPU's accumulation and its bf16 output only: each output
    within 2^-7 of itself (two bf16 roundings, 2^-8 each) plus K·2^-14 of Σ|a||b| (Hopper's
    fp8 accumulation keeps about 14 bits, DeepSeek-V3 §3.3.2; K = 256 here, so 2^-6)."""
    r = RECIPES[recipe]
    cpu = {"x": random_wide((64, 256), 21), "w": random_wide((128, 256), 22), "dy": random_wide((64, 128), 23)}
    for name, blocks in (("x", r.x), ("w", r.w), ("dy", r.dy), ("w", r.w_dgrad), ("dy", r.dy_wgrad), ("x", r.x_wgrad)):
        fmt = r.grad_fmt if name == "dy" else E4M3
        t = cpu[name].to(torch.bfloat16)
        a = quantize(t, whole(t), blocks, fmt, r.pow2)
        b = quantize(t.cuda(), whole(t), blocks, fmt, r.pow2)
        assert torch.equal(a.data.view(torch.uint8), b.data.cpu().view(torch.uint8)), f"{recipe} {name} {blocks}"
        assert torch.equal(a.scale, b.scale.cpu())
    x = cpu["x"].to(torch.bfloat16).cuda().requires_grad_(True)
    w = cpu["w"].to(torch.bfloat16).cuda().requires_grad_(True)
    dy = cpu["dy"].to(torch.bfloat16).cuda()
    y = fp8_linear(x, w, None, LinearPlan(r, Dim.whole(256), Dim.whole(128)))
    y.backward(dy)

    def deq(t, blocks, fmt=E4M3):
        return reference_dequantized(t.detach().cpu(), blocks, fmt, r.pow2)
    checks = {"forward": (y, deq(x, r.x), deq(w, r.w).t()),
              "input gradient": (x.grad, deq(dy, r.dy, r.grad_fmt), deq(w, r.w_dgrad)),
              "weight gradient": (w.grad, deq(dy, r.dy_wgrad, r.grad_fmt).t(), deq(x, r.x_wgrad))}
    for what, (got, left, right) in checks.items():
        exact = left @ right
        bound = 2.0**-7 * exact.abs() + 256 * 2.0**-14 * (left.abs() @ right.abs())
        assert ((got.detach().cpu().double() - exact).abs() <= bound).all(), f"{recipe} {what}"


@pytest.mark.cuda
@needs_fp8_gpu
def test_cuda_trains_in_fp8(tiny_data):
    """Three steps of each recipe on one GPU through the whole trainer: finite losses within 1%
    of bf16's (a smoke test of the CUDA paths, not a proof: the proofs run on the CPU)."""
    from helpers import train_in_rank
    base = train_in_rank(["train.precision=bf16", "run.device=cuda", "train.steps=3"], tiny_data)[0]
    for recipe in sorted(FP8):
        losses = train_in_rank(["train.precision=fp8", f"train.fp8_recipe={recipe}", "run.device=cuda",
                                "train.steps=3"], tiny_data)[0]
        assert all(math.isfinite(v) for v in losses)
        assert abs(losses[-1] - base[-1]) < 0.01 * base[-1], f"{recipe}: {losses} vs bf16 {base}"


needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs a CUDA device with torch's rowwise and blockwise fp8 kernels (sm90+)")


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("b_blocks", [(BLOCK, BLOCK), (1, BLOCK)])
def test_cuda_native_blockwise_scaled_mm_agrees_with_the_emulation(b_blocks):
    """One `_scaled_mm` with torch's blockwise scaling (1×128 · 128×128: forward and input
    grad; 1×128 · 1×128: weight grad) against the fp32 emulation, on the same fp8 operands
    and scales. Each within bf16's rounding of the output (2^-8 of itself) plus the kernel's
    accumulation: fp8 tensor cores keep about 14 bits within a 128-run (DeepSeek-V3
    §3.3.2) before promoting to fp32, so 128·2^-14 of Σ|a||b|; the emulation within γ (above)."""
    a = random_wide((256, 1024), 50).to(torch.bfloat16).cuda()
    b = random_wide((512, 1024), 51).to(torch.bfloat16).cuda()
    qa, qb = quantize(a, whole(a), (1, BLOCK)), quantize(b, whole(b), b_blocks)
    runs = Dim.whole(1024).runs(BLOCK)
    used = {}
    native = scaled_matmul(qa, qb, runs, torch.bfloat16, used=used, key="native").double().cpu()
    assert used == {"native": "scaled_mm"}, "one call on sm90"
    emulated = scaled_matmul(qa, qb, runs, torch.float32, backend="emulate").double().cpu()
    qa, qb = quantize(a.cpu(), whole(a), (1, BLOCK)), quantize(b.cpu(), whole(b), b_blocks)
    exact = qa.dequantized() @ qb.dequantized().t()
    absolute = qa.dequantized().abs() @ qb.dequantized().abs().t()
    bound = 2.0**-8 * exact.abs() + BLOCK * 2.0**-14 * absolute
    assert ((native - exact).abs() <= bound).all()
    assert ((emulated - exact).abs() <= accumulation_bound(qa, qb, len(runs), 2.0**-24)).all()


@pytest.mark.cuda
@needs_sm90
def test_cuda_grouped_fp8_experts_agree_with_the_loop():
    """Rowwise experts on sm90: forward and input gradient as one `_scaled_grouped_mm` each,
    against the per-group `_scaled_mm` loop and the exact products of the same fp8 operands
    (the CPU in fp64: power-of-two scales quantize fp32 and fp64 alike). Each within bf16's
    rounding (2^-8 of itself) plus K·2^-14 of Σ|a||b| (fp8 tensor cores' ~14-bit accumulation)."""
    from ndtrain.kernels.fp8_linear import fp8_expert_matmul
    experts, n, k = 4, 256, 512
    counts = torch.tensor([[40, 24], [0, 0], [100, 28], [16, 48]])  # 2 sources, an empty expert
    x = random_wide((int(counts.sum()), k), 52).to(torch.bfloat16)
    w = random_wide((experts, n, k), 53).to(torch.bfloat16)
    dy = random_wide((int(counts.sum()), n), 54).to(torch.bfloat16)
    r = RECIPES["rowwise"]

    def run(x, w, dy, backend, device):
        plan = LinearPlan(r, Dim.whole(k), Dim.whole(n), backend=backend)
        xx = x.detach().to(device).requires_grad_(True)
        y = fp8_expert_matmul(xx, w.to(device), counts, plan)
        y.backward(dy.to(device))
        return y.detach().double().cpu(), xx.grad.double().cpu(), plan.backends
    y, dx, used = run(x, w, dy, None, "cuda")
    assert used["forward"] == used["input_grad"] == "scaled_grouped_mm"
    y_loop, dx_loop, _ = run(x, w, dy, "scaled_mm", "cuda")
    exact = run(x.double(), w.double(), dy.double(), "fp64", "cpu")
    absolute = run(x.double().abs(), w.double().abs(), dy.double().abs(), "fp64", "cpu")
    for got, loop, ex, ab, red in ((y, y_loop, exact[0], absolute[0], k), (dx, dx_loop, exact[1], absolute[1], n)):
        bound = 2.0**-8 * ex.abs() + red * 2.0**-14 * ab
        assert ((got - ex).abs() <= bound).all() and ((loop - ex).abs() <= bound).all()


@pytest.mark.slow  # the linear's one-graph tests run by default; the whole block costs 9 s
def test_a_whole_fp8_block_traces_as_one_graph():
    """TINY's first block with its 7 linears in fp8 (parallel/fp8.apply, one process): dynamo
    finds no graph break in its forward, for every recipe."""
    from ndtrain.mesh import ParallelMesh
    from ndtrain.model.args import PRESETS
    from ndtrain.model.llama import Transformer
    from ndtrain.parallel import fp8
    args = PRESETS["tiny"]
    for recipe in sorted(FP8):
        model = Transformer(args)
        assert len(fp8.apply(model, ParallelMesh.single(), recipe)) == 28
        half = args.dim // args.n_heads // 2
        torch._dynamo.reset()
        found = torch._dynamo.explain(model.layers["0"])(torch.randn(2, 128, args.dim), torch.randn(128, half),
                                                         torch.randn(128, half))
        assert (found.graph_count, found.graph_break_count) == (1, 0), (recipe, found.break_reasons)
    torch._dynamo.reset()


# -- visibility -----------------------------------------------------------------------------------


def test_the_summary_names_what_runs_in_fp8():
    from ndtrain.model.args import PRESETS
    from ndtrain.parallel.fp8 import describe
    dense = describe(PRESETS["tiny"], "blockwise", "bf16")
    assert dense["fp8_linears"] == 4 * 4 + 4 * 3  # wq wk wv wo and w1 w2 w3 in 4 blocks
    assert "In bf16: embedding, output head, norms, attention core, router" in dense["text"]
    moe = describe(PRESETS["tiny-moe"], "tensorwise", "bf16")
    assert moe["fp8_linears"] == 4 * 4 + 4 * 3 * 8 and "routed experts" in moe["text"]
    assert "gradients in E5M2" in moe["text"]


def test_the_memory_report_counts_fp8_copies(tiny_data):
    """Tensorwise keeps each block linear's input in fp8 for backward: one byte per element and
    a 4-byte scale. TINY (dim 64, MLP 128), 2×32 tokens: per block wq wk wv wo read 4·64
    features, w1 and w3 2·64, w2 128; 28 linears."""
    from helpers import train_in_rank
    trainer = train_in_rank(["train.precision=fp8", "train.steps=1", "train.global_batch=2"], tiny_data, meter=True)[2]
    saved = trainer.history[-1]["memory"]["fp8_saved"][0]
    tokens = 2 * 32
    inputs = 4 * (4 * 64 + 2 * 64 + 128)  # per block: wq wk wv wo read 64 features, w1 w3 64, w2 128
    assert saved == tokens * inputs + 28 * 4


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_the_first_metrics_line_counts_the_fp8_back_ends(tiny_data, recipe):
    """`fp8_backends` on the first line only: each of the 28 block linears of TINY (dim 64, MLP
    128) by the back end of its three matmuls. On the CPU, one `_scaled_mm` wherever the
    reduction is one cell (tensorwise, or at most 128 wide); the blockwise weight gradient
    reduces over the micro-batch's tokens, emulated when they exceed one 128-tile. The
    prediction is what the eager step recorded in each layer."""
    from helpers import train_in_rank

    from ndtrain.parallel.fp8 import plans
    trainer = train_in_rank(["train.precision=fp8", f"train.fp8_recipe={recipe}", "train.steps=2",
                             "train.global_batch=8", "train.micro_batch=8"], tiny_data)[2]
    t = trainer.cfg.train
    wgrad = "emulate" if recipe == "blockwise" and t.micro_batch * t.seq_len > BLOCK else "scaled_mm"
    assert (wgrad == "emulate") == (recipe == "blockwise"), "8 × 32 tokens: two 128-tiles"
    # one cell along K with a scale per row: rowwise, which a CPU `_scaled_mm` before torch 2.13 does not take
    one_cell = "scaled_mm" if recipe == "tensorwise" or CPU_ROWWISE else "emulate"
    label = (one_cell if one_cell == wgrad else
             f"forward {one_cell}, input grad {one_cell}, weight grad {wgrad}")
    assert trainer.history[0]["fp8_backends"] == {label: 28}
    assert "fp8_backends" not in trainer.history[1]
    recorded = [p.backends for p in plans(trainer.par.model)]  # one plan per weight shape, shared by the blocks
    shapes = {(p.k.full, p.n.full) for p in plans(trainer.par.model)}
    assert len(recorded) == len(shapes) == 4  # wq/wo, wk/wv, w1/w3, w2
    assert recorded == [{"forward": one_cell, "input_grad": one_cell, "weight_grad": wgrad}] * 4


def test_an_input_gradient_alone_skips_the_weight_gradient(monkeypatch):
    """The zero-bubble split asks for the input gradient first and the weights' later: the
    fp8 linear computes each once, as a built-in matmul would."""
    import ndtrain.kernels.fp8_linear as fp8_linear
    calls = {"input": 0, "weight": 0}
    for name, key in (("input_grad", "input"), ("weight_grad", "weight")):
        real = getattr(fp8_linear, name)
        monkeypatch.setattr(fp8_linear, name, lambda *a, real=real, key=key: calls.__setitem__(key, calls[key] + 1)
                            or real(*a))
    x0 = random_wide((16, 32), 30).requires_grad_(True)
    w = random_wide((8, 32), 31).requires_grad_(True)
    y = fp8_linear.fp8_linear(x0 * 2, w, None, LinearPlan(RECIPES["blockwise"], Dim.whole(32), Dim.whole(8)))
    torch.autograd.grad(y.sum(), x0, retain_graph=True)
    assert calls == {"input": 1, "weight": 0} and w.grad is None
    torch.autograd.grad(y.sum(), w)
    assert calls == {"input": 1, "weight": 1}


# -- torch.compile: one graph per fp8 linear ----------------------------------------------------


def test_an_emulated_product_is_a_fresh_tensor_in_its_accumulators_dtype():
    """Returned from the fp8 linear's autograd function, the accumulator itself (its `.to` of
    the same dtype a no-op) got zero gradients under torch 2.11's torch.compile: the product
    is a copy even in fp32 (docs/architecture.md, "The GPU machine's torch")."""
    a, b = random_wide((32, 256), 7), random_wide((24, 256), 8)
    qa, qb = quantize(a, whole(a), (1, BLOCK)), quantize(b, whole(b), (1, BLOCK))
    seen = []
    real_zeros = torch.zeros

    def zeros(*args, **kwargs):
        seen.append(real_zeros(*args, **kwargs))
        return seen[-1]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch, "zeros", zeros)
        out = scaled_matmul(qa, qb, Dim.whole(256).runs(BLOCK), torch.float32, backend="emulate")
    assert len(seen) == 1 and seen[0].dtype == out.dtype == torch.float32
    assert out.data_ptr() != seen[0].data_ptr() and torch.equal(out, seen[0])


def test_rowwise_on_a_cpu_without_row_scales_runs_the_emulation(monkeypatch):
    """torch 2.11's CPU `_scaled_mm` takes tensorwise scales only (an internal assert
    otherwise): where the import-time probe says so, rowwise CPU products are emulated, and
    the emulation equals the product of the dequantized operands within fp32 accumulation."""
    import ndtrain.kernels.fp8 as f8
    a, b = random_wide((32, 96), 7), random_wide((24, 96), 8)
    qa, qb = quantize(a, whole(a), (1, WHOLE)), quantize(b, whole(b), (1, WHOLE))
    runs = Dim.whole(96).runs(WHOLE)
    assert f8.choose(qa, qb, runs, torch.float32).backend == ("scaled_mm" if f8.CPU_ROWWISE else "emulate")
    monkeypatch.setattr(f8, "CPU_ROWWISE", False)
    assert f8.choose(qa, qb, runs, torch.float32).backend == "emulate"
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: pytest.fail("no _scaled_mm without row scales"))
    out = scaled_matmul(qa, qb, runs, torch.float32).double()
    assert ((out - qa.dequantized() @ qb.dequantized().t()).abs() <= accumulation_bound(qa, qb, 1, 2.0**-24)).all()


@pytest.mark.parametrize("nvfp4_rounding", [False, True])
def test_the_layer_name_reaches_the_autograd_function_only_for_nvfp4_rounding(monkeypatch, nvfp4_rounding):
    """torch 2.11's Dynamo guarded on the string passed to `apply` and compiled every block
    anew; only NVFP4's stochastic rounding keys need it."""
    import ndtrain.kernels.fp8_linear as fl
    from ndtrain.kernels.fp8_linear import Nvfp4, Rounding
    plan = LinearPlan(RECIPES["tensorwise"], Dim.whole(64), Dim.whole(32))
    if nvfp4_rounding:
        plan.nv = Nvfp4(rounding=Rounding(seed=1))
    got = []
    monkeypatch.setattr(fl.Fp8Linear, "apply", lambda *args: got.append(args[-1]) or args[0][:, :32])
    fp8_linear(torch.randn(4, 64), torch.randn(32, 64), None, plan, "layers.3.attention.wq")
    assert got == ["layers.3.attention.wq" if nvfp4_rounding else ""]


@pytest.mark.parametrize("recipe", sorted(FP8))
def test_an_fp8_linear_compiles_to_one_forward_and_one_backward_graph(recipe):
    """`fullgraph=True` refuses any graph break (a host read-back such as nonzero/tolist, or
    Python state touched inside the autograd function), and AOTAutograd's counting compilers
    see one forward and one backward graph. fp32 on the CPU (blockwise: the emulation, 3 runs
    of 128); compiled equals eager bit for bit, the same operations in the same order."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    graphs = {"forward": 0, "backward": 0}

    def counting(kind):
        def compiler(gm, inputs):
            graphs[kind] += 1
            return make_boxed_func(gm.forward)
        return compiler
    torch._dynamo.reset()
    # dynamo's map of torch functions, built once by name: built while a test (the fake-CUDA
    # ones) had torch._scaled_mm patched, it would not know the real one
    getattr(torch._dynamo.trace_rules, "clear_lru_cache", lambda: None)()
    plan = LinearPlan(RECIPES[recipe], Dim.whole(384), Dim.whole(256))
    linear = torch.compile(lambda x, w: fp8_linear(x, w, None, plan), fullgraph=True,
                           backend=aot_autograd(fw_compiler=counting("forward"), bw_compiler=counting("backward")))
    x = random_wide((2, 128, 384), 40).float().requires_grad_(True)
    w = random_wide((256, 384), 41).float().requires_grad_(True)
    dy = random_wide((2, 128, 256), 42).float()
    y = linear(x, w)
    y.backward(dy)
    assert graphs == {"forward": 1, "backward": 1}
    linear(x, w)  # again: no guard on Python state (a byte counter bumped inside the graph) recompiles it
    assert graphs["forward"] == 1
    x0, w0 = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    y0 = fp8_linear(x0, w0, None, plan)
    y0.backward(dy)
    assert torch.equal(y, y0) and torch.equal(x.grad, x0.grad) and torch.equal(w.grad, w0.grad)
    torch._dynamo.reset()
