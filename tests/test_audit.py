"""The CUDA/NCCL audit's fixes, checked where a CPU can check them (issue 20 item 6):
- a pipeline message leaves contiguous whatever strides autograd gave it (the zero-bubble
  input gradient was sent as it came);
- which groups the global gradient norm reduces over follows from the layout, never from
  which gradients a rank happens to hold (a rank without a gradient used to skip a
  collective the others entered, and the step hung);
- every parameter's gradient view in a data-parallel bucket, and every parameter and every
  slice of a ZeRO flat buffer, starts at a multiple of 64 elements (Megatron's padding).
(Batches through pinned memory, and no host sync in a step: tests/test_cuda.py and
tests/test_syncs.py.)"""

import pytest
import torch

from helpers import TINY
from ndtrain.parallel.placement import ALIGN
from ndtrain.testing import run_ranks


def _transposed_message():
    from ndtrain.mesh import MeshShape, ParallelMesh
    from ndtrain.parallel.pipeline.p2p import StageLinks

    mesh = ParallelMesh.build(MeshShape(pp=2))
    links = StageLinks(mesh.group("pp"), torch.device("cpu"))
    links.shapes[0] = (torch.Size([3, 5]), torch.float32)
    if mesh.rank == 0:
        t = torch.arange(15.0).view(5, 3).t()  # [3, 5], not contiguous
        assert not t.is_contiguous()
        links.post([(t, 1)], [])
        links.wait_sends()
        return None
    (work, buf), = links.post([], [(0, 0)])
    work.wait()
    return buf


def test_a_non_contiguous_message_arrives_whole():
    received = run_ranks(_transposed_message, 2)[1]
    assert torch.equal(received, torch.arange(15.0).view(5, 3).t())


def _norm_with_a_missing_gradient():
    import torch.distributed as dist
    from torch import nn

    from ndtrain.mesh import MeshShape, ParallelMesh
    from ndtrain.parallel.clip import grad_norm
    from ndtrain.parallel.placement import mark_sharded

    mesh = ParallelMesh.build(MeshShape(tp=2))
    split = mark_sharded(nn.Parameter(torch.zeros(4)), ("tp",))
    whole = nn.Parameter(torch.zeros(3))
    whole.grad = torch.full((3,), 2.0)
    if dist.get_rank() == 0:  # rank 1 holds no gradient for its half of `split`
        split.grad = torch.full((4,), 1.0)
    return float(grad_norm([split, whole], mesh))


def test_the_norm_reduces_by_layout_not_by_local_gradients():
    """tp 2: a split tensor whose gradient only rank 0 holds, and a replicated one. Both
    ranks enter the same all-reduce and agree: √(4·1² + 3·2²) = 4 (fp32 squares: 1e-6). The
    code before hung here: rank 1 skipped the tp all-reduce rank 0 waited in."""
    norms = run_ranks(_norm_with_a_missing_gradient, 2, timeout=60)
    assert norms[0] == norms[1] == pytest.approx(4.0, rel=1e-6)


def _offsets(layouts):
    return [_offsets_of(overrides) for overrides in layouts]


def _offsets_of(overrides):
    import torch.distributed as dist

    from ndtrain.config import load_config, validate
    from ndtrain.mesh import ParallelMesh
    from ndtrain.parallel.parallelize import build
    from ndtrain.train.worker import mesh_shape

    cfg = validate(load_config(None, TINY + overrides), world=dist.get_world_size())
    par = build(cfg.model_args(), ParallelMesh.build(mesh_shape(cfg)), cfg)
    flats = getattr(par.states, "flats", None)
    if flats is not None:
        starts = [start for f in flats for start, _ in f.slot.values()] + [f.shard_numel for f in flats]
        views = [f.shard.storage_offset() for f in flats if f.stage < 3]
    else:
        buckets = [b for sync in getattr(par.grad_sync, "syncs", [par.grad_sync]) for b in sync.buckets]
        starts = [par.grad_sync.grad_of(p).storage_offset() for b in buckets for p in b.params]
        views = [p.grad.storage_offset() for b in buckets for p in b.params if p.grad is not None]
    return starts, views


def test_flat_buffers_start_everything_at_64_elements():
    layouts = (["parallel.dp=2"], ["parallel.zero=1"], ["parallel.zero=3"], ["parallel.tp=2"])
    for rank in run_ranks(_offsets, 2, layouts):
        for overrides, (starts, views) in zip(layouts, rank):
            assert starts and all(s % ALIGN == 0 for s in starts + views), (overrides, starts, views)
