"""Context parallelism (issue 10): the layout, the attention kernels against full attention,
and end-to-end training equal to one process.

Kernel rows run every back end on cp ∈ {2, 3, 4} ranks in fp64 against full attention
computed on one device: output, log-sum-exp (ring, allgather; Ulysses runs SDPA between its
all-to-alls and has no merged lse) and dq, dk, dv of every rank's tokens within 1e-10 of the
reference's largest element, causal and full, MHA and GQA, with and without packed
documents (including documents that leave whole ring blocks masked), on the fused CPU op
and on the plain kernel (parallel/context/fused.py, kernels.py).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from helpers import FP64
from ndtrain.testing import run_ranks

KERNEL_TOL = 1e-10
IMPLS = ("ring", "allgather", "ulysses")


# --------------------------------------------------------------------------- the layout

def _visible_pairs(block) -> int:
    n = (block.rows.stop - block.rows.start) * (block.cols.stop - block.cols.start)
    if block.causal:
        side = block.rows.stop - block.rows.start
        return side * (side + 1) // 2
    return n if block.mask is None else int(block.mask.sum())


def test_zigzag_layout_covers_every_token_once_and_balances_causal_work():
    from ndtrain.parallel.context.layout import gathered_index, zigzag_index
    from ndtrain.parallel.context.visibility import Visibility

    assert zigzag_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    for cp in (1, 2, 3, 4):
        s = 2 * cp * 5
        assert sorted(gathered_index(s, cp).tolist()) == list(range(s))
        # visible (query, key) pairs computed per rank, summed over the ring's steps, and
        # over the all-gather back end's blocks: no block holds a masked pair
        ring, gathered = [], []
        for r in range(cp):
            vis = Visibility(s, cp, r)
            pairs = 0
            for src in range(cp):
                block = vis.ring_block(src)
                if block is not None:
                    pairs += _visible_pairs(block)
                    if src != r:  # off-diagonal steps: 2c² pairs, no mask
                        assert block.mask is None and not block.causal
                        assert _visible_pairs(block) == 2 * (s // (2 * cp)) ** 2
                    else:  # the diagonal: the local causal square
                        assert block.causal and block.mask is None
            ring.append(pairs)
            blocks = vis.gathered_blocks()
            assert all(b.mask is None for b in blocks) and len(blocks) == 4 - (r == 0)
            gathered.append(sum(_visible_pairs(b) for b in blocks))
        assert ring == [ring[0]] * cp and sum(ring) == s * (s + 1) // 2
        assert gathered == ring


def test_shard_permutes_every_field_together():
    from ndtrain.data.batch import MicroBatch
    from ndtrain.parallel.context.layout import shard

    tokens = torch.arange(16).view(2, 8)
    mb = MicroBatch(tokens, tokens + 100, doc_ids=tokens // 3, weights=tokens.double())
    part = shard(mb, 2, 1)
    assert part.tokens.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert part.targets.tolist() == (part.tokens + 100).tolist()  # shifted before sharding
    assert part.positions.tolist() == [[2, 3, 4, 5]] * 2  # true global positions
    assert part.doc_ids.tolist() == (part.tokens // 3).tolist()
    assert part.weights.tolist() == part.tokens.double().tolist()


@pytest.mark.parametrize("kernel", ["plain", "fused"])
def test_kernels_handle_fully_masked_rows_and_blocks(kernel):
    """A row that sees nothing has lse −inf and output 0; a block that sees nothing merges
    as nothing and contributes no gradient; on the plain kernel and on the fused CPU op
    (which reports lse 0 for such a row: fused.py corrects it)."""
    from ndtrain.parallel.context import fused
    from ndtrain.parallel.context.kernels import attend, attend_backward, merge
    from ndtrain.parallel.context.visibility import Block

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 1, 5, 4, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    mask[..., 1, :] = False  # a row that sees nothing
    nothing = torch.zeros(1, 1, 3, 5, dtype=torch.bool)  # a block that sees nothing
    some, none = Block(slice(0, 3), slice(0, 5), mask), Block(slice(0, 3), slice(0, 5), nothing)
    if kernel == "plain":
        (out, lse), (b_out, b_lse) = attend(q, k, v, mask, 0.5), attend(q, k, v, nothing, 0.5)
    else:
        assert fused.kernel_for(q, k, some) == "cpu"
        (out, lse), (b_out, b_lse) = fused.forward(q, k, v, some, 0.5), fused.forward(q, k, v, none, 0.5)
    assert torch.isneginf(lse[..., 1]).all() and (out[..., 1, :] == 0).all() and torch.isfinite(lse[..., 0]).all()
    assert torch.isneginf(b_lse).all() and (b_out == 0).all()
    merged, merged_lse = merge(out, lse, b_out, b_lse)
    assert torch.equal(merged, out) and torch.equal(merged_lse, lse)
    dout = torch.ones_like(out)
    if kernel == "plain":
        grads = attend_backward(q, k, v, nothing, 0.5, lse, (dout * out).sum(-1), dout)
    else:
        grads = fused.backward(dout, q, k, v, out, lse, none, 0.5)
    assert all(torch.isfinite(t).all() and (t == 0).all() for t in grads)


# --------------------------------------------------------------------------- kernels on cp ranks

def _reference(q, k, v, causal, docs):
    """Full attention on one device: out [b, S, H, d], lse [b, S, H] (fp64, plain math)."""
    b, s, h, d = q.shape
    k, v = (t.repeat_interleave(h // k.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    mask = torch.ones(s, s, dtype=torch.bool)
    if causal:
        mask = mask.tril()
    mask = mask.expand(b, s, s)
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse[..., None]), v)
    return out, lse.transpose(1, 2)


def _documents(b: int, s: int, cp: int, g) -> torch.Tensor:
    """Row 0: one document per zigzag chunk (every off-diagonal ring block fully masked);
    other rows: random document lengths."""
    c = s // (2 * cp)
    rows = [torch.arange(s) // c]
    for _ in range(b - 1):
        cuts = torch.zeros(s, dtype=torch.long)
        cuts[torch.randperm(s - 1, generator=g)[: max(1, s // 5)] + 1] = 1
        rows.append(cuts.cumsum(0))
    return torch.stack(rows)


def _kernel_cases(cp: int):
    gqa = {2: 2, 3: 3, 4: 2}[cp]  # KV heads that Ulysses can split (cp=2, 3) or repeat (cp=4)
    for kernel in ("fused", "plain"):
        for impl in ("ring", "allgather", "ulysses"):
            for causal in (True, False):
                for heads, kv in ((12, 12), (12, gqa)):
                    for docs in (False, True):
                        yield kernel, impl, causal, heads, kv, docs


def _kernels_on_ranks(cp: int) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ndtrain.mesh import MeshShape, ParallelMesh
    from ndtrain.parallel.context import fused
    from ndtrain.parallel.context.allgather import AllGatherAttention, allgather_forward
    from ndtrain.parallel.context.kernels import from_heads
    from ndtrain.parallel.context.layout import zigzag_index
    from ndtrain.parallel.context.ring import RingAttention, ring_forward
    from ndtrain.parallel.context.ulysses import ulysses_attention
    from ndtrain.parallel.context.visibility import Visibility

    mesh = ParallelMesh.build(MeshShape(cp=cp))
    group = mesh.group("cp")
    results = []
    for kernel, impl, causal, heads, kv, with_docs in _kernel_cases(cp):
        g = torch.Generator().manual_seed(7)
        b, s, d = 3, 2 * cp * 3, 8
        q = torch.randn(b, s, heads, d, generator=g, dtype=torch.float64)
        k, v = (torch.randn(b, s, kv, d, generator=g, dtype=torch.float64) for _ in range(2))
        w = torch.randn(b, s, heads * d, generator=g, dtype=torch.float64)
        docs = _documents(b, s, cp, g) if with_docs else None
        # reference: every rank computes it, on the whole sequence
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = _reference(*ref, causal, docs)
        (ref_out.flatten(2) * w).sum().backward()
        # this rank's tokens
        idx = zigzag_index(s, cp, group.rank)
        mine = [t[:, idx].clone().requires_grad_() for t in (q, k, v)]
        gathered_docs = torch.stack([docs[:, zigzag_index(s, cp, r)] for r in range(cp)]) if with_docs else None
        vis = Visibility(s, cp, group.rank, causal=causal, docs=gathered_docs)
        fn = {"ring": RingAttention.apply, "allgather": AllGatherAttention.apply, "ulysses": ulysses_attention}[impl]
        # the plain kernel where torch's selector offers no fused op (SDPBackend.MATH)
        backends = [SDPBackend.MATH] if kernel == "plain" else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
        with sdpa_kernel(backends):
            keys = k if impl == "allgather" else mine[1]  # the key columns a block indexes
            blocks = vis.gathered_blocks() if impl == "allgather" else [vis.ring_block(r) for r in range(cp)]
            used = {fused.kernel_for(mine[0].detach().transpose(1, 2)[:, :, b.rows], keys.transpose(1, 2)[:, :, b.cols],
                                     b) for b in blocks if b is not None}
            assert used == {"plain" if kernel == "plain" else "cpu"}, used
            out = fn(*mine, group, vis)
            (out * w[:, idx]).sum().backward()
        errors = {"out": _relative(out, ref_out.flatten(2)[:, idx])}
        if impl != "ulysses":
            forward = ring_forward if impl == "ring" else allgather_forward
            with sdpa_kernel(backends):
                plain_out, lse = forward(*[t.detach() for t in mine], group, vis)[:2]
            errors["lse"] = _relative(lse.transpose(1, 2), ref_lse[:, idx])  # [b, H, s] → [b, s, H]
            assert torch.equal(from_heads(plain_out).to(q.dtype), out.detach())
        for name, mine_t, ref_t in zip(("dq", "dk", "dv"), mine, ref):
            errors[name] = _relative(mine_t.grad, ref_t.grad[:, idx])
        results.append({"case": (kernel, impl, causal, heads, kv, with_docs), **errors})
    return results


def _relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return float((a.detach() - ref.detach()).abs().max() / ref.detach().abs().max())


@pytest.mark.parametrize("cp", [2, pytest.param(3, marks=pytest.mark.slow), 4])
def test_attention_kernels_equal_full_attention_fp64(cp):
    per_rank = run_ranks(_kernels_on_ranks, cp, cp)
    worst = 0.0
    for rank, results in enumerate(per_rank):
        for r in results:
            for key, err in r.items():
                if key != "case":
                    assert err <= KERNEL_TOL, f"rank {rank} {r['case']}: {key} differs by {err:.1e}"
                    worst = max(worst, err)
    assert len(per_rank[0]) == 48
    print(f"cp={cp}: largest relative deviation {worst:.1e}")


@pytest.mark.cuda
@pytest.mark.parametrize("backend, dtype", [("flash", torch.bfloat16), ("efficient", torch.bfloat16),
                                            ("efficient", torch.float32), ("cudnn", torch.bfloat16)])
def test_cuda_fused_blocks_merge_to_full_attention(backend, dtype):
    """On a GPU, each CUDA op that returns the log-sum-exp (forced with sdpa_kernel): the
    second half of a sequence's queries against a full block (the first half's keys) and a
    causal square (its own), merged by lse, then each block's backward from the merged
    output and lse; against attention over the whole sequence in fp32 on the same (rounded)
    inputs. Tolerance: bf16 rounds each block's output and gradients to 8 bits (2⁻⁸ ≈ 4e-3
    of a value), so 2e-2 of the largest element; fp32 1e-3 (the kernels may sum in another
    order and use TF32-free fp32 math)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ndtrain.parallel.context import fused
    from ndtrain.parallel.context.visibility import Block
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    forced = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, kv, n, d = 2, 8, 2, 256, 64
    q = torch.randn(b, h, n, d, generator=g, device="cuda").to(dtype)
    k, v = (torch.randn(b, kv, 2 * n, d, generator=g, device="cuda").to(dtype) for _ in range(2))
    dout = torch.randn(b, h, n, d, generator=g, device="cuda").to(dtype)
    full, diag = Block(slice(0, n), slice(0, n), None), Block(slice(0, n), slice(n, 2 * n), None, causal=True)
    scale = d ** -0.5
    expected = "plain" if backend == "efficient" and dtype in fused.HALF_EFFICIENT_BROKEN else backend
    with sdpa_kernel([forced]):
        assert {fused.kernel_for(q, k[:, :, :n], blk) for blk in (full, diag)} == {expected}
        mine = _merged_blocks(q, k, v, dout, (full, diag), scale)
    visible = torch.ones(n, 2 * n, dtype=torch.bool, device="cuda").tril(n)
    _assert_near_full_attention(mine, q, k, v, dout, visible, scale, 2e-2 if dtype == torch.bfloat16 else 1e-3,
                                f"{backend} {dtype}")


def _merged_blocks(q, k, v, dout, blocks, scale):
    """ndtrain's blocks of q against column ranges of k, v, merged by lse, and each block's
    backward from the merged result: out and lse (fp32), then dq, dk, dv (fp32 sums)."""
    from ndtrain.parallel.context import fused
    from ndtrain.parallel.context.kernels import Partial

    partial = Partial(q.shape, torch.float32, q.device)
    for blk in blocks:
        partial.add(blk.rows, *fused.forward(q, k[:, :, blk.cols], v[:, :, blk.cols], blk, scale))
    out, lse = partial.result()
    grads = [torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v)]
    for blk in blocks:
        dq, dk, dv = fused.backward(dout, q, k[:, :, blk.cols], v[:, :, blk.cols], out.to(q.dtype), lse, blk, scale)
        grads[0] += dq
        grads[1][:, :, blk.cols] += dk
        grads[2][:, :, blk.cols] += dv
    return out, lse, *grads


def _assert_near_full_attention(mine, q, k, v, dout, visible, scale, tol, what):
    """`mine` (out, lse, dq, dk, dv) against attention of q over all of k, v where `visible`,
    in fp32 on the same inputs: each within `tol` of the largest element, and finite."""
    h, kv = q.shape[1], k.shape[1]
    ref = [t.float().requires_grad_() for t in (q, k, v)]
    keys, values = (t.repeat_interleave(h // kv, 1) for t in ref[1:])
    scores = (ref[0] @ keys.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    ref_out = torch.softmax(scores, -1) @ values
    ref_out.backward(dout.float())
    for name, got, theirs in zip(("out", "lse", "dq", "dk", "dv"), mine,
                                 (ref_out, torch.logsumexp(scores, -1), *(t.grad for t in ref))):
        assert torch.isfinite(got).all(), f"{what}: {name} not finite"
        err = float((got.detach() - theirs.detach()).abs().max() / theirs.detach().abs().max())
        assert err <= tol, f"{what}: {name} differs by {err:.1e}"


def _fake_cuda(*shapes, dtype=torch.bfloat16):
    return [torch.empty(shape, dtype=dtype, device="cuda") for shape in shapes]


def test_kernel_for_repeats_grouped_heads_when_the_selector_raises_or_answers_math(monkeypatch):
    """The bug an H200 showed (docs/benchmarks-gpu.md): with only efficient attention
    allowed, torch 2.11's selector raises for grouped heads instead of answering "math",
    and kernel_for then ran the plain kernel. Here the selector is replaced by one that
    does what torch 2.11 does (raise, or answer math, for K/V heads ≠ query heads; efficient
    otherwise): both must lead to efficient attention with the heads repeated, and a
    selector that refuses the repeated heads too must lead to the plain kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ndtrain.parallel.context import fused
    from ndtrain.parallel.context.visibility import Block

    asked = []

    def selector(answer_for_gqa):
        def choice(q, k, v, mask, dropout, causal, enable_gqa=False):
            asked.append((k.shape[1], enable_gqa))
            if k.shape[1] == q.shape[1]:
                return 2  # SDPBackend.EFFICIENT_ATTENTION
            if answer_for_gqa is None:
                raise RuntimeError("No available kernel. Aborting execution.")
            return answer_for_gqa
        return choice

    with FakeTensorMode():
        q, k = _fake_cuda((2, 8, 64, 64), (2, 2, 64, 64), dtype=torch.float32)
        blocks = [Block(slice(0, 64), slice(0, 64), None, causal) for causal in (False, True)]
        for answer in (None, 0):  # raises; answers SDPBackend.MATH
            monkeypatch.setattr(torch, "_fused_sdp_choice", selector(answer))
            asked.clear()
            assert [fused.kernel_for(q, k, blk) for blk in blocks] == ["efficient", "efficient"]
            assert asked == [(2, True), (8, False)] * 2
        half_q, half_k = _fake_cuda((2, 8, 64, 64), (2, 2, 64, 64))  # bf16: efficient's backward is not trusted
        assert fused.kernel_for(half_q, half_k, blocks[0]) == "plain"
        monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("none")))
        assert fused.kernel_for(q, k, blocks[0]) == "plain"
        wide = _fake_cuda((2, 8, 64, 64))[0]  # no grouped heads: no second question
        monkeypatch.setattr(torch, "_fused_sdp_choice", selector(None))
        asked.clear()
        assert fused.kernel_for(q, wide.float(), blocks[1]) == "efficient" and asked == [(8, False)]


def test_masked_cuda_blocks_run_efficient_attention_when_it_is_on_and_takes_them(monkeypatch):
    """A block with a mask (documents, a window) on CUDA runs efficient attention with the
    mask as its bias, asked of torch with that bias and K/V repeated; the plain kernel where
    sdpa_kernel switches efficient attention off or torch says it cannot take the inputs.
    (`can_use_efficient_attention` needs a real GPU to answer, so it is replaced here.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ndtrain.parallel.context import fused
    from ndtrain.parallel.context.visibility import Block

    seen = []

    def can_use(params, debug=False):
        seen.append((tuple(params.key.shape), tuple(params.attn_mask.shape), params.attn_mask.dtype))
        return params.query.dtype != torch.float64

    monkeypatch.setattr(torch.backends.cuda, "can_use_efficient_attention", can_use)
    with FakeTensorMode():
        q, k = _fake_cuda((2, 8, 48, 64), (2, 2, 40, 64), dtype=torch.float32)
        mask = torch.ones((2, 1, 48, 40), dtype=torch.bool, device="cuda")
        block = Block(slice(0, 48), slice(0, 40), mask)
        assert fused.kernel_for(q, k, block) == "efficient"
        assert seen == [((2, 8, 40, 64), (2, 8, 48, 40), torch.float32)]
        half_q, half_k = _fake_cuda((2, 8, 48, 64), (2, 2, 40, 64))  # bf16: the plain kernel (HALF_EFFICIENT_BROKEN)
        assert fused.kernel_for(half_q, half_k, Block(slice(0, 48), slice(0, 40), mask)) == "plain"
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]):
            assert fused.kernel_for(q, k, block) == "plain"
        q64, k64 = _fake_cuda((2, 8, 48, 64), (2, 2, 40, 64), dtype=torch.float64)
        refused = Block(slice(0, 48), slice(0, 40), mask)
        assert fused.kernel_for(q64, k64, refused) == "plain"
        assert not refused._cache  # asking built no bias


@pytest.mark.parametrize("takes, dtype, words", [
    (True, torch.float32, "document-masked and windowed blocks on _scaled_dot_product_efficient_attention, the mask "
                          "as its attn_bias"),
    (False, torch.float32, "document-masked and windowed blocks on the plain kernel (kernels.py) (efficient "
                           "attention is off or cannot take these inputs)"),
    (True, torch.bfloat16, "document-masked and windowed blocks on the plain kernel (kernels.py) (efficient "
                           "attention's bf16/fp16 backward gave non-finite gradients on an H200)")])
def test_describe_names_the_cuda_ops(monkeypatch, takes, dtype, words):
    """What `bench cp` prints on a GPU, with torch's answers stood in for (cuDNN for full and
    causal blocks; efficient attention taking the masked ones, or not)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ndtrain.parallel.context import fused
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *a, **kw: 3)  # SDPBackend.CUDNN_ATTENTION
    monkeypatch.setattr(torch.backends.cuda, "can_use_efficient_attention", lambda params, debug=False: takes)
    with FakeTensorMode():
        text = fused.describe(torch.device("cuda"), dtype, 32, 8, 64, 1024)
    assert text == "full and causal blocks on _scaled_dot_product_cudnn_attention; " + words, text


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("forced", [False, True])
def test_cuda_masked_blocks_merge_to_full_attention(dtype, forced):
    """On a GPU, blocks with documents and a sliding window, as a ring gives them: the
    second half of a sequence's queries against the first half's keys (rows whose document
    starts in the second half, or whose window ends there, see none of them) and against
    their own, both with masks, merged by lse, then each block's backward; against masked
    attention over the whole sequence in fp32 on the same (rounded) inputs. Grouped heads
    (8 query heads, 2 KV). `forced`: efficient attention is the only SDPA backend allowed.
    Tolerances as in test_cuda_fused_blocks_merge_to_full_attention: bf16 2e-2 of the
    largest element (8-bit rounding of each block's output and gradients), fp32 1e-3."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ndtrain.parallel.context import fused
    from ndtrain.parallel.context.visibility import Block
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, kv, n, d, window = 2, 8, 2, 256, 64, 200
    q = torch.randn(b, h, n, d, generator=g, device="cuda").to(dtype)
    k, v = (torch.randn(b, kv, 2 * n, d, generator=g, device="cuda").to(dtype) for _ in range(2))
    dout = torch.randn(b, h, n, d, generator=g, device="cuda").to(dtype)
    pos = torch.arange(2 * n, device="cuda")
    docs = torch.stack([pos // 100, (pos >= n + 7).long()])  # row 1: a document starts at query 7
    visible = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < window)
    visible = (visible & (docs[:, :, None] == docs[:, None, :]))[:, None, n:]  # [b, 1, n, 2n]
    blocks = [Block(slice(0, n), slice(0, n), visible[..., :n].contiguous()),
              Block(slice(0, n), slice(n, 2 * n), visible[..., n:].contiguous())]
    assert not blocks[0].seen().all()  # some rows see nothing of the first block
    scale = d ** -0.5
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]) if forced else nullcontext():
        expected = "plain" if dtype in fused.HALF_EFFICIENT_BROKEN else "efficient"
        assert {fused.kernel_for(q, k[:, :, :n], blk) for blk in blocks} == {expected}
        mine = _merged_blocks(q, k, v, dout, blocks, scale)
    _assert_near_full_attention(mine, q, k, v, dout, visible, scale, 2e-2 if dtype == torch.bfloat16 else 1e-3,
                                f"efficient {dtype}")


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("overrides, fragment", [
    (["parallel.cp=2", "train.seq_len=30"], "train.seq_len = 30: must be divisible by 2 × parallel.cp = 4"),
    (["parallel.cp=3", "train.seq_len=32"], "train.seq_len = 32: must be divisible by 2 × parallel.cp = 6"),
    (["parallel.cp=2", "parallel.tp=4", "train.seq_len=36"], "must be divisible by cp × tp = 2 × 4"),
    (["parallel.cp=3", "parallel.cp_impl=ulysses", "train.seq_len=48"],
     "parallel.cp = 3: cp_impl = ulysses splits the query heads per tp rank, n_heads / tp = 4 / 1 = 4"),
    (["parallel.cp=2", "parallel.tp=4", "parallel.sp=false", "parallel.cp_impl=ulysses"],
     "n_heads / tp = 4 / 4 = 1, over cp"),
    (["parallel.cp=4", "parallel.cp_impl=ulysses", "model.n_heads=8", "model.n_kv_heads=8", "model.dim=64"],
     None),  # 8 KV heads over 4 ranks: split, valid
    (["parallel.cp=4", "parallel.cp_impl=ulysses", "model.n_heads=8", "model.n_kv_heads=2", "model.dim=64"],
     None),  # 2 KV heads over 4 ranks: repeated, valid
    (["parallel.cp=4", "parallel.cp_impl=ulysses", "model.n_heads=12", "model.n_kv_heads=6", "model.dim=96"],
     "needs the KV heads per tp rank (6, of n_kv_heads = 6) to divide cp or be divisible by it"),
    (["parallel.cp_impl=zigzag"], "parallel.cp_impl = 'zigzag': choose one of ring, allgather, ulysses"),
])
def test_bad_context_parallel_configs(overrides, fragment):
    from ndtrain.config import ConfigError, load_config, validate
    cfg = load_config(None, ["model.preset=tiny", "run.device=cpu", *overrides])
    world = cfg.parallel.cp * cfg.parallel.tp
    if fragment is None:
        validate(cfg, world=world)
        return
    with pytest.raises(ConfigError) as e:
        validate(cfg, world=world)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_cp_refuses_a_model_whose_attention_takes_no_positions():
    from torch import nn

    from ndtrain.config import ConfigError
    from ndtrain.mesh import Group
    from ndtrain.parallel.context import apply

    class LearnedPositions(nn.Module):  # attention without an AttentionCore: no rotary positions
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({"0": nn.Module()})
            self.layers["0"].attention = nn.MultiheadAttention(8, 2)

    group = Group("cp", [0, 1], 0, None)
    with pytest.raises(ConfigError, match="parallel.cp = 2: layer 0 of LearnedPositions has no AttentionCore"):
        apply(LearnedPositions(), group, "ring")


def test_cli_refuses_seq_len_not_divisible(tmp_path, capsys):
    from ndtrain.cli import main
    assert main(["train", "--nproc", "2", "parallel.cp=2", "train.seq_len=30", f"run.dir={tmp_path / 'run'}"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.strip() == ("ndtrain: error: train.seq_len = 30: must be divisible by 2 × "
                                                 "parallel.cp = 4: context parallelism cuts each sequence into "
                                                 "2·cp equal chunks")
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- end to end

def packed_documents(trainer) -> None:
    """Turn every row into packed documents, as SFT does, decided by the tokens alone (so
    every layout packs alike): a document starts after each token ≡ 0 mod 5, positions
    restart there, targets of each document's first 3 tokens and of the first 12 tokens of
    every row are IGNORE (so the zigzag chunks of a row hold unequal numbers of targets: at
    cp = 2 rank 0 holds 8 of its 16, rank 1 12), and tokens carry weights 1 + (id mod 3)/2."""
    from dataclasses import replace

    from ndtrain.model.loss import IGNORE
    plain = trainer.task.rows

    def rows(split, step, start, stop):
        mb = plain(split, step, start, stop)
        b, s = mb.tokens.shape
        index = torch.arange(s).expand(b, s)
        start = torch.zeros(b, s, dtype=torch.bool)
        start[:, 1:] = mb.tokens[:, :-1] % 5 == 0
        start[:, 0] = True
        doc_ids = start.long().cumsum(1)
        first = (index * start).cummax(1).values
        positions = index - first
        targets = mb.targets.masked_fill((positions < 3) | (index < 12), IGNORE)
        return replace(mb, targets=targets, positions=positions, doc_ids=doc_ids,
                       weights=1.0 + (mb.tokens % 3).double() / 2)
    trainer.task.rows = rows


def _pipeline(schedule: str, m: int, *extra: str) -> list[str]:
    return ["parallel.pp=2", f"parallel.pp_schedule={schedule}", f"train.micro_batch={8 // m}", *extra]


# name → (overrides, reference). References are single-process runs of the same data, in
# fp64: "plain"; "packed" (packed_documents); "dropout" (model.dropout=0.1); and "fp32",
# "bf16" in those dtypes.
E2E: dict[int, list[tuple[str, list[str], str]]] = {
    2: [
        *((f"cp2-{impl}", ["parallel.cp=2", f"parallel.cp_impl={impl}"], "plain") for impl in IMPLS),
        *((f"cp2-{impl}-packed", ["parallel.cp=2", f"parallel.cp_impl={impl}"], "packed") for impl in IMPLS),
        ("cp2-zero3-over-cp", ["parallel.cp=2", "parallel.zero=3"], "plain"),
        ("cp2-recompute-selective", ["parallel.cp=2", "train.recompute=selective"], "plain"),  # reruns the ring
        ("cp2-bf16", ["parallel.cp=2"], "bf16"),
        ("cp2-ring-fp32", ["parallel.cp=2"], "fp32"),
    ],
    4: [
        *((f"cp4-{impl}", ["parallel.cp=4", f"parallel.cp_impl={impl}"], "plain") for impl in IMPLS),
        ("cp4-ring-packed", ["parallel.cp=4"], "packed"),
        ("cp2-tp2-sp-recompute-full", ["parallel.cp=2", "parallel.tp=2", "train.recompute=full"], "plain"),
        ("cp2-tp2-sp-ulysses-dropout", ["parallel.cp=2", "parallel.tp=2", "parallel.cp_impl=ulysses",
                                        "model.dropout=0.1"], "dropout"),
        ("cp2-tp2-allgather", ["parallel.cp=2", "parallel.tp=2", "parallel.sp=false", "parallel.cp_impl=allgather"],
         "plain"),
        ("cp2-tp2-sp-fp32", ["parallel.cp=2", "parallel.tp=2"], "fp32"),
        ("cp2-dp2-zero3", ["parallel.cp=2", "parallel.dp=2", "parallel.zero=3"], "plain"),
        ("cp2-hsdp2-zero2", ["parallel.cp=2", "parallel.dp=2", "parallel.dp_replicate=2", "parallel.zero=2"], "plain"),
        ("cp2-dp2-zero1-accumulation-packed", ["parallel.cp=2", "parallel.dp=2", "parallel.zero=1",
                                               "train.micro_batch=2"], "packed"),
        ("cp2-pp2-1f1b", _pipeline("1f1b", 4, "parallel.cp=2"), "plain"),
        ("cp2-pp2-interleaved", _pipeline("interleaved", 4, "parallel.cp=2", "parallel.pp_virtual=2"), "plain"),
        ("cp2-pp2-zb-allgather-packed", _pipeline("zb", 4, "parallel.cp=2", "parallel.cp_impl=allgather"), "packed"),
        ("cp2-pp2-afab-ulysses", _pipeline("afab", 2, "parallel.cp=2", "parallel.cp_impl=ulysses"), "plain"),
    ],
    8: [
        ("pp2-dp2-cp2", _pipeline("1f1b", 2, "parallel.cp=2", "parallel.dp=2"), "plain"),
        ("pp2-cp2-tp2", _pipeline("1f1b", 4, "parallel.cp=2", "parallel.tp=2"), "plain"),
    ],
}
# The default tier: every back end at cp 2 (plain and packed), ring at cp 4, and one row of
# each composition kind at 4 ranks; the other rows run with `python -m pytest -m slow`.
DEFAULT_TIER = {
    2: {name for name, _, _ in E2E[2]},
    4: {"cp4-ring", "cp2-tp2-sp-ulysses-dropout", "cp2-dp2-zero3", "cp2-pp2-1f1b"},
    8: set(),
}
REFERENCES = {"plain": FP64, "packed": FP64, "dropout": FP64 + ["model.dropout=0.1"], "fp32": [],
              "bf16": ["train.precision=bf16"]}
STEPS = ["train.steps=3"]
# Under NCCL's semantics (tests/nccl_like.py), equal to the same row on gloo bit for bit: the
# ring's message groups and the all-gather back end by default, every row with -m slow.
NCCL_DEFAULT = {2: {"cp2-ring", "cp2-allgather"}, 4: set()}


def _train(overrides: list[str], reference: str, data_dir: str, meter: bool = False, twin: bool = False,
           nccl: bool = False):
    """A run of `reference`'s dtype (and documents); fp64 runs are layout proofs
    (tests/helpers.py): first-step gradients, norms, losses and final weights. `meter`: also
    the activation peak (the CPU meter slows the steps it watches); `twin`: the perturbed
    reference of the tolerance rule; `nccl`: under NCCL's semantics."""
    from helpers import capture_first_grads, perturb_gradients, train_in_rank

    def before_fit(trainer):
        if reference == "packed":
            packed_documents(trainer)
        if twin:
            perturb_gradients(trainer)
        if REFERENCES[reference] and REFERENCES[reference][0] == FP64[0]:
            capture_first_grads(trainer)
    losses, state, trainer = train_in_rank(STEPS + REFERENCES[reference] + overrides, data_dir, before_fit=before_fit,
                                           meter=meter, nccl=nccl)
    return {"losses": losses, "state": state, "norms": [r["grad_norm"] for r in trainer.history],
            "grads": getattr(trainer, "first_grads", None), "targets": [r["targets"] for r in trainer.history],
            "activations": max(trainer.history[-1]["memory"]["activations"])}  # memory: on log steps (the last)


def _references(data_dir):
    from helpers import proof_tolerances
    out = {name: _train([], name, data_dir, meter=name == "plain") for name in REFERENCES}
    for name, overrides in REFERENCES.items():
        if overrides and overrides[0] == FP64[0]:
            out[name]["tol"] = proof_tolerances(out[name], _train([], name, data_dir, twin=True))
    return out


def _metered(name: str) -> bool:
    """The rows whose activation peak the memory check reads (one per back end and world)."""
    return any(name == f"cp{world}-{impl}" for world in (2, 4) for impl in IMPLS)


def _rows(data_dir, rows, nccl_names):
    """Every row, then those of `nccl_names` again under NCCL's semantics (under "nccl")."""
    out = {name: _train(overrides, ref, data_dir, meter=_metered(name)) for name, overrides, ref in rows}
    out["nccl"] = {name: _train(overrides, ref, data_dir, nccl=True) for name, overrides, ref in rows
                   if name in nccl_names}
    return out


@pytest.fixture(scope="module")
def references(tiny_data):
    return run_ranks(_references, 1, tiny_data)[0]


@pytest.mark.parametrize("world", [2, 4])
def test_training_equals_one_process(world, tiny_data, references):
    _check_e2e(world, [row for row in E2E[world] if row[0] in DEFAULT_TIER[world]], tiny_data, references,
               NCCL_DEFAULT[world])


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(E2E))
def test_training_equals_one_process_every_row(world, tiny_data, references):
    rows = [row for row in E2E[world] if row[0] not in DEFAULT_TIER[world]]
    _check_e2e(world, rows, tiny_data, references, {row[0] for row in rows})


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_default_rows_under_nccl_semantics(world, tiny_data, references):
    """The default tier's rows that it does not run under NCCL's semantics itself."""
    rows = [row for row in E2E[world] if row[0] in DEFAULT_TIER[world] and row[0] not in NCCL_DEFAULT[world]]
    _check_e2e(world, rows, tiny_data, references, {row[0] for row in rows})


def _check_e2e(world, rows, tiny_data, references, nccl_names):
    """fp64 layout proofs (tests/helpers.py's tolerance rule: the first update at exact
    precision, later steps and the final weights within the twin's gaps); two rows
    again in fp32 at 1e-5 (losses, weights' norms); bf16
    against bf16 on one process at the precision suite's bf16 tolerance, 2e-3 of the loss.
    The logged target counts equal one process's, packed documents included."""
    from helpers import assert_losses_close, assert_proof, assert_same_proof, assert_states_close
    results = run_ranks(_rows, world, tiny_data, rows, nccl_names, timeout=600)
    nccl = results[0].pop("nccl")
    assert nccl.keys() == set(nccl_names), f"not rows of this tier: {sorted(set(nccl_names) - nccl.keys())}"
    for name in nccl:
        assert_same_proof(nccl[name], results[0][name], name)
    worst = {"grads": 0.0, "state": 0.0, "loss": 0.0, "norm": 0.0}
    for name, _, ref_name in rows:
        run, ref = results[0][name], references[ref_name]
        try:
            assert run["targets"] == ref["targets"]
            if ref_name == "bf16":
                assert_losses_close(run["losses"], ref["losses"], 2e-3)
                assert run["losses"] != references["fp32"]["losses"]
            elif ref_name == "fp32":
                assert_losses_close(run["losses"], ref["losses"], 1e-5)
                assert_states_close(run["state"], ref["state"], 1e-5)
            else:
                for k, v in assert_proof(run, ref).items():
                    worst[k] = max(worst[k], v)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
        for rank, other in enumerate(results[1:], 1):
            assert other[name]["losses"] == run["losses"], f"{name}: rank {rank} reports other losses"
    print(f"world {world} fp64: gradients within {worst['grads']:.1e}, weights {worst['state']:.1e}, "
          f"losses {worst['loss']:.1e}, norms {worst['norm']:.1e}")
    assert references["packed"]["targets"][0] < references["plain"]["targets"][0]
    # the memory report: activations per rank shrink with cp (same rows per rank here)
    for name in (f"cp{world}-{impl}" for impl in IMPLS):
        if name in results[0]:
            ratio = results[0][name]["activations"] / references["plain"]["activations"]
            print(f"{name}: activations per rank {ratio:.2f} of one process's")
            assert ratio < 1.2 / world, f"{name}: activations {ratio:.2f} of one process's"


# --------------------------------------------------------------------------- bytes per layer

COMM_CASES = [  # on 4 ranks: (overrides, the collectives expected on the cp group)
    *((["parallel.cp=4", f"parallel.cp_impl={impl}"], impl) for impl in IMPLS),
    *((["parallel.cp=2", "parallel.tp=2", f"parallel.cp_impl={impl}", "train.precision=bf16"], impl) for impl in IMPLS),
]
KINDS = {"ring": {"send", "recv"}, "allgather": {"all_gather", "reduce_scatter"}, "ulysses": {"all_to_all"}}


def _comm_on_ranks(cases):
    from ndtrain.config import load_config, validate
    from ndtrain.data.batch import MicroBatch
    from ndtrain.mesh import ParallelMesh
    from ndtrain.parallel import context
    from ndtrain.parallel.parallelize import build
    from ndtrain.parallel.precision import compute_dtype
    from ndtrain.train.worker import mesh_shape

    out = []
    for overrides, _ in cases:
        cfg = validate(load_config(None, ["model.preset=tiny", "model.vocab_size=512", "run.device=cpu",
                                          "train.seq_len=48", "train.global_batch=4", *overrides]), world=4)
        mesh = ParallelMesh.build(mesh_shape(cfg))
        args = cfg.model_args()
        par = build(args, mesh, cfg)
        rows = cfg.train.global_batch // mesh.dp_size
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, args.vocab_size, (rows, cfg.train.seq_len + 1), generator=g)
        mb = context.shard(MicroBatch(tokens[:, :-1], tokens[:, 1:]), mesh.shape.cp, mesh.coord("cp"))
        mesh.stats.reset()
        par.forward_backward([mb], float(rows * cfg.train.seq_len))
        tp = mesh.shape.tp
        heads, kv = args.n_heads // tp, max(1, args.n_kv_heads // tp)
        value = torch.finfo(compute_dtype(cfg.train.precision)).bits // 8
        expected = args.n_layers * context.wire_bytes(cfg.parallel.cp_impl, rows * cfg.train.seq_len, heads, kv,
                                                      args.head_dim, mesh.shape.cp, value, 4)
        kinds = {k for (d, k) in mesh.stats.tallies if d == "cp"}
        out.append((mesh.stats.wire("cp"), expected, kinds))
    return out


def test_bytes_per_layer_match_the_formulas():
    """What each back end sends over the cp group in one forward and backward (no document
    ids: they add one all-gather of b·S ids per micro-batch) equals n_layers × `wire_bytes`:
    cp 4, and cp 2 × tp 2 in bf16 (K/V in bf16, gradient accumulators in fp32;
    heads per tp rank: 2 query, 1 KV head, repeated for Ulysses)."""
    results = run_ranks(_comm_on_ranks, 4, COMM_CASES)
    for rank, per_case in enumerate(results):
        for (overrides, impl), (wire, expected, kinds) in zip(COMM_CASES, per_case):
            assert kinds == KINDS[impl], (overrides, kinds)
            assert wire == pytest.approx(expected, rel=1e-12), f"rank {rank} {overrides}: {wire} vs {expected}"


# --------------------------------------------------------------------------- the trace

def _ring_trace(data_dir, out, overrides):
    import torch.distributed as dist

    from helpers import TINY
    from ndtrain.config import load_config, validate
    from ndtrain.data.prepare import PreparedData
    from ndtrain.mesh import ParallelMesh
    from ndtrain.train.trace import trace_run
    from ndtrain.train.worker import mesh_shape
    cfg = validate(load_config(None, TINY + ["train.steps=2", "train.micro_batch=4", *overrides]),
                   world=dist.get_world_size())
    return trace_run(cfg, ParallelMesh.build(mesh_shape(cfg)), PreparedData.open(data_dir), out)


@pytest.mark.parametrize("world, overrides, layers", [(2, ["parallel.cp=2"], 4),
                                                       pytest.param(4, ["parallel.cp=2", "parallel.pp=2"], 2,
                                                                    marks=pytest.mark.slow)],
                         ids=["cp2", "pp2-cp2"])
def test_trace_shows_every_ring_step_and_message(world, overrides, layers, tiny_data, tmp_path):
    """Two micro-batches; with a pipeline, its schedule is drawn too and a rank holds half
    the layers."""
    import json
    report = run_ranks(_ring_trace, world, tiny_data, tmp_path, overrides)[0]
    ring, cp, m = report["ring"], 2, 2
    assert ring["layers"] == layers
    # per rank and micro-batch: forward cp−1 K/V exchanges per layer; backward as many plus cp dK/dV hops
    assert ring["messages"] == m * layers * (2 * (cp - 1) + cp)
    assert 0.0 <= ring["hidden"] <= 1.0 and ring["in_flight"] >= ring["waited"] >= 0
    events = json.loads((tmp_path / "ring-trace.json").read_text())["traceEvents"]
    for rank in range(world):
        mine = [e for e in events if e.get("tid") == rank and e.get("ph") == "X"]
        held = sorted({e["args"]["chunk"] for e in mine})
        assert len(held) == layers
        steps = sorted((e["cat"], e["args"]["chunk"], e["args"]["micro"]) for e in mine if e["cat"].startswith("attn"))
        assert steps == sorted((kind, layer, step) for kind in ("attn B", "attn F") for layer in held
                               for step in range(cp) for _ in range(m))
        assert sum(e["cat"] == "dkv" for e in mine) == m * layers * cp
    assert (tmp_path / "ring.png").stat().st_size > 10_000
    assert ("measured_bubble" in report) == ("parallel.pp=2" in overrides)


# --------------------------------------------------------------------------- resume

def _straight_vs_resumed(data_dir, root):
    import torch.distributed as dist

    from helpers import train_in_rank
    steps = ["train.steps=4", "parallel.cp=2", "parallel.zero=3", "model.dropout=0.1"]
    straight, s_state, _ = train_in_rank(steps, data_dir, run_dir=f"{root}/straight")
    first, _, _ = train_in_rank(steps, data_dir, stop_after=2, run_dir=f"{root}/resumed")
    dist.barrier()
    second, r_state, _ = train_in_rank(steps, data_dir, run_dir=f"{root}/resumed", resume=True)
    return straight, first + second, s_state, r_state


def test_resume_under_cp_is_bit_exact(tiny_data, tmp_path):
    """ZeRO-3 sharded over the cp ranks, dropout drawn for the whole sequence: 4 steps
    straight equal 2, a resume and 2 more, bit for bit."""
    straight, resumed, s_state, r_state = run_ranks(_straight_vs_resumed, 2, tiny_data, str(tmp_path))[0]
    assert straight == resumed
    assert all(torch.equal(s_state[k], r_state[k]) for k in s_state)


# --------------------------------------------------------------------------- bench cp

def test_bench_cp_refuses_what_it_cannot_apply(capsys):
    from ndtrain.cli import main
    assert main(["bench", "cp", "parallel.cp_impl=ulysses", "run.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "parallel.cp_impl = 'ulysses': bench cp cannot apply it to both contenders" in err and err.count("\n") == 1


def _bench_cp(cfg_dict):
    from ndtrain.bench import cp
    return cp.render(cp._worker(cfg_dict, 1, 1))


@pytest.mark.slow
def test_bench_cp_runs_every_contender():
    from types import SimpleNamespace

    from ndtrain.bench import cp
    from ndtrain.bench.common import bench_config
    args = SimpleNamespace(config=None, nproc=2, overrides=["model.preset=tiny", "train.seq_len=64", "run.device=cpu",
                                                            "run.threads=1", "train.micro_batch=1"])
    out = run_ranks(_bench_cp, 2, bench_config(args, cp.bench(2)).to_dict())[0]
    for seq_len in (32, 64):
        assert f"seq_len {seq_len} " in out
    assert all(out.count(f"  {name} ") == 2 for name in ("ring", "allgather", "ulysses", "1 process"))
    assert ("\nring and allgather attention: full and causal blocks on _scaled_dot_product_flash_attention_for_cpu; "
            "document-masked and windowed blocks on the same op, the mask as its attn_mask\n") in out
    assert re.search(r"\nndtrain cp throughput vs 1 process at seq_len 64: ring \d+\.\d\d, allgather \d+\.\d\d, "
                     r"ulysses \d+\.\d\d$", out), out
