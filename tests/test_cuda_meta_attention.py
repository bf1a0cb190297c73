"""Every CUDA attention op ndtrain calls, called through ndtrain's own functions on fake CUDA
tensors with the 1B preset's shapes (32 query heads of 64, 8 KV heads, 2048 tokens; CP
blocks of a 1024-token chunk; and 2040 tokens, whose 510-token blocks are no multiple of 32,
where efficient attention pads its log-sum-exp), forward and backward: no GPU needed.

torch's fake kernels for these ops give each output CUDA's shape (efficient attention's
log-sum-exp padded to a multiple of 32, cuDNN's with a trailing 1), but they check few of the
inputs. `CudaRules` therefore also checks, at each call, what the CUDA kernels check and
what they read without checking (aten/src/ATen/native/transformers/cuda/attention.cu,
attention_backward.cu and the mem-efficient kernel's `check_supported`, torch 2.6-2.11):
- every op: q, k, v, out and dout 4-D [b, heads, s, d] with the last dimension contiguous,
  in the compute dtype; flash reads grouped K/V heads itself, efficient and cuDNN need as
  many K/V heads as query heads;
- the log-sum-exp handed to a backward is fp32 and shaped as that op's forward returns it
  on CUDA: [b, H, sq] (flash), [b, H, ⌈sq/32⌉·32] (efficient), [b, H, sq, 1] (cuDNN);
- efficient attention's `attn_bias`: q's dtype, exactly [b, H, sq, sk], last dimension
  contiguous, rows aligned to 16 elements, no broadcast (stride-0) dimension, as SDPA's
  `preprocess_mask` lays it out; no gradient asked for it.
A test fails when ndtrain hands an op anything else, or calls another op than the block's.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ndtrain.model.args import PRESETS

aten = torch.ops.aten
ARGS = PRESETS["1B"]
H, G, D = ARGS.n_heads, ARGS.n_kv_heads, ARGS.head_dim
SEQS, CP, BATCH = (2048, 2040), 2, 2
DTYPE = torch.bfloat16

FORWARD = {aten._scaled_dot_product_flash_attention.default: "flash",
           aten._scaled_dot_product_efficient_attention.default: "efficient",
           aten._scaled_dot_product_cudnn_attention.default: "cudnn"}
BACKWARD = {aten._scaled_dot_product_flash_attention_backward.default: "flash",
            aten._scaled_dot_product_efficient_attention_backward.default: "efficient",
            aten._scaled_dot_product_cudnn_attention_backward.default: "cudnn"}


def _heads_ok(name: str, *tensors):
    for t in tensors:
        assert t.device.type == "cuda" and t.dim() == 4 and t.stride(-1) == 1, f"{name}: {t.shape} {t.stride()}"
        assert t.dtype == DTYPE, f"{name}: dtype {t.dtype}"


def _bias_ok(bias, q, k):
    assert bias.dtype == q.dtype, f"attn_bias dtype {bias.dtype}, q {q.dtype}"
    assert tuple(bias.shape) == (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), f"attn_bias {bias.shape}"
    assert bias.stride(-1) == 1 and bias.stride(-2) % 16 == 0, f"attn_bias strides {bias.stride()}"
    assert 0 not in bias.stride()[:-1], f"attn_bias broadcast: strides {bias.stride()}"


class CudaRules(TorchDispatchMode):
    """Checks each CUDA attention op's arguments (see the module docstring) and records
    which ran: `calls` [(kind, "forward" | "backward", with bias)]."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FORWARD:
            kind = FORWARD[func]
            q, k, v = args[:3]
            _heads_ok(kind, q, k, v)
            bias = args[3] if kind in ("efficient", "cudnn") else None
            assert kind == "flash" and q.shape[1] % k.shape[1] == 0 or k.shape[1] == q.shape[1], (kind, k.shape)
            if bias is not None:
                assert kind == "efficient", "ndtrain hands cuDNN no bias"
                _bias_ok(bias, q, k)
            self.calls.append((kind, "forward", bias is not None))
        elif func in BACKWARD:
            kind = BACKWARD[func]
            dout, q, k, v = args[:4]
            out, lse = (args[4], args[5]) if kind != "efficient" else (args[5], args[6])
            _heads_ok(kind, dout, q, k, v, out)
            assert dout.shape == out.shape == q.shape
            b, h, sq = q.shape[:3]
            assert lse.dtype == torch.float32, f"{kind} lse dtype {lse.dtype}"
            want = {"flash": (b, h, sq), "efficient": (b, h, math.ceil(sq / 32) * 32), "cudnn": (b, h, sq, 1)}[kind]
            assert tuple(lse.shape) == want, f"{kind} backward lse {tuple(lse.shape)}, CUDA's forward gives {want}"
            bias = args[4] if kind == "efficient" else None
            if bias is not None:
                _bias_ok(bias, q, k)
                assert list(args[10]) == [True, True, True, False], args[10]
            self.calls.append((kind, "backward", bias is not None))
        return func(*args, **kwargs)


def _cp_blocks(seq: int, docs: bool, window: int, impl: str):
    """The blocks every CP rank computes for one micro-batch of BATCH rows of `seq` tokens, as
    Visibility gives them (real masks, on the CPU)."""
    from ndtrain.parallel.context.layout import zigzag_index
    from ndtrain.parallel.context.visibility import Visibility

    ids = None
    if docs:
        g = torch.Generator().manual_seed(0)
        natural = (torch.rand(BATCH, seq, generator=g) < 1 / 300).long().cumsum(-1)
        ids = torch.stack([natural[:, zigzag_index(seq, CP, r)] for r in range(CP)])
    blocks = []
    for rank in range(CP):
        vis = Visibility(seq, CP, rank, docs=ids, window=window)
        found = vis.gathered_blocks() if impl == "allgather" else [vis.ring_block(r) for r in range(CP)]
        blocks += [blk for blk in found if blk is not None]
    return blocks


def _fake(block):
    """The block with its mask as a fake CUDA tensor of the same shape."""
    from ndtrain.parallel.context.visibility import Block

    mask = None if block.mask is None else torch.empty(block.mask.shape, dtype=torch.bool, device="cuda")
    return Block(block.rows, block.cols, mask, block.causal)


def _run_block(block, kind: str):
    """ndtrain's forward and backward of one block on fake CUDA tensors, its outputs checked."""
    from ndtrain.parallel.context import fused

    sq, sk = block.rows.stop - block.rows.start, block.cols.stop - block.cols.start
    fake = _fake(block)
    q, dout = (torch.empty(BATCH, H, sq, D, dtype=DTYPE, device="cuda") for _ in range(2))
    k, v = (torch.empty(BATCH, G, sk, D, dtype=DTYPE, device="cuda") for _ in range(2))
    out, lse = fused.forward(q, k, v, fake, D ** -0.5, kind)
    assert out.shape == (BATCH, H, sq, D) and out.dtype == torch.float32
    assert lse.shape == (BATCH, H, sq) and lse.dtype == torch.float32
    dq, dk, dv = fused.backward(dout, q, k, v, out.to(DTYPE), lse, fake, D ** -0.5, kind)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    assert {t.dtype for t in (dq, dk, dv)} == {DTYPE}


@pytest.mark.parametrize("seq", SEQS)
@pytest.mark.parametrize("kind", ["flash", "efficient", "cudnn"])
def test_cp_full_and_causal_blocks_on_each_cuda_op(kind, seq):
    """Ring blocks without documents or window (the causal 1024² square, full 512×1024 and
    1024×512 blocks) and all-gather blocks (512 × up to 1536 keys)."""
    blocks = _cp_blocks(seq, False, 0, "ring") + _cp_blocks(seq, False, 0, "allgather")
    assert any(b.causal for b in blocks) and any(not b.causal for b in blocks)
    assert all(b.mask is None for b in blocks)
    rules = CudaRules()
    with FakeTensorMode(), rules:
        for block in blocks:
            _run_block(block, kind)
    assert rules.calls == [(kind, step, False) for _ in blocks for step in ("forward", "backward")]


@pytest.mark.parametrize("seq", SEQS)
@pytest.mark.parametrize("impl", ["ring", "allgather"])
@pytest.mark.parametrize("docs, window", [(True, 0), (False, 700), (True, 700)])
def test_cp_masked_blocks_on_efficient_attention_with_a_bias(impl, docs, window, seq):
    """Blocks with a document mask and/or a sliding window run efficient attention with the
    mask as its bias (sk not a multiple of 16 included, through the window's key range)."""
    from ndtrain.parallel.context import fused

    blocks = _cp_blocks(seq, docs, window, impl)
    masked = [b for b in blocks if b.mask is not None]
    assert masked
    if window and impl == "allgather":
        assert any((b.cols.stop - b.cols.start) % 16 for b in masked)  # rows the bias must pad
    rules = CudaRules()
    with FakeTensorMode(), rules:
        for block in masked:
            _run_block(block, "efficient")
        bad = _fake(masked[0])  # the rules catch a bias broadcast over the batch
        q = torch.empty(BATCH, H, bad.rows.stop - bad.rows.start, D, dtype=DTYPE, device="cuda")
        k = torch.empty(BATCH, H, bad.cols.stop - bad.cols.start, D, dtype=DTYPE, device="cuda")
        broadcast = fused.attention_bias(bad, q, k).narrow(0, 0, 1).expand(BATCH, -1, -1, -1)
        with pytest.raises(AssertionError, match="attn_bias broadcast"):
            aten._scaled_dot_product_efficient_attention(q, k, k, broadcast, True, 0.0, False)
    assert rules.calls == [("efficient", step, True) for _ in masked for step in ("forward", "backward")]


def test_packed_documents_on_flex_attention(monkeypatch):
    """Packed SFT on CUDA (model.doc_attention = flex): the model's attention core hands
    flex_attention the 1B shapes (q [b, 32, 2048, 64], K/V with 8 heads, grouped-query
    attention on) and a block mask built for [b, ·, 2048, 2048] on the CUDA device by a
    compiled kernel, and runs the compiled flex_attention; no s × s tensor is made on the way.
    Flex's CUDA path itself cannot run under fake tensors on a CPU-only torch (its uncompiled
    path expands the block mask with indexing that needs a CUDA device), so the two calls
    are checked at that boundary; tests/test_sft.py proves on the CPU that the rule and
    block mask handed over give the mask's results, and a `-m cuda` test in tests/test_model.py
    runs the real kernels."""
    from ndtrain.model import llama

    s, b = 2048, BATCH
    calls = []

    def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, _compile=False, **kw):
        assert (B, H, Q_LEN, KV_LEN) == (b, None, s, s) and torch.device(device).type == "cuda" and _compile
        calls.append("block mask")
        return "the block mask"

    def compiled_flex(q, k, v, block_mask=None, enable_gqa=False, **kw):
        _heads_ok("flex", q, k, v)
        assert tuple(q.shape) == (b, H, s, D) and tuple(k.shape) == tuple(v.shape) == (b, G, s, D)
        assert enable_gqa and block_mask == "the block mask" and not kw
        calls.append("flex")
        return torch.empty_like(q)

    import torch.nn.attention.flex_attention as flex
    monkeypatch.setattr(flex, "create_block_mask", create_block_mask)
    monkeypatch.setattr(llama, "_compiled_flex_attention", lambda: compiled_flex)
    core = llama.AttentionCore(documents="flex")
    with FakeTensorMode():
        q = torch.empty(b, s, H, D, dtype=DTYPE, device="cuda")
        k, v = (torch.empty(b, s, G, D, dtype=DTYPE, device="cuda") for _ in range(2))
        cos, sin = (torch.empty(s, D // 2, device="cuda") for _ in range(2))
        big = []
        with _Sizes(big):
            out = core(q, k, v, cos, sin, doc_ids=torch.empty(b, s, dtype=torch.long, device="cuda"))
    assert out.shape == (b, s, H * D) and out.dtype == DTYPE
    assert calls == ["block mask", "flex"]
    square = [shape for shape in big if shape[-2:] == (s, s) and shape != (b, s, H * D)]  # H·D = 2048 = s here
    assert not square, square


class _Sizes(TorchDispatchMode):
    """Records the shape of every tensor an op returns."""

    def __init__(self, shapes: list):
        super().__init__()
        self.shapes = shapes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out
