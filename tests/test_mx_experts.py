"""Routed experts in MXFP8 and NVFP4 (kernels/fp8_linear.Fp8Experts, issue 38): each group of
rows (one expert's tokens from one source micro-batch) runs as the dense quantized reference
of that group padded with zero rows to whole blocks (32 for MXFP8, 16 for NVFP4: what a
grouped block-scaled GEMM takes), NVFP4 with its Hadamard transform and stochastic rounding
keyed by (seed, step, the source's micro-batch in the global batch, the expert's global
index, the gradient). The layout proof (ep2 equal to one process) is in test_mx_layouts.py."""

import pytest
import torch

from ndtrain.kernels import mx
from ndtrain.kernels.fp8 import Dim
from ndtrain.kernels.fp8_linear import RECIPES, LinearPlan, Nvfp4, Rounding, expert_keys, fp8_expert_matmul

K, N = 64, 48
LAYER = "layers.1.feed_forward.experts.w1"


def close(a, b):
    """Equal up to fp64 summation order: within 1e-12 of the largest element."""
    return bool(((a - b).abs() <= 1e-12 * b.abs().max()).all())


def padded(t, rows):
    return torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])])


def reference(x, w, dy, counts, recipe, nv, first_expert, sources):
    """Per group: pad to whole blocks, quantize each operand as the recipe says, fp64 products;
    the random numbers' keys spelled out from their definition (kernels/fp8_linear.Rounding)."""
    r = RECIPES[recipe]
    block = mx.NV_BLOCK if r.kind == "nvfp4" else mx.MX_BLOCK
    quant = mx.quantize_nv if r.kind == "nvfp4" else mx.quantize_mx
    k, n = Dim.whole(K), Dim.whole(N)
    y, dx, dw = torch.zeros(x.shape[0], N, dtype=x.dtype), torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for g in range(counts.shape[0]):
        for s in range(counts.shape[1]):
            rows = int(counts[g, s])
            if rows == 0:
                continue
            p = -(-rows // block) * block
            xp, dyp, t = padded(x[start:start + rows], p), padded(dy[start:start + rows], p), Dim.whole(p)
            u_d = u_w = None
            if nv is not None and nv.rounding is not None:
                rd = nv.rounding
                micro = rd.first + sources[s] * rd.per_rank + rd.micro
                key = {what: mx.stream_key(rd.seed, rd.step, micro, f"{LAYER}.{first_expert + g}", what)
                       for what in ("input_grad", "weight_grad")}
                u_d, u_w = (mx.uniform(key[what], 0, t, n, x.device) for what in ("input_grad", "weight_grad"))
            extra = (lambda u: [u]) if r.kind == "nvfp4" else (lambda u: [])
            wq = quant(w[g], (n, k), r.w).dequantized()
            y[start:start + rows] = (quant(xp, (t, k), r.x).dequantized() @ wq.t())[:rows]
            wd = quant(w[g], (n, k), r.w_dgrad).dequantized()
            dx[start:start + rows] = (quant(dyp, (t, n), r.dy, *extra(u_d)).dequantized() @ wd)[:rows]
            xs, dys = xp, dyp
            if nv is not None and nv.hadamard:
                h = mx.hadamard(16, mx.stream_key(nv.seed, "hadamard"), torch.float64, x.device)
                xs, dys = mx.transform_tokens(xp, h), mx.transform_tokens(dyp, h)
            dyw = quant(dys, (t, n), r.dy_wgrad, *extra(u_w)).dequantized()
            dw[g] += dyw.t() @ quant(xs, (t, k), r.x_wgrad).dequantized()
            start += rows
    return y, dx, dw


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp8"])
def test_expert_groups_equal_the_padded_dense_reference(recipe, one_thread):
    """Groups of 5, 21, 38 and 40 rows (none whole blocks) from 2 sources, an empty expert:
    forward, input and weight gradients equal the padded per-group reference; under NVFP4
    the source's micro-batch and the expert's global index key the rounding (a key from
    another micro-batch or expert changes the gradients: the control)."""
    torch.manual_seed(0)
    counts = torch.tensor([[5, 21], [0, 0], [38, 3], [40, 17]])
    first_expert, sources = 4, (0, 1)  # the second ep rank's experts; rows from this rank and the next
    x = torch.randn(int(counts.sum()), K, dtype=torch.float64)
    w = torch.randn(counts.shape[0], N, K, dtype=torch.float64)
    dy = torch.randn(x.shape[0], N, dtype=torch.float64)

    def run(rounding_of_plan, first_expert=first_expert, sources=sources):
        nv = Nvfp4(True, rounding_of_plan, seed=3) if recipe == "nvfp4" else None
        plan = LinearPlan(RECIPES[recipe], Dim.whole(K), Dim.whole(N), nv=nv)
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = fp8_expert_matmul(xx, ww, counts, plan, expert_keys(counts, plan, LAYER, first_expert, sources))
        y.backward(dy)
        return (y.detach(), xx.grad, ww.grad), nv

    got, nv = run(Rounding(3, step=2, first=2, micro=1, per_rank=2))
    want = reference(x, w, dy, counts, recipe, nv, first_expert, sources)
    for a, b, what in zip(got, want, ("y", "dx", "dw")):
        assert close(a, b), what
    if recipe == "nvfp4":
        for other in (run(Rounding(3, step=2, first=2, micro=1, per_rank=2), sources=(0, 2))[0],
                      run(Rounding(3, step=2, first=2, micro=1, per_rank=2), first_expert=0)[0]):
            assert close(other[0], got[0]) and not close(other[2], got[2])


# -- MXFP8's grouped product on sm100 (kernels/mx_experts.py), read back on the CPU ---------------

def up(n, m):
    return -(-n // m) * m


def blocked(rows, cols):
    """Where element (r, c) of a [rows, cols] scale matrix lies in cuBLAS's block-scaling
    layout (cuBLAS docs, "1D block scaling factors layout"; torch's `to_blocked`): 128×4 tiles,
    row-tile-major, each tile 512 bytes; inside one, (r % 32)·16 + (r % 128 // 32)·4 + c % 4."""
    r, c = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
    tile = (r // 128) * (up(cols, 4) // 4) + c // 4
    return tile * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4


def e8m0(scale):
    return scale.float().double().flatten()


def read(flat, index):
    """flat[index], NaN past its end (memory the kernel would read is not the scales)."""
    return torch.where(index < flat.numel(), flat[index.clamp(max=flat.numel() - 1)], float("nan"))


def grouped_2d_3d(call):
    """What the kernel computes for 2-D × 3-D (forward, input gradient), as its offsets read
    it: group e is rows offs[e-1]..offs[e] of mat_a; its scales start after the earlier groups'
    rows each rounded up to 128, times K/32 rounded up to 4; expert e's scales are row e of
    scale_b, [N, K/32] blocked."""
    a, b = call.mat_a.double(), call.mat_b.double()
    (m, k), (_, _, n) = a.shape, b.shape
    cols = k // 32
    sa, out, start, scale_row = e8m0(call.scale_a), torch.zeros(m, n, dtype=torch.float64), 0, 0
    for e, end in enumerate(call.offs.tolist()):
        rows = end - start
        if rows:
            s_a = read(sa, scale_row * up(cols, 4) + blocked(rows, cols)).repeat_interleave(32, 1)
            s_b = read(e8m0(call.scale_b[e]), blocked(n, cols)).t().repeat_interleave(32, 0)
            out[start:end] = (a[start:end] * s_a) @ (b[e] * s_b)
        scale_row, start = scale_row + up(rows, 128), end
    return out


def grouped_2d_2d(call):
    """The same for 2-D × 2-D (weight gradient): group e is columns offs[e-1]..offs[e] of
    mat_a and rows of mat_b; its scales start after the earlier groups' (rows rounded up to
    128) × (their size // 32, rounded up to 4) scales; out [G, M, N], an empty group's left
    as allocated (NaN here)."""
    a, b = call.mat_a.double(), call.mat_b.double()
    (m, _), n = a.shape, b.shape[1]
    sa, sb = e8m0(call.scale_a), e8m0(call.scale_b)
    out, start, at_a, at_b = torch.full((len(call.offs), m, n), float("nan"), dtype=torch.float64), 0, 0, 0
    for e, end in enumerate(call.offs.tolist()):
        size = end - start
        if size:
            cols = -(-size // 32)
            s_a = read(sa, at_a + blocked(m, cols)).repeat_interleave(32, 1)[:, :size]
            s_b = read(sb, at_b + blocked(n, cols)).t().repeat_interleave(32, 0)[:size]
            out[e] = (a[:, start:end] * s_a) @ (b[start:end] * s_b)
        at_a, at_b, start = at_a + up(m, 128) * up(size // 32, 4), at_b + up(n, 128) * up(size // 32, 4), end
    return out


def exact_operands(*shape):
    """Magnitudes in [1/8, 8]: each quantized value is a multiple of 2^-6 (E4M3's 4 significant
    bits at exponent ≥ -3), so every product and sum below is exact in fp64 whatever its order,
    while quantization still rounds (a wrong block or scale changes the values)."""
    g = torch.Generator().manual_seed(sum(shape))
    mag = torch.exp2(torch.rand(*shape, generator=g, dtype=torch.float64) * 6 - 3)
    return torch.where(torch.rand(*shape, generator=g) < 0.5, -mag, mag)


COUNTS = torch.tensor([[5, 21], [0, 0], [38, 3], [40, 17], [64, 0]])  # 32-blocks and not, an empty expert
GK, GN = 96, 64  # K/32 = 3 and N/32 = 2 columns of scales: padded to 4; N rows of W's: padded to 128


def grouped_equals_loop(monkeypatch):
    """The MXFP8 experts with their grouped path taken on the CPU, each `_scaled_grouped_mm`
    computed as the kernel reads its arguments, against the per-group loop (fp64 back end);
    bit for bit, for y, dx and dW."""
    from ndtrain.kernels import mx_experts
    x, dy = exact_operands(int(COUNTS.sum()), GK), exact_operands(int(COUNTS.sum()), GN)
    w = exact_operands(COUNTS.shape[0], GN, GK)

    def run():
        plan = LinearPlan(RECIPES["mxfp8"], Dim.whole(GK), Dim.whole(GN))
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = fp8_expert_matmul(xx, ww, COUNTS, plan)
        y.backward(dy)
        return (y.detach(), xx.grad, ww.grad), plan.backends

    want, backends = run()
    assert set(backends.values()) == {"fp64"}
    calls = []

    def kernel(call):
        calls.append(call)
        return grouped_2d_3d(call) if call.mat_b.dim() == 3 else grouped_2d_2d(call)
    with monkeypatch.context() as m:
        m.setattr(mx_experts, "why_not", lambda x, w, plan: None)
        m.setattr(mx_experts.GroupedCall, "run", kernel)
        got, backends = run()
    assert backends == dict.fromkeys(("forward", "input_grad", "weight_grad"), "scaled_grouped_mm")
    return [torch.equal(a, b) for a, b in zip(got, want)], calls


def test_mxfp8_grouped_calls_read_as_the_kernel_reads_them_equal_the_loop(one_thread, monkeypatch):
    """sm100's MXFP8 experts (kernels/mx_experts.py) with each `_scaled_grouped_mm` computed
    as torch's kernel reads its arguments (its group offsets; the scale layout read back by
    cuBLAS's formula, not by `_swizzle`) equal the per-group loop bit for bit: forward, input
    and weight gradients, groups of 3 to 64 rows from two sources and an empty expert (whose
    gradient the kernel leaves as allocated). Controls: padding groups to 16 rows instead of
    32 misses the weight gradient (its blocks of 32 tokens then hold two groups' rows); laying
    the row groups' scales as one matrix (no 128-row padding per expert) misses the forward
    and the input gradient."""
    from ndtrain.kernels import mx_experts
    equal, calls = grouped_equals_loop(monkeypatch)
    assert equal == [True, True, True]
    ends = calls[0].offs.tolist()
    assert len(calls) == 3 and all(c.offs.tolist() == ends for c in calls)
    assert all((b - a) % 32 == 0 for a, b in zip([0] + ends[:-1], ends)), "whole 32-blocks per expert"
    monkeypatch.setattr(mx_experts, "PAD", 16)
    assert grouped_equals_loop(monkeypatch)[0] == [True, True, False], "32-token blocks across two groups"
    monkeypatch.setattr(mx_experts, "PAD", 32)

    def one_matrix(scale, spans):
        rows = torch.cat([scale.narrow(0, s, n) for s, n in spans])
        return mx_experts._blocked(rows).view(-1, up(scale.shape[1], 4))
    monkeypatch.setattr(mx_experts, "_blocked_rows", one_matrix)
    assert grouped_equals_loop(monkeypatch)[0] == [False, False, True]
