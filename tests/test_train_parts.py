"""Unit tests of the trainer's parts: LR schedule, global-norm clipping, launcher environment,
MFU peaks."""

import json
import math

import pytest
import torch

from ndtrain.config import TrainConfig
from ndtrain.mesh import ParallelMesh
from ndtrain.testing import run_ranks
from ndtrain.parallel.clip import clip_grad_norm_, grad_norm
from ndtrain.train.optim import lr_at


def test_lr_warmup_then_cosine_to_floor():
    t = TrainConfig(steps=100, lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert lr_at(0, t) == pytest.approx(0.1)
    assert lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(99, t) == pytest.approx(0.1)
    mid = 10 + (99 - 10) / 2
    assert lr_at(int(mid), t) == pytest.approx(0.55, abs=0.02)
    values = [lr_at(s, t) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def _torch_schedule(t, kind: str) -> list[float]:
    """The same schedule composed from torch.optim.lr_scheduler: the PyTorch-native anchor."""
    import warnings
    from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=t.lr)
    rest = t.steps - 1 - t.warmup
    warm = LinearLR(opt, 1 / t.warmup, 1.0, total_iters=t.warmup - 1)
    after, milestones = {
        "cosine": ([CosineAnnealingLR(opt, T_max=rest, eta_min=t.lr * t.min_lr_ratio)], [t.warmup]),
        "linear": ([LinearLR(opt, 1.0, t.min_lr_ratio, total_iters=rest)], [t.warmup]),
        "constant": ([ConstantLR(opt, 1.0, total_iters=0)], [t.warmup]),
        "wsd": ([ConstantLR(opt, 1.0, total_iters=0), LinearLR(opt, 1.0, t.min_lr_ratio, total_iters=20)],
                [t.warmup, t.steps - 20 - 1]),
    }[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SequentialLR's deprecation notes about step order
        sched = SequentialLR(opt, [warm, *after], milestones=milestones)
        out = []
        for _ in range(t.steps):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    return out


@pytest.mark.parametrize("kind", ["cosine", "wsd", "linear", "constant"])
def test_each_lr_schedule_equals_torch_schedulers(kind):
    """Every train.schedule equals its composition from torch.optim.lr_scheduler at every
    step, to rounding (1e-12 of lr: the closed forms against torch's recursive updates);
    wsd holds lr exactly until its last decay_fraction·steps = 20 steps."""
    t = TrainConfig(steps=100, lr=1.0, warmup=10, min_lr_ratio=0.1, schedule=kind, decay_fraction=0.2)
    ours = [lr_at(s, t) for s in range(t.steps)]
    assert ours == pytest.approx(_torch_schedule(t, kind), abs=1e-12)
    assert ours[0] == pytest.approx(0.1) and ours[9] == 1.0
    assert ours[-1] == pytest.approx(1.0 if kind == "constant" else 0.1)
    if kind == "wsd":
        assert ours[10:80] == [1.0] * 70 and ours[80] < 1.0


def test_clip_equals_torch_on_one_process():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p) * 3
        q.grad = p.grad.clone()
    ours = clip_grad_norm_(a, 1.0, ParallelMesh.single())
    theirs = torch.nn.utils.clip_grad_norm_(b, 1.0)
    assert float(ours) == pytest.approx(theirs.item(), rel=1e-6)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad)


def _sharded_norm(kind):
    """Rank r holds half of a 'tp'-sharded tensor and a full copy of a replicated one."""
    import torch.distributed as dist

    from ndtrain.mesh import MeshShape
    from ndtrain.parallel.placement import mark_duplicate, mark_sharded
    rank = dist.get_rank()
    full_sharded = torch.arange(8.0)
    replicated = torch.tensor([3.0, 4.0])
    shape = MeshShape(tp=2) if kind == "tp" else MeshShape(pp=2)
    mesh = ParallelMesh.build(shape)
    s = torch.nn.Parameter(torch.zeros(4))
    s.grad = full_sharded[rank * 4:(rank + 1) * 4].clone()
    r = torch.nn.Parameter(torch.zeros(2))
    r.grad = replicated.clone()
    if kind == "tp":
        mark_sharded(s, ("tp",))
    elif rank == 1:  # pp: two stages; the replicated one is a tied copy on the last stage
        mark_duplicate(r)
    return grad_norm([s, r], mesh).item()


@pytest.mark.parametrize("kind", ["tp", "pp"])
def test_global_norm_counts_each_element_once(kind):
    expected = math.sqrt(sum(x * x for x in range(8)) + 25.0)
    for value in run_ranks(_sharded_norm, 2, kind):
        assert value == pytest.approx(expected, rel=1e-6)


def test_slurm_variables_become_torch_distributed_ones(monkeypatch):
    import os

    from ndtrain import launch
    # A private environment: _adopt_slurm_env writes RANK, WORLD_SIZE, ... which, left in
    # os.environ, would make every later CLI test think torchrun started it.
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    monkeypatch.setenv("SLURM_LAUNCH_NODE_IPADDR", "10.0.0.7")
    assert launch.external_world() == 8
    launch._adopt_slurm_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("5", "8", "1")
    assert os.environ["LOCAL_WORLD_SIZE"] == "4" and os.environ["MASTER_ADDR"] == "10.0.0.7"


def test_mfu_peaks(tmp_path, monkeypatch):
    from ndtrain.observe import mfu
    peak, why = mfu.peak_flops(torch.device("cpu"), "fp32", tmp_path)
    assert peak is None and "ndtrain bench matmul" in why
    mfu.save_cpu_peak(tmp_path, 5e10, 1024, 2)
    peak, why = mfu.peak_flops(torch.device("cpu"), "fp32", tmp_path)
    assert peak == 5e10 and "measured" in why
    assert json.loads(mfu.cpu_peak_file(tmp_path).read_text())["threads"] == 2
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    assert mfu.peak_flops(torch.device("cuda"), "bf16", tmp_path)[0] == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Mystery GPU")
    assert mfu.peak_flops(torch.device("cuda"), "bf16", tmp_path)[0] is None
