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
