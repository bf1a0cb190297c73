"""Context parallelism (issue 10): the layout, the attention kernels against full attention,
and end-to-end training equal to one process.

Kernel rows run every back end on cp ∈ {2, 3, 4} ranks in fp64 against full attention
computed on one device: output, log-sum-exp (ring, allgather; Ulysses runs plain attention
between its all-to-alls and has no merged lse) and dq, dk, dv of every rank's tokens within
1e-10 of the reference's largest element, causal and full, MHA and GQA, with and without
packed documents (including documents that leave whole ring blocks masked).
"""

from __future__ import annotations

import math

import pytest
import torch

from ndtrain.testing import run_ranks

KERNEL_TOL = 1e-10


# --------------------------------------------------------------------------- the layout

def test_zigzag_layout_covers_every_token_once_and_balances_causal_work():
    from ndtrain.parallel.context.layout import gathered_index, zigzag_index
    from ndtrain.parallel.context.visibility import Visibility

    assert zigzag_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    for cp in (1, 2, 3, 4):
        s = 2 * cp * 5
        assert sorted(gathered_index(s, cp).tolist()) == list(range(s))
        # visible (query, key) pairs computed per rank, summed over the ring's steps
        work = []
        for r in range(cp):
            vis = Visibility(s, cp, r)
            pairs = 0
            for src in range(cp):
                block = vis.ring_block(src)
                if block is not None:
                    n = (block.rows.stop - block.rows.start) * (block.cols.stop - block.cols.start)
                    pairs += n if block.mask is None else int(block.mask.sum())
                    if src != r:  # off-diagonal steps: 2c² pairs, no mask
                        assert block.mask is None and n == 2 * (s // (2 * cp)) ** 2
            work.append(pairs)
        assert work == [work[0]] * cp and sum(work) == s * (s + 1) // 2


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


def test_kernels_handle_fully_masked_rows_and_blocks():
    from ndtrain.parallel.context.kernels import attend, attend_backward, merge

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 2, 3, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 1, 5, 4, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False  # a row that sees nothing
    out, lse = attend(q, k, v, mask.view(1, 1, 1, 3, 5), 0.5)
    assert torch.isneginf(lse[..., 1]).all() and (out[..., 1, :] == 0).all()
    nothing = torch.zeros(1, 1, 1, 3, 5, dtype=torch.bool)  # a block that sees nothing
    b_out, b_lse = attend(q, k, v, nothing, 0.5)
    merged, merged_lse = merge(out, lse, b_out, b_lse)
    assert torch.equal(merged, out) and torch.equal(merged_lse, lse)
    dq, dk, dv = attend_backward(q, k, v, nothing, 0.5, lse, torch.zeros_like(lse), torch.ones_like(out))
    assert all(torch.isfinite(t).all() and (t == 0).all() for t in (dq, dk, dv))


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
    for impl in ("ring", "allgather", "ulysses"):
        for causal in (True, False):
            for heads, kv in ((12, 12), (12, gqa)):
                for docs in (False, True):
                    yield impl, causal, heads, kv, docs


def _kernels_on_ranks(cp: int) -> list[dict]:
    from ndtrain.mesh import MeshShape, ParallelMesh
    from ndtrain.parallel.context.allgather import AllGatherAttention, allgather_forward
    from ndtrain.parallel.context.kernels import from_heads
    from ndtrain.parallel.context.layout import zigzag_index
    from ndtrain.parallel.context.ring import RingAttention, ring_forward
    from ndtrain.parallel.context.ulysses import ulysses_attention
    from ndtrain.parallel.context.visibility import Visibility

    mesh = ParallelMesh.build(MeshShape(cp=cp))
    group = mesh.group("cp")
    results = []
    for impl, causal, heads, kv, with_docs in _kernel_cases(cp):
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
        out = fn(*mine, group, vis)
        (out * w[:, idx]).sum().backward()
        errors = {"out": _relative(out, ref_out.flatten(2)[:, idx])}
        if impl != "ulysses":
            forward = ring_forward if impl == "ring" else allgather_forward
            _, lse = forward(*[t.detach() for t in mine], group, vis)[:2]
            # lse [b, G, r, s] → [b, s, H]
            errors["lse"] = _relative(lse.permute(0, 3, 1, 2).reshape(b, -1, heads), ref_lse[:, idx])
            assert torch.equal(from_heads(forward(*[t.detach() for t in mine], group, vis)[0]).to(q.dtype), out.detach())
        for name, mine_t, ref_t in zip(("dq", "dk", "dv"), mine, ref):
            errors[name] = _relative(mine_t.grad, ref_t.grad[:, idx])
        results.append({"case": (impl, causal, heads, kv, with_docs), **errors})
    return results


def _relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return float((a.detach() - ref.detach()).abs().max() / ref.detach().abs().max())


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_attention_kernels_equal_full_attention_fp64(cp):
    per_rank = run_ranks(_kernels_on_ranks, cp, cp)
    worst = 0.0
    for rank, results in enumerate(per_rank):
        for r in results:
            for key, err in r.items():
                if key != "case":
                    assert err <= KERNEL_TOL, f"rank {rank} {r['case']}: {key} differs by {err:.1e}"
                    worst = max(worst, err)
    assert len(per_rank[0]) == 24
    print(f"cp={cp}: largest relative deviation {worst:.1e}")
