"""Data parallelism equals one process, agrees with torch DDP, and communicates as designed."""

import pytest
import torch

from helpers import assert_states_close, train_in_rank
from ndtrain.testing import run_ranks

@pytest.fixture(scope="module")
def reference(tiny_data):
    return run_ranks(_single, 1, tiny_data)[0]


def _single(data_dir):
    return train_in_rank([], data_dir)[:2]


def _grads_vs_ddp(data_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ndtrain.config import load_config, validate
    from ndtrain.data.batch import MicroBatch
    from ndtrain.data.loader import BatchLoader
    from ndtrain.data.prepare import PreparedData
    from ndtrain.mesh import MeshShape, ParallelMesh
    from ndtrain.parallel.parallelize import build, build_model
    from ndtrain.model.loss import token_loss_sum
    from helpers import TINY

    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = validate(load_config(None, TINY + ["parallel.bucket_mb=0.01"]), world=world)
    data = PreparedData.open(data_dir)
    args = cfg.model_args(vocab_size=data.vocab_size)
    mesh = ParallelMesh.build(MeshShape(dp_shard=world))
    loader = BatchLoader(data.stream("train"), 32, 8, 0)
    per = 8 // world
    x, y = loader.rows(0, rank * per, (rank + 1) * per)
    n = float(8 * 32)

    ours = build(args, mesh, cfg)
    ours.forward_backward([MicroBatch(x, y)], n)
    ref = DDP(build_model(args, cfg.train.seed, torch.device("cpu")))
    # DDP averages over ranks; our loss is already divided by the global count, so scale by world.
    (token_loss_sum(ref(x), y) / n * world).backward()
    ref_grads = {k: p.grad for k, p in ref.module.named_parameters()}
    worst = max(((p.grad - ref_grads[k]).norm() / ref_grads[k].norm()).item()
                for k, p in ours.model.named_parameters())
    return worst, mesh.stats.payload("dp_cp", "all_reduce"), mesh.stats.tallies[("dp_cp", "all_reduce")].calls, \
        len(ours.grad_sync.buckets), sum(p.numel() * 4 for p in ours.model.parameters())


def test_dp_matches_torch_ddp_and_counts_bytes(tiny_data):
    for worst, payload, calls, buckets, param_bytes in run_ranks(_grads_vs_ddp, 2, tiny_data):
        assert worst < 1e-6
        assert payload == param_bytes  # every gradient all-reduced exactly once
        assert calls == buckets > 1


def _accumulation_syncs_once(data_dir):
    losses, _, trainer = train_in_rank(["train.micro_batch=1", "train.steps=1", "parallel.bucket_mb=0.01"], data_dir)
    mesh = trainer.mesh
    tally = mesh.stats.tallies[("dp_cp", "all_reduce")]
    return tally.calls, len(trainer.par.grad_sync.buckets), trainer.cfg.train.accumulation(mesh.dp_size)


def test_accumulation_communicates_only_on_last_micro_batch(tiny_data):
    for calls, buckets, accumulation in run_ranks(_accumulation_syncs_once, 2, tiny_data):
        assert accumulation == 4
        assert calls == buckets  # not 4 × buckets


def _unused_parameter(idle_first_step: bool = False):
    """`idle_first_step`: a first step in which rank 1's backward produces no gradient at all
    (its `_seen` stays empty) before the step checked."""
    import torch.distributed as dist
    from torch import nn

    from ndtrain.mesh import MeshShape, ParallelMesh
    from ndtrain.parallel.data import DataParallel

    rank = dist.get_rank()
    mesh = ParallelMesh.build(MeshShape(dp_shard=2))
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4), "never": nn.Linear(4, 4)})
    dp = DataParallel(list(model.parameters()), mesh.group("dp_cp"), bucket_bytes=64)
    x = torch.ones(2, 4) * (rank + 1)
    if idle_first_step:
        dp.set_sync(True)
        if rank == 0:  # gradients ready in the order b, a: not registration order, so buckets reorder
            (model["b"](x).sum() + model["a"](x).sum()).backward()
        dp.finish()
        dp.zero_grad()  # rank 0 broadcasts its order: rank 1 must take part (data.py zero_grad)
    out = model["a"](x).sum()
    if rank == 0:  # "b" gets a gradient on rank 0 only
        out = out + model["b"](x).sum()
    dp.set_sync(True)
    out.backward()
    dp.finish()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("idle_first_step", [False, True])
def test_unused_parameters_do_not_hang(idle_first_step):
    """Also when a rank saw no gradient in the first step: the bucket order every rank
    rebuilds after it is rank 0's, broadcast to all (before the fix, rank 1 skipped the
    broadcast, its collectives fell out of step with rank 0's and the step hung or mixed
    buckets up)."""
    g0, g1 = run_ranks(_unused_parameter, 2, idle_first_step, timeout=60)
    for k in g0:
        assert torch.equal(g0[k], g1[k]), k
    assert torch.equal(g0["never.weight"], torch.zeros(4, 4))
    assert torch.allclose(g0["b.weight"], torch.ones(4, 4) * 2)  # rank 0's x = 1, batch of 2
    assert torch.allclose(g0["a.weight"], torch.ones(4, 4) * 6)  # 2·1 + 2·2


def _unsynced(data_dir):
    from ndtrain.parallel import data as dp_module
    dp_module.DataParallel._launch_ready_prefix = lambda self: None  # never communicate...
    dp_module.DataParallel._launch = lambda self, bucket: setattr(bucket, "work", __import__(
        "ndtrain.comm.ops", fromlist=["DONE"]).DONE) or setattr(self, "_next_launch", self._next_launch + 1)
    return train_in_rank([], data_dir)[:2]


def test_equivalence_check_catches_missing_all_reduce(tiny_data, reference):
    """Negative control: without the all-reduce, the same comparison fails by far."""
    ref_losses, ref_state = reference
    losses, state = run_ranks(_unsynced, 2, tiny_data)[0]
    with pytest.raises(AssertionError):
        assert_states_close(state, ref_state, 1e-3)


def _launched_during_backward(data_dir):
    """Pipeline stage 0 of pp2 × dp2 with small buckets: how many buckets each step had
    launched when the schedule called finish(), and the stage's last bucket."""
    from helpers import train_in_rank

    launched = []

    def probe(trainer):
        sync = trainer.par.grad_sync
        finish = sync.finish

        def recording_finish():
            launched.append(sync._next_launch)
            finish()
        sync.finish = recording_finish

    _, _, trainer = train_in_rank(["parallel.pp=2", "parallel.dp=2", "train.micro_batch=2", "train.steps=3",
                                   "parallel.bucket_mb=0.01"], data_dir, before_fit=probe)
    sync = trainer.par.grad_sync
    names = {id(p): n for n, p in trainer.par.model.named_parameters()}
    return trainer.mesh.coords["pp"], launched, len(sync.buckets), [names[id(p)] for p in sync.buckets[-1].params]


def test_buckets_follow_gradient_ready_order(tiny_data):
    """Issue 9: a pipeline stage registers its embedding after its blocks. In registration
    order the embedding's bucket came first, its gradient arrived last, and since buckets
    launch in order, stage 0 launched nothing before its backward ended. After the first
    step the buckets follow the order gradients became ready, and they overlap backward."""
    for stage, launched, n_buckets, last in run_ranks(_launched_during_backward, 4, tiny_data):
        assert n_buckets > 2
        if stage == 0:
            assert last == ["tok_embeddings.weight"]
            assert launched[-1] >= n_buckets - 1, launched  # all but the embedding's, during backward
