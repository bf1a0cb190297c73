"""The NCCL-like process group (tests/nccl_like.py) differs from gloo where NCCL does, so the
layout proofs run under it (test_layouts, test_cp, test_expert) test NCCL's semantics and
not gloo's twice. Each test here shows one difference biting, on two ranks."""

import pytest

from ndtrain.testing import run_ranks


def _batch_semantics():
    """A batch of one send and one receive to the other rank, under gloo and under the
    NCCL-like group: the handles torch returns, what indexing them per message (the old
    `send_recv` → `StageLinks.post` slicing) finds, and what the fixed `StageLinks.post`
    receives."""
    import torch
    import torch.distributed as dist

    from nccl_like import nccl_like
    from ndtrain.comm import ops
    from ndtrain.mesh import MeshShape, ParallelMesh
    from ndtrain.parallel.pipeline.p2p import StageLinks

    mesh = ParallelMesh.build(MeshShape(pp=2))
    group = mesh.group("pp")
    rank, peer = group.rank, 1 - group.rank
    mine = torch.full((3,), float(rank))

    def exchange():
        buf = torch.empty(3)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, group.ranks[peer], group.pg),
                                        dist.P2POp(dist.irecv, buf, group.ranks[peer], group.pg)])
        receive_handles = works[1:]  # what the old slicing kept for the receive
        for w in works:
            w.wait()
        return len(works), len(receive_handles), buf

    def fixed_post():
        links = StageLinks(group, mesh.device)
        links.shapes[0] = (torch.Size([3]), torch.float32)
        (work, buf), = links.post([(mine, peer)], [(0, peer)])
        work.wait()
        links.wait_sends()
        return buf

    out = {"gloo": exchange(), "gloo post": fixed_post()}
    with nccl_like():
        out["nccl"] = exchange()
        out["nccl post"] = fixed_post()
        out["executor lists"] = "async" if ops.independent_messages(group) else "as verified"
    return out


def _mismatched_receive():
    """Rank 0 sends a [2, 3] then a [4] tensor; rank 1 receives a [3, 2] then a [4]: the
    same bytes, another shape. Returns what each receive got, or the error raised."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        msgs = [dist.P2POp(dist.isend, t, 1) for t in (torch.arange(6.0).view(2, 3), torch.ones(4))]
    else:
        msgs = [dist.P2POp(dist.irecv, torch.empty(s), 0) for s in ((3, 2), (4,))]
    works = dist.batch_isend_irecv(msgs)
    try:
        for w in works:
            w.wait()
    except RuntimeError as e:
        works[0].wait()  # the rest of the batch: the same number of bytes, so it completes
        return str(e)
    return [m.tensor for m in msgs]


def _refused() -> dict:
    """What gloo computes and the NCCL-like group refuses, as NCCL does: each call's error."""
    import torch
    import torch.distributed as dist

    from nccl_like import nccl_like

    calls = {"bitwise and": lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.BAND),
             "non-contiguous all-reduce": lambda: dist.all_reduce(torch.ones(3, 2).t())}
    out = {}
    for name, call in calls.items():
        call()  # gloo
        with nccl_like():
            try:
                call()
                out[name] = "accepted"
            except ValueError as e:
                out[name] = str(e)
    return out


def _differences() -> dict:
    """Every check of this module that completes, in one launch of two ranks."""
    from nccl_like import nccl_like
    out = {"batch": _batch_semantics(), "gloo mismatch": _mismatched_receive(), "refused": _refused()}
    with nccl_like():
        out["nccl mismatch"] = _mismatched_receive()
    return out


@pytest.fixture(scope="module")
def differences():
    return run_ranks(_differences, 2, timeout=120)


def test_a_batch_has_one_handle_and_post_still_finds_its_receive(differences):
    """gloo: a handle per message. NCCL-like: one handle for the batch, so slicing the list
    per message finds no receive (the KeyError('recv_B', ...) every pipeline died of on
    NCCL); `ops.send_recv` now gives every message the batch's handle, and `StageLinks.post`
    returns a receive that holds the peer's values in both. The executor runs its NCCL lists."""
    for rank, out in enumerate(d["batch"] for d in differences):
        peer = float(1 - rank)
        assert out["gloo"][:2] == (2, 1)
        assert out["nccl"][:2] == (1, 0), "the NCCL-like batch must return one handle"
        for key in ("gloo", "nccl"):
            assert out[key][2].eq(peer).all()
        assert out["gloo post"].eq(peer).all() and out["nccl post"].eq(peer).all()
        assert out["executor lists"] == "as verified"


def test_a_receive_of_another_shape_fails_by_name(differences):
    """gloo (like NCCL) delivers the bytes of a [2, 3] message into a [3, 2] receive
    silently; the NCCL-like group, which checks every message against its header, raises."""
    got = differences[1]["gloo mismatch"]
    assert got[0].flatten().tolist() == list(range(6)) and got[0].shape == (3, 2)
    assert differences[1]["nccl mismatch"] == ("rank 1 expected message 0 (torch.float32 (3, 2)) from group rank 0, "
                                               "which sent message 0 (torch.float32 (2, 3))")


def test_what_nccl_refuses_is_refused(differences):
    for out in (d["refused"] for d in differences):
        assert "Cannot use" in out["bitwise and"] and "BAND" in out["bitwise and"]
        assert "must be contiguous" in out["non-contiguous all-reduce"]


def _crossed_batches(marker: str):
    """Each rank posts a receive from the other, then (a second batch) a send to it. gloo's
    messages are independent, so it completes; on NCCL's stream each rank's send waits for
    its receive, which waits for the other's send: a deadlock."""
    import pathlib

    import torch
    import torch.distributed as dist

    from nccl_like import nccl_like

    peer = 1 - dist.get_rank()

    def cross():
        x, y = torch.empty(2), torch.ones(2)
        first = dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, peer)])
        second = dist.batch_isend_irecv([dist.P2POp(dist.isend, y, peer)])
        for w in first + second:
            w.wait()

    cross()
    pathlib.Path(marker, f"gloo-{dist.get_rank()}").touch()
    with nccl_like():
        cross()


@pytest.mark.slow
def test_batches_run_in_order_on_the_stream(tmp_path):
    """What completes on gloo hangs under the NCCL-like group (until the harness's timeout),
    after both ranks got through the gloo half (their markers)."""
    with pytest.raises(TimeoutError):
        run_ranks(_crossed_batches, 2, str(tmp_path), timeout=15)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gloo-0", "gloo-1"]
