"""Pipeline parallelism: schedules as data, equality with one process (the layout matrix has
more rows), agreement with torch.distributed.pipelining, activation memory, tied embeddings,
checkpoints, the trace, and bad input."""

import inspect

import pytest
import torch

from helpers import TINY, assert_losses_close, assert_states_close, train_in_rank
from ndtrain.parallel.pipeline.partition import balanced_counts, chunk_counts, layer_costs
from ndtrain.parallel.pipeline.schedules import SCHEDULES, build_schedule, theory_bubble
from ndtrain.parallel.pipeline.verify import ScheduleError, bubble, simulate, verify
from ndtrain.testing import run_ranks


# --------------------------------------------------------------------------- schedules as data

def _shapes():
    for name in SCHEDULES:
        for pp in (2, 3, 4, 8):
            for v in ((1, 2, 3) if name == "interleaved" else (1,)):
                for m in range(1, 3 * pp + 1):
                    if name != "interleaved" or m % pp == 0:
                        yield name, pp, v, m


def test_every_schedule_is_complete_ordered_and_deadlock_free():
    """Each (chunk, micro-batch) computed once per kind on its owner, both ends of every link
    agree on the order, and no rank can wait forever even if every message is a rendezvous."""
    count = 0
    for name, pp, v, m in _shapes():
        for train in (True, False):
            verify(build_schedule(name, pp, v, m, train=train), pp, v, m, train=train)
            count += 1
    assert count > 300


def test_verifier_catches_a_deadlock_and_a_misordered_link():
    """Negative controls for the checks above."""
    good = build_schedule("1f1b", 2, 1, 4)
    swapped = [list(good[0]), list(good[1])]
    first = next(k for k, a in enumerate(swapped[1]) if a.kind == "recv_F")
    second = next(k for k, a in enumerate(swapped[1]) if a.kind == "recv_F" and k > first)
    swapped[1][first], swapped[1][second] = swapped[1][second], swapped[1][first]
    with pytest.raises(ScheduleError, match="link 0→1"):
        verify(swapped, 2, 1, 4)
    # rank 1 sends its first gradient before receiving anything: a cycle under rendezvous
    stuck = [list(good[0]), [a for a in good[1] if a.kind != "recv_F"]]
    stuck[1].insert(0, next(a for a in good[1] if a.kind == "recv_F"))
    backwards = [a for a in stuck[1] if a.kind in ("B", "send_B")]
    stuck[1] = [a for a in stuck[1] if a.kind not in ("B", "send_B")]
    stuck[1][1:1] = backwards[:2]
    with pytest.raises(ScheduleError):
        verify(stuck, 2, 1, 4)


@pytest.mark.parametrize("name, v", [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)])
def test_simulated_bubble_equals_theory(name, v):
    """With unit costs (F = 1, whole backward = 2; zb: F = B = W = 1) and free messages the
    lists give exactly the textbook bubble; zero bubble is a third of 1F1B's."""
    for pp in (2, 4):
        for m in (pp, 2 * pp, 4 * pp):
            cost = {"F": 1, "B": 1, "W": 1} if name == "zb" else {"F": 1, "B": 2}
            got = bubble(simulate(build_schedule(name, pp, v, m), pp, cost))
            assert got == pytest.approx(theory_bubble(name, pp, v, m), abs=1e-12), (pp, m)
            if name == "zb":
                assert got == pytest.approx(theory_bubble("1f1b", pp, 1, m) / 3)


def test_partition_counts_the_head_and_can_be_overridden():
    from ndtrain.model.args import PRESETS
    a = PRESETS["tiny"].with_(n_layers=8, vocab_size=2048)  # a head worth ~3.4 blocks
    embedding, blocks, head = layer_costs(a, 32)
    assert head > 3 * blocks[0] and embedding < blocks[0] / 100
    counts = chunk_counts(a, 2, 32)
    assert counts == [6, 2]  # the last stage carries the head, so fewer blocks
    assert chunk_counts(a.with_(vocab_size=64), 2, 32) == [4, 4]
    assert balanced_counts([1.0] * 8, 4, 0.0, 0.0) == [2, 2, 2, 2]
    assert chunk_counts(a, 4, 32, "1,2,3,2") == [1, 2, 3, 2]
    with pytest.raises(ValueError, match="covers 7 layers"):
        chunk_counts(a, 4, 32, "1,2,2,2")


# --------------------------------------------------------------------------- torch.distributed.pipelining

def _grads_vs_torch_pipelining(data_dir):
    return {(s, v): _one_schedule_vs_torch(data_dir, s, v) for s, v in (("1f1b", 1), ("interleaved", 2))}


def _one_schedule_vs_torch(data_dir, schedule, virtual):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    from ndtrain.config import load_config, validate
    from ndtrain.data.loader import BatchLoader
    from ndtrain.data.prepare import PreparedData
    from ndtrain.mesh import ParallelMesh
    from ndtrain.parallel.parallelize import build
    from ndtrain.parallel.pipeline.stage import build_chunks
    from ndtrain.train.loss import token_loss_sum
    from ndtrain.train.worker import mesh_shape

    m = 4
    cfg = validate(load_config(None, TINY + ["parallel.pp=2", f"parallel.pp_schedule={schedule}",
                                             f"parallel.pp_virtual={virtual}", "train.micro_batch=2"]),
                   world=dist.get_world_size())
    data = PreparedData.open(data_dir)
    args = cfg.model_args(vocab_size=data.vocab_size)
    mesh = ParallelMesh.build(mesh_shape(cfg))
    x, y = BatchLoader(data.stream("train"), 32, 8, 0).rows(0, 0, 8)
    n = float((y != -100).sum())

    ours = build(args, mesh, cfg)
    ours.forward_backward(list(zip(x.split(2), y.split(2))), n)
    mine = {k: p.grad.clone() for k, p in ours.model.named_parameters()}

    chunks = build_chunks(args, mesh, cfg)  # fresh copies, same initial weights
    stages = [PipelineStage(chunk, c, 2 * virtual, torch.device("cpu")) for c, chunk in chunks.items()]
    kwargs = {"scale_grads": False} if "scale_grads" in inspect.signature(Schedule1F1B).parameters else {}
    loss_fn = lambda out, target: token_loss_sum(out, target) / n  # noqa: E731
    if schedule == "1f1b":
        ref = Schedule1F1B(stages[0], m, loss_fn=loss_fn, **kwargs)
    else:
        ref = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn, **kwargs)
    first, last = mesh.is_first_stage, mesh.is_last_stage
    ref.step(*((x,) if first else ()), **({"target": y} if last else {}))
    theirs = {k: p.grad for chunk in chunks.values() for k, p in chunk.named_parameters()}
    assert mine.keys() == theirs.keys()
    return max(((mine[k] - theirs[k]).norm() / theirs[k].norm()).item() for k in mine)


def test_gradients_match_torch_pipelining(tiny_data):
    """Same split, same weights, same micro-batches: Schedule1F1B (pp 2) and
    ScheduleInterleaved1F1B (pp 2 × v 2) give the gradients we give."""
    for rank in run_ranks(_grads_vs_torch_pipelining, 2, tiny_data):
        for (schedule, virtual), worst in rank.items():
            assert worst < 1e-6, (schedule, virtual, worst)
