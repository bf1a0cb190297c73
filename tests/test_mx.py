"""MXFP8 and NVFP4 (kernels/mx.py): the formats' bits against their definitions, the emulated
product against dequantize-then-matmul, stochastic rounding and the Hadamard transform, the
recipes in the fp8 linear, and the sm100 calls on fake CUDA tensors."""

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ndtrain.kernels.fp8 as fp8
from ndtrain.kernels import mx
from ndtrain.kernels.fp8 import E4M3, WHOLE, Dim
from ndtrain.kernels.fp8_linear import RECIPES, LinearPlan, Nvfp4, Rounding, fp8_linear

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def whole(x):
    return Dim.whole(x.shape[0]), Dim.whole(x.shape[1])


def test_e8m0_scales_are_rceil_of_amax_over_448_bit_for_bit():
    """10^6 amaxes over 60 binades (and exact powers of two times 448): the scale is
    2^ceil(log2(fp32(amax / 448))), from the exponent of the quotient in fp64 and a check of
    whether it is a power of two; an all-zero block gets the floor's finite scale."""
    g = torch.Generator().manual_seed(0)
    amax = torch.exp2(torch.rand(10**6, generator=g) * 60 - 30)
    amax = torch.cat([amax, torch.exp2(torch.arange(-20, 20).float()) * 448])
    q = (amax / 448.0).double()
    e = torch.floor(torch.log2(q))
    power = torch.exp2(e) == q
    want = torch.exp2(torch.where(power, e, e + 1))
    assert torch.equal(mx.e8m0_scale(amax).double(), want)
    zero = mx.e8m0_scale(torch.zeros(1))
    assert 0 < zero.item() <= 2.0 ** -40 and torch.log2(zero).item().is_integer()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_e2m1_rounds_to_the_nearest_grid_point_ties_to_even(dtype):
    """Every value on a fine grid and every midpoint: the nearest of E2M1's 8 magnitudes, a
    tie to the one with mantissa bit 0 (0, 1, 2, 4), saturated at 6, sign kept."""
    v = torch.cat([torch.linspace(-7, 7, 28001, dtype=dtype),
                   torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -2.5], dtype=dtype)])
    grid = torch.tensor(GRID, dtype=torch.float64)
    dist = (v.abs().clamp(max=6).double()[:, None] - grid[None, :]).abs()
    nearest = dist == dist.min(1).values[:, None]
    even = torch.tensor([True, False] * 4)
    pick = torch.where(nearest.sum(1) > 1, (nearest & even).float().argmax(1), nearest.float().argmax(1))
    assert torch.equal(mx.round_e2m1(v).double(), torch.copysign(grid[pick], v.double()))


@pytest.mark.slow
def test_stochastic_rounding_picks_a_neighbour_without_bias():
    """Each value goes to one of its two grid neighbours, up with probability equal to its
    distance from the lower one: the mean of 2·10^5 roundings is within 4.5 standard errors."""
    for value in (0.3, 1.3, 2.6, 4.9, -3.2):
        x = torch.full((200_000,), value, dtype=torch.float64)
        u = torch.rand(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        out = mx.round_e2m1(x, u)
        lo = max(g for g in GRID if g <= abs(value))
        hi = min(g for g in GRID if g >= abs(value))
        assert set(out.abs().unique().tolist()) <= {lo, hi}
        se = (hi - lo) / 2 / math.sqrt(x.numel())
        assert abs(out.mean().item() - value) <= 4.5 * se


def test_nvfp4_scales_follow_the_two_level_definition():
    """outer = amax / (6·448); each 1×16 block's scale = E4M3(amax_block / 6 / outer); the values
    are E2M1 of x / (scale·outer); dequantized within half a grid step of each block's scale."""
    x = torch.randn(32, 64, dtype=torch.float64) * torch.logspace(-3, 2, 64, dtype=torch.float64)
    q = mx.quantize_nv(x, whole(x), (1, 16))
    outer = (x.abs().max().float() / (6 * 448)).item()
    assert q.outer.item() == outer
    blocks = x.abs().view(32, 4, 16).amax(2).float()
    want = (blocks / 6 / torch.tensor(outer)).clamp(max=448).to(E4M3).float()
    assert torch.equal(q.scale, want)
    assert set(q.data.float().abs().unique().tolist()) <= set(GRID)
    err = (q.dequantized() - x).abs()
    step = q.scales().double() * outer * 2  # the widest grid step (4 → 6) of each block
    assert (err <= step / 2 + 1e-300).all()


def test_mxfp8_values_and_scales():
    """MXFP8: E4M3 values of x / scale, each 1×32 block's largest at or below 448 (RCEIL never
    saturates), its scale a power of two."""
    x = torch.randn(16, 96, dtype=torch.float64) * 10
    q = mx.quantize_mx(x, whole(x), (1, 32))
    assert q.scale.shape == (16, 3)
    mantissa, _ = torch.frexp(q.scale)
    assert (mantissa == 0.5).all()
    assert torch.equal(q.data, (x / q.scales().double()).to(E4M3))
    assert (q.data.float().abs().view(16, 3, 32).amax(2) >= 224).all()


@pytest.mark.parametrize("kind, blocks", [("mxfp8", ((1, 32), (1, 32))), ("nvfp4", ((1, 16), (16, 16)))])
def test_emulated_product_equals_dequantize_then_matmul(kind, blocks):
    """The emulation's operands are exact, so its fp64 product equals the dequantized
    operands' product to 1e-12 (sum order only), and its fp32 one within fp32 accumulation."""
    quant = mx.quantize_mx if kind == "mxfp8" else mx.quantize_nv
    a, b = torch.randn(24, 160, dtype=torch.float64), torch.randn(48, 160, dtype=torch.float64) * 3
    qa, qb = quant(a, whole(a), blocks[0]), quant(b, whole(b), blocks[1])
    exact = qa.dequantized() @ qb.dequantized().t()
    scale = exact.abs().max()
    assert ((mx.scaled_matmul(qa, qb, torch.float64) - exact).abs() <= 1e-12 * scale).all()
    bound = 160 * 2.0 ** -24 * (qa.dequantized().abs() @ qb.dequantized().abs().t())
    assert ((mx.scaled_matmul(qa, qb, torch.float32).double() - exact).abs() <= bound + 1e-30).all()


def test_random_numbers_depend_on_global_indices_only():
    """A shard's numbers are the whole tensor's at its global indices (tp: features; cp: a
    permutation of tokens), and another key or micro-batch draws others."""
    dev = torch.device("cpu")
    full = mx.uniform(7, 0, Dim.whole(32), Dim.whole(48), dev)
    shard = mx.uniform(7, 0, Dim.whole(32), Dim(24, 48, 24), dev)
    assert torch.equal(shard, full[:, 24:])
    index = torch.tensor([3, 1, 30, 17])
    assert torch.equal(mx.uniform(7, 0, Dim(4, 32, index=index), Dim.whole(48), dev), full[index])
    assert not torch.equal(mx.uniform(8, 0, Dim.whole(32), Dim.whole(48), dev), full)
    assert not torch.equal(mx.uniform(7, 32, Dim.whole(32), Dim.whole(48), dev), full)
    assert 0 <= full.min() and full.max() < 1 and abs(full.mean().item() - 0.5) < 0.05


def test_hadamard_keeps_the_weight_gradient():
    """H·diag(signs)/4 is orthonormal with entries ±1/4, so (H·dy)ᵀ(H·x) = dyᵀ·x; a ragged
    last run of tokens is padded with zeros."""
    h = mx.hadamard(16, 5, torch.float64, torch.device("cpu"))
    assert torch.equal(h.abs(), torch.full((16, 16), 0.25, dtype=torch.float64))
    assert torch.allclose(h @ h.t(), torch.eye(16, dtype=torch.float64), atol=0, rtol=0)
    dy, x = torch.randn(37, 8, dtype=torch.float64), torch.randn(37, 12, dtype=torch.float64)
    hd, hx = mx.transform_tokens(dy, h), mx.transform_tokens(x, h)
    assert hd.shape == (48, 8)
    assert torch.allclose(hd.t() @ hx, dy.t() @ x, rtol=1e-13, atol=1e-13)


def test_pack_e2m1_codes():
    """float4_e2m1fn_x2 packing: each value's 4-bit code (sign, exponent, mantissa), the even
    column in the low nibble."""
    values = torch.tensor([GRID + [-g for g in GRID]], dtype=torch.float32).to(E4M3)
    packed = mx.pack_e2m1(values).view(torch.uint8)
    codes = torch.stack([packed & 15, packed >> 4], -1).flatten().tolist()
    decoded = [(-1 if c & 8 else 1) * GRID[c & 7] for c in codes]
    assert decoded == values.float().flatten().tolist()


@pytest.mark.parametrize("recipe", ["nvfp4", pytest.param("mxfp8", marks=pytest.mark.slow),
                                    pytest.param("nvfp4-1d", marks=pytest.mark.slow)])
def test_the_linear_layer_runs_each_matmul_on_the_recipes_operands(recipe):
    """Forward, input gradient and weight gradient of the micro-scaled linear equal fp64
    products of the operands quantized as the recipe says (NVFP4: with the Hadamard transform
    of the weight gradient's inputs and stochastic rounding of dy, keyed as the layer keys it)."""
    torch.manual_seed(0)
    r = RECIPES[recipe]
    nv = Nvfp4(True, Rounding(3, step=2, first=1), seed=3) if r.kind == "nvfp4" else None
    plan = LinearPlan(r, Dim.whole(64), Dim.whole(48), nv=nv)
    x = torch.randn(40, 64, dtype=torch.float64, requires_grad=True)
    w = torch.randn(48, 64, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(40, 48, dtype=torch.float64)
    y = fp8_linear(x, w, None, plan, "layers.0.w")
    y.backward(dy)
    quant = mx.quantize_mx if r.kind == "mxfp8" else mx.quantize_nv
    t, k, n = Dim.whole(40), Dim.whole(64), Dim.whole(48)
    xq, wq = quant(x.detach(), (t, k), r.x), quant(w.detach(), (n, k), r.w)
    assert close(y, xq.dequantized() @ wq.dequantized().t())
    u_d = u_w = None
    if nv is not None:
        u_d = mx.uniform(*_key(nv, "input_grad", t), t, n, x.device)
    dyq = quant(dy, (t, n), r.dy, *([u_d] if nv else []))
    wd = quant(w.detach(), (n, k), r.w_dgrad)
    assert close(x.grad, dyq.dequantized() @ wd.dequantized())
    xs, dys, tt = x.detach(), dy, t
    if nv is not None:
        h = mx.hadamard(16, mx.stream_key(3, "hadamard"), torch.float64, x.device)
        xs, dys, tt = mx.transform_tokens(xs, h), mx.transform_tokens(dy, h), Dim.whole(48)
        u_w = mx.uniform(*_key(nv, "weight_grad", tt), tt, n, x.device)
    dyw = quant(dys, (tt, n), r.dy_wgrad, *([u_w] if nv else []))
    xw = quant(xs, (tt, k), r.x_wgrad)
    assert close(w.grad, dyw.dequantized().t() @ xw.dequantized())


def close(a, b):
    """Equal up to fp64 summation order: within 1e-12 of the largest element."""
    return ((a - b).abs() <= 1e-12 * b.abs().max()).all()


def _key(nv, what, tokens):
    """The layer's stream and its first token: micro-batch g's tokens follow g whole ones."""
    key, g = nv.rounding.key("layers.0.w", what)
    return key, g * tokens.full


@pytest.mark.slow
def test_stochastic_rounding_changes_the_gradient_and_is_reproducible():
    """Two runs with the same (seed, step, micro-batch) give the same weight gradient bit for
    bit; another step draws other numbers, and rounding to nearest differs from both."""
    def grad(rounding):
        plan = LinearPlan(RECIPES["nvfp4"], Dim.whole(64), Dim.whole(48), nv=Nvfp4(True, rounding))
        torch.manual_seed(0)
        x = torch.randn(32, 64, dtype=torch.float64, requires_grad=True)
        w = torch.randn(48, 64, dtype=torch.float64, requires_grad=True)
        fp8_linear(x, w, None, plan, "l").backward(torch.randn(32, 48, dtype=torch.float64))
        return w.grad
    a, b = grad(Rounding(0, step=1)), grad(Rounding(0, step=1))
    assert torch.equal(a, b)
    assert not torch.equal(a, grad(Rounding(0, step=2)))
    assert not torch.equal(a, grad(None))


def test_saved_copies_count_the_formats_bytes():
    """What a micro-scaled forward keeps for backward is x quantized for the weight gradient:
    MXFP8 one byte per value and per 32-block scale; NVFP4 half a byte per value, one per
    16-block scale, plus its 4-byte tensor scale."""
    for recipe, want in (("mxfp8", 64 * 128 + 2 * 128), ("nvfp4", 64 * 128 // 2 + 4 * 128 + 4)):
        plan = LinearPlan(RECIPES[recipe], Dim.whole(128), Dim.whole(32),
                          nv=Nvfp4(False, None) if recipe == "nvfp4" else None)
        x = torch.randn(64, 128, requires_grad=True)
        fp8_linear(x, torch.randn(32, 128, requires_grad=True), None, plan).sum().backward()
        assert plan.saved_fp8[0] == want, recipe


def test_sm100_block_scaled_calls_on_fake_cuda_tensors(monkeypatch):
    """On sm100 a micro-scaled product is one torch.nn.functional.scaled_mm with block scaling:
    MXFP8 E4M3 operands with float8_e8m0fnu scales (BlockWise1x32), NVFP4 float4_e2m1fn_x2
    operands with float8_e4m3fn scales (BlockWise1x16), each scale swizzled into 128×4 tiles
    (M rounded up to 128, K/block to 4); torch's meta kernel checks the shapes. On sm90 the
    emulation runs and warns once."""
    from torch.nn.functional import ScalingType
    monkeypatch.setattr(fp8, "device_capability", lambda device: (10, 0))
    monkeypatch.setattr(fp8, "_WARNED", set())
    seen = []
    real = torch.nn.functional.scaled_mm

    def recorder(a, b, sa, ra, sb, rb, **kw):
        seen.append((a.dtype, tuple(a.shape), b.dtype, tuple(b.shape), sa.dtype, sa.numel(), ra, sb.numel()))
        return real(a, b, sa, ra, sb, rb, **kw)
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", recorder)
    m, k, n = 200, 512, 384
    with FakeTensorMode(allow_non_fake_inputs=True):
        a = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
        b = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
        for quant, block in ((mx.quantize_mx, 32), (mx.quantize_nv, 16)):
            out = mx.scaled_matmul(quant(a, whole(a), (1, block)), quant(b, whole(b), (1, block)), torch.bfloat16)
            assert out.shape == (m, n) and out.dtype == torch.bfloat16
    pad = lambda rows, cols: -(-rows // 128) * 128 * (-(-cols // 4) * 4)  # noqa: E731
    assert seen == [
        (E4M3, (m, k), E4M3, (k, n), torch.float8_e8m0fnu, pad(m, k // 32), ScalingType.BlockWise1x32, pad(n, k // 32)),
        (torch.float4_e2m1fn_x2, (m, k // 2), torch.float4_e2m1fn_x2, (k // 2, n), E4M3, pad(m, k // 16),
         ScalingType.BlockWise1x16, pad(n, k // 16))]
    monkeypatch.setattr(fp8, "device_capability", lambda device: (9, 0))
    used = {}
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.warns(RuntimeWarning, match="sm100"):
        a = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
        mx.scaled_matmul(mx.quantize_mx(a, whole(a), (1, 32)), mx.quantize_mx(a, whole(a), (1, 32)),
                         torch.bfloat16, used=used, key="f")
    assert used == {"f": "emulate"}


def test_whole_blocks_never_span_a_shard():
    """A tensor-parallel shard whose width is a multiple of the block reduces no block amax;
    NVFP4's tensor amax spans shards and is reduced."""
    assert not Dim(64, 128, 64, split=object(), aligned=64).spans_ranks(32)
    assert Dim(48, 96, 48, split=object(), aligned=48).spans_ranks(32)
    assert Dim(48, 96, 48, split=object(), aligned=48).spans_ranks(WHOLE)
