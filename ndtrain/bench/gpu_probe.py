"""`python -m ndtrain.bench.gpu_probe`: which CUDA-only calls ndtrain relies on work on this
GPU and torch, how fast, and how exact (a step of `ndtrain bench gpu`, usable alone).

Each probe runs one call (or ndtrain's own fp8 linear) with the shapes of the 1B preset (dim 2048, 32 heads of 64, 8 KV
heads, MLP 8192, 4 sequences of 2048 tokens) and prints one line: `ok` with its TFLOP/s and,
for a product, its largest error against the same product in fp32 from the dequantized
operands, relative to that product's largest entry; or `FAILED` with the error's first line.
A failed probe is a fact about this torch and GPU, not a crash: the next probe still runs.
The last line is one JSON object of every probe's status (the table's cell in bench gpu).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
T, D, H, G, HD, FFN = 8192, 2048, 32, 8, 64, 8192  # tokens of one micro-batch, the 1B preset's widths


def _timed(fn: Callable[[], object], reps: int = 10) -> float:
    """Seconds per call: mean of `reps` after 3 warm-up calls, between CUDA events."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / reps


def _q(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-448, 448).to(E4M3)


def _tile_scale(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """amax/448 per rows×cols tile of x [R, C] → [R/rows, C/cols]."""
    r, c = x.shape
    t = x.float().abs().reshape(r // rows, rows, c // cols, cols).amax(dim=(1, 3))
    return t.clamp_min(1e-12) / 448


def _expand(s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return s.repeat_interleave(rows, 0).repeat_interleave(cols, 1)


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


def probe_matmuls() -> dict[str, Callable[[], str]]:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, D, device=dev, generator=g, dtype=torch.bfloat16)
    w = torch.randn(FFN, D, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
    flops = 2 * T * D * FFN

    def bf16() -> str:
        ref = x.float() @ w.float().t()
        s = _timed(lambda: x @ w.t())
        return f"{flops / s / 1e12:.0f} TFLOP/s, err {_err(x @ w.t(), ref):.1e}"

    def tensorwise() -> str:
        sx, sw = x.float().abs().amax() / 448, w.float().abs().amax() / 448
        qx, qw = _q(x, sx), _q(w, sw)
        ref = (qx.float() * sx) @ (qw.float() * sw).t()
        call = lambda: torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)  # noqa: E731
        return f"{flops / _timed(call) / 1e12:.0f} TFLOP/s, err {_err(call(), ref):.1e}"

    def rowwise() -> str:
        sx, sw = _tile_scale(x, 1, D), _tile_scale(w, 1, D)
        qx, qw = _q(x, sx), _q(w, sw)
        ref = (qx.float() * sx) @ (qw.float() * sw).t()
        call = lambda: torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.t(), out_dtype=torch.bfloat16)  # noqa: E731
        return f"{flops / _timed(call) / 1e12:.0f} TFLOP/s, err {_err(call(), ref):.1e}"

    def blockwise() -> str:
        """x in 1×128 tiles, w in 128×128 blocks: scale_a [T, D/128] column-major, scale_b
        [D/128, FFN/128] column-major (the layout the first H200 accepted; row-major was refused)."""
        sx, sw = _tile_scale(x, 1, 128), _tile_scale(w, 128, 128)
        qx, qw = _q(x, _expand(sx, 1, 128)), _q(w, _expand(sw, 128, 128))
        ref = (qx.float() * _expand(sx, 1, 128)) @ (qw.float() * _expand(sw, 128, 128)).t()
        sa, sb = sx.t().contiguous().t(), sw.t()
        call = lambda: torch._scaled_mm(qx, qw.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
        return f"{flops / _timed(call) / 1e12:.0f} TFLOP/s, err {_err(call(), ref):.1e}"

    def blockwise_1x128_both() -> str:
        """The weight gradient's product: both operands in 1×128 tiles along K."""
        sx, sw = _tile_scale(x, 1, 128), _tile_scale(w, 1, 128)
        qx, qw = _q(x, _expand(sx, 1, 128)), _q(w, _expand(sw, 1, 128))
        ref = (qx.float() * _expand(sx, 1, 128)) @ (qw.float() * _expand(sw, 1, 128)).t()
        sa, sb = sx.t().contiguous().t(), sw.t().contiguous()
        call = lambda: torch._scaled_mm(qx, qw.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
        return f"{flops / _timed(call) / 1e12:.0f} TFLOP/s, err {_err(call(), ref):.1e}"

    return {"bf16 matmul [8192x2048]x[2048x8192]": bf16, "fp8 _scaled_mm tensorwise": tensorwise,
            "fp8 _scaled_mm rowwise": rowwise,
            "fp8 _scaled_mm blockwise 1x128 x 128x128": blockwise,
            "fp8 _scaled_mm blockwise 1x128 x 1x128": blockwise_1x128_both}


def probe_grouped() -> dict[str, Callable[[], str]]:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    x = torch.randn(T, D, device=dev, generator=g, dtype=torch.bfloat16)

    def grouped(kind: str) -> Callable[[], str]:
        """8 experts over the T tokens in unequal groups (offs: each group's end row)."""
        def run() -> str:
            e, f = 8, 1024
            sizes = torch.tensor([1600, 512, 1024, 1024, 640, 1408, 896, 1088], device=dev)
            offs = sizes.cumsum(0).to(torch.int32)
            we = torch.randn(e, f, D, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
            ref = torch.cat([x[int(a):int(b)].float() @ we[i].float().t()
                             for i, (a, b) in enumerate(zip([0, *offs[:-1].tolist()], offs.tolist()))])
            gflops = 2 * T * D * f
            if kind == "bf16":
                call = lambda: torch._grouped_mm(x, we.transpose(-2, -1), offs=offs)  # noqa: E731
            else:
                sx = _tile_scale(x, 1, D)
                swe = we.float().abs().amax(-1).clamp_min(1e-12) / 448  # [e, f]
                qx, qwe = _q(x, sx), _q(we, swe[..., None])
                ref = torch.cat([(qx[int(a):int(b)].float() * sx[int(a):int(b)]) @ (qwe[i].float() * swe[i][:, None]).t()
                                 for i, (a, b) in enumerate(zip([0, *offs[:-1].tolist()], offs.tolist()))])
                call = lambda: torch._scaled_grouped_mm(qx, qwe.transpose(-2, -1), sx.flatten(), swe,  # noqa: E731
                                                        offs=offs, out_dtype=torch.bfloat16)
            return f"{gflops / _timed(call) / 1e12:.0f} TFLOP/s, err {_err(call(), ref):.1e}"
        return run

    return {"torch._grouped_mm bf16 (8 experts)": grouped("bf16"),
            "torch._scaled_grouped_mm rowwise fp8 (8 experts)": grouped("fp8")}


def probe_fp8_linear() -> dict[str, Callable[[], str]]:
    """ndtrain's own fp8 linear (kernels/fp8_linear.py), forward and backward at the MLP's
    shape, eager and compiled, against bf16 `F.linear`: whether fp8 pays here, and on which
    back end each matmul ran."""
    from ndtrain.kernels.fp8 import Dim
    from ndtrain.kernels.fp8_linear import RECIPES, LinearPlan, fp8_linear

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(2)
    x = torch.randn(T, D, device=dev, generator=g, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(FFN, D, device=dev, generator=g, dtype=torch.bfloat16) * 0.02).requires_grad_()
    flops = 3 * 2 * T * D * FFN

    def step(fn) -> Callable[[], None]:
        return lambda: fn(x, w).sum().backward()

    def bf16(compiled: bool) -> Callable[[], str]:
        def run() -> str:
            fn = torch.compile(F.linear) if compiled else F.linear
            return f"{flops / _timed(step(lambda a, b: fn(a, b))) / 1e12:.0f} TFLOP/s"
        return run

    def fp8(recipe: str, compiled: bool) -> Callable[[], str]:
        def run() -> str:
            plan = LinearPlan(RECIPES[recipe], Dim.whole(D), Dim.whole(FFN))
            fn = torch.compile(fp8_linear) if compiled else fp8_linear
            rate = flops / _timed(step(lambda a, b: fn(a, b, None, plan))) / 1e12
            return f"{rate:.0f} TFLOP/s, back ends {plan.backends or 'not recorded (compiled)'}"
        return run

    out = {"bf16 F.linear fwd+bwd, eager": bf16(False), "bf16 F.linear fwd+bwd, compiled": bf16(True)}
    for recipe in RECIPES:
        for compiled in (False, True):
            out[f"ndtrain fp8 {recipe} linear fwd+bwd, {'compiled' if compiled else 'eager'}"] = fp8(recipe, compiled)
    return out


def probe_attention() -> dict[str, Callable[[], str]]:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    b, s = 4, 2048
    q = torch.randn(b, H, s, HD, device=dev, generator=g, dtype=torch.bfloat16)
    k = torch.randn(b, G, s, HD, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn(b, G, s, HD, device=dev, generator=g, dtype=torch.bfloat16)
    kr, vr = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    flops = 4 * b * H * s * s * HD / 2 * 3.5  # causal forward + backward (2.5× forward)
    aten = torch.ops.aten
    docs = torch.arange(s, device=dev) // 700
    visible = (docs[:, None] == docs[None, :]) & torch.ones(s, s, dtype=torch.bool, device=dev).tril()
    bias = torch.zeros(b, H, s, s, device=dev, dtype=torch.bfloat16).masked_fill(~visible, float("-inf"))

    def fwd_bwd(fwd: Callable[[], tuple], bwd: Callable[[tuple], object]) -> str:
        outs = fwd()
        bwd(outs)
        return f"{flops / _timed(lambda: bwd(fwd())) / 1e12:.0f} TFLOP/s, lse {tuple(outs[1].shape)}"

    def flash() -> str:
        scale = HD ** -0.5

        def fwd():
            return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)

        def bwd(o):
            out, lse, cq, ck, mq, mk, seed, offset, _ = o
            return aten._scaled_dot_product_flash_attention_backward(out, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True,
                                                                     seed, offset, scale=scale)
        return fwd_bwd(fwd, bwd)

    def efficient(with_bias: bool) -> Callable[[], str]:
        def run() -> str:
            ab = bias if with_bias else None

            def fwd():
                return aten._scaled_dot_product_efficient_attention(q, kr, vr, ab, True, 0.0, not with_bias)

            def bwd(o):
                out, lse, seed, offset = o
                return aten._scaled_dot_product_efficient_attention_backward(
                    out, q, kr, vr, ab, out, lse, seed, offset, 0.0, [True, True, True, with_bias], not with_bias)
            return fwd_bwd(fwd, bwd)
        return run

    def cudnn() -> str:
        def fwd():
            return aten._scaled_dot_product_cudnn_attention(q, kr, vr, None, True, 0.0, True, False)

        def bwd(o):
            out, lse, cq, ck, mq, mk, seed, offset, _ = o
            return aten._scaled_dot_product_cudnn_attention_backward(out, q, kr, vr, out, lse, seed, offset, None,
                                                                     cq, ck, mq, mk, 0.0, True)
        return fwd_bwd(fwd, bwd)

    def sdpa_gqa() -> str:
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))

        def step():
            F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True).sum().backward()
        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True, enable_gqa=True)
        return f"{flops / _timed(step) / 1e12:.0f} TFLOP/s, backend {choice}"

    def sdpa_bool_mask() -> str:
        mask = visible[None, None].expand(b, 1, s, s)
        choice = torch._fused_sdp_choice(q, kr, vr, mask, 0.0, False)
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, kr, vr))

        def step():
            F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask).sum().backward()
        return f"{flops / _timed(step) / 1e12:.0f} TFLOP/s, backend {choice}"

    return {"flash attention with LSE (GQA native), fwd+bwd": flash,
            "efficient attention with LSE, causal, fwd+bwd": efficient(False),
            "efficient attention with attn_bias (document mask), fwd+bwd": efficient(True),
            "cuDNN attention with LSE, fwd+bwd": cudnn,
            "SDPA causal enable_gqa, fwd+bwd": sdpa_gqa,
            "SDPA boolean document mask [b,1,s,s], fwd+bwd": sdpa_bool_mask}


def probe_runtime() -> dict[str, Callable[[], str]]:
    def compiled() -> str:
        f = torch.compile(lambda a: F.silu(a) * a + 1)
        a = torch.randn(4096, 4096, device="cuda")
        t0 = time.perf_counter()
        ok = torch.allclose(f(a), F.silu(a) * a + 1, atol=1e-5)
        return f"{'equal' if ok else 'DIFFERENT'}, first call {time.perf_counter() - t0:.1f} s"

    def nccl() -> str:
        import torch.distributed as dist
        return f"available {dist.is_nccl_available()}, version {torch.cuda.nccl.version()}"

    def fused_adamw() -> str:
        p = [torch.randn(2048, 2048, device="cuda", requires_grad=True) for _ in range(8)]
        for t in p:
            t.grad = torch.randn_like(t)
        opt = torch.optim.AdamW(p, fused=True)
        return f"{_timed(opt.step) * 1e3:.2f} ms for 8 × 2048² fp32"

    return {"torch.compile (Inductor, Triton)": compiled, "NCCL": nccl, "fused AdamW": fused_adamw}


def main() -> int:
    if not torch.cuda.is_available():
        print("ndtrain: the GPU probe needs a CUDA device, and torch sees none", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name} sm{props.major}{props.minor}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"cuDNN {torch.backends.cudnn.version()}", flush=True)
    status = {}
    for group in (probe_runtime, probe_matmuls, probe_grouped, probe_attention, probe_fp8_linear):
        for name, probe in group().items():
            try:
                text = probe()
                status[name] = "ok"
                print(f"ok      {name}: {text}", flush=True)
            except Exception as e:  # noqa: BLE001 - every failure is a finding, reported in one line
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                status[name] = "failed"
                print(f"FAILED  {name}: {type(e).__name__}: {first}", flush=True)
            torch.cuda.synchronize()
    ok = sum(v == "ok" for v in status.values())
    print(json.dumps({"probes_ok": ok, "probes": len(status), "status": status}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
