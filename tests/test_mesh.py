"""ParallelMesh: rank ↔ coordinates, and groups that match torch's DeviceMesh."""

import pytest

from ndtrain.mesh import DIMS, MeshShape, ParallelMesh
from ndtrain.testing import run_ranks


@pytest.mark.parametrize("shape", [
    MeshShape(), MeshShape(dp_shard=4), MeshShape(pp=2, dp_shard=2, tp=2),
    MeshShape(dp_replicate=2, dp_shard=2, cp=2), MeshShape(pp=2, dp_replicate=1, dp_shard=3, cp=1, tp=2),
])
def test_coords_round_trip_and_tp_fastest(shape):
    seen = set()
    for rank in range(shape.world):
        c = shape.coords(rank)
        assert shape.rank_of(c) == rank
        seen.add(tuple(c[d] for d in DIMS))
    assert len(seen) == shape.world
    if shape.tp > 1:
        assert shape.coords(1)["tp"] == 1  # neighbours differ in tp first
    assert shape.coords(shape.world - 1)["pp"] == shape.pp - 1


def test_explicit_maps():
    s = MeshShape(pp=2, dp_shard=2, tp=2)
    assert s.coords(5) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    assert s.group_ranks(("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert s.group_ranks(("dp_shard",)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert s.group_ranks(("pp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    h = MeshShape(dp_replicate=2, dp_shard=2, cp=2)
    assert h.group_of(0, ("dp_replicate", "dp_shard", "cp")) == list(range(8))
    assert h.group_of(3, ("dp_replicate", "dp_shard")) == [1, 3, 5, 7]
    assert h.size("dp_cp") == 8 and h.size("dp") == 4


def test_expert_groups_split_dp_shard_cp():
    """ep takes consecutive ranks of dp_shard × cp (cp fastest); edp_shard the ranks of it
    holding the same experts; edp adds dp_replicate."""
    s = MeshShape(dp_replicate=2, dp_shard=2, cp=2, ep=2)
    assert s.expert_group_ranks("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert s.expert_group_ranks("edp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert s.expert_group_ranks("edp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    t = MeshShape(pp=2, dp_shard=4, tp=2, ep=4)  # tp fastest: an expert group skips the tp neighbour
    assert t.expert_group_ranks("ep")[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert t.expert_coords(6) == {"ep": 3, "edp_shard": 0}
    assert t.size("edp_shard") == 1 and t.size("edp") == 1 and MeshShape(dp_shard=4, ep=2).size("edp") == 2
    with pytest.raises(ValueError, match="ep = 3 must divide dp_shard × cp = 4"):
        MeshShape(dp_shard=4, ep=3)


def test_single_has_no_groups():
    mesh = ParallelMesh.single()
    assert all(not mesh.group(n).active for n in DIMS + ("dp", "dp_cp"))
    assert mesh.dp_size == 1 and mesh.describe() == "single process"


def _build_and_check(shape):
    import torch
    import torch.distributed as dist

    from ndtrain.comm import ops
    mesh = ParallelMesh.build(shape)
    out = {}
    for name in ("ep", "edp_shard", "edp"):
        t = torch.tensor([float(dist.get_rank())])
        ops.all_reduce(t, mesh.group(name))
        out[name] = t.item()
    for name in DIMS + ("dp", "dp_cp", "dp_shard_cp"):
        g = mesh.group(name)
        assert g.active == (g.size > 1), name
        assert g.ranks == shape.group_of(dist.get_rank(), {"dp": ("dp_replicate", "dp_shard"),
                                                           "dp_cp": ("dp_replicate", "dp_shard", "cp"),
                                                           "dp_shard_cp": ("dp_shard", "cp")}.get(name, (name,)))
        t = torch.tensor([float(dist.get_rank())])
        ops.all_reduce(t, g)
        out[name] = t.item()
    return mesh.coords, out


@pytest.mark.parametrize("shape", [MeshShape(pp=2, dp_shard=2, tp=2, ep=2),
                                   MeshShape(dp_replicate=2, dp_shard=2, cp=2, ep=2)])
def test_groups_on_eight_ranks(shape):
    results = run_ranks(_build_and_check, 8, shape)
    for rank, (coords, sums) in enumerate(results):
        assert coords == shape.coords(rank)
        for name in ("ep", "edp_shard", "edp"):
            group = next(g for g in shape.expert_group_ranks(name) if rank in g)
            assert sums.pop(name) == sum(group), (name, rank)
        for name, total in sums.items():
            dims = {"dp": ("dp_replicate", "dp_shard"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
                    "dp_shard_cp": ("dp_shard", "cp")}.get(name, (name,))
            assert total == sum(shape.group_of(rank, dims)), (name, rank)
