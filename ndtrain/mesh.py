"""ParallelMesh: the named dimensions of one N-D layout, each rank's place in it, and its groups.

Ranks are laid out row-major over `pp, dp_replicate, dp_shard, cp, tp`: tp varies fastest
(neighbouring ranks share the fastest links), pp slowest. A group of dimension X holds the
ranks that differ only in their X coordinate. Composite groups hold the ranks that differ
only in those coordinates: `dp` = dp_replicate × dp_shard, `dp_cp` = dp × cp (where dense
gradients are reduced), `dp_shard_cp` = dp_shard × cp (where ZeRO shards, and whose ranks
expert parallelism splits into `ep` sub-meshes, below).

The mesh is built once per process and passed to whatever needs it; nothing here is global.
A dimension of size 1 creates no process group: its `Group` has `pg = None` and the
collectives in `ndtrain.comm` return at once for it.

Expert parallelism splits the ranks of `dp_shard × cp` (index i in that group, cp fastest)
into `ep` consecutive ranks, which hold different experts (`ep` coordinate i % ep), times
`dp_shard·cp / ep` that hold the same ones (`edp_shard` coordinate i // ep). Groups:
- `ep`: the ranks that exchange tokens (all-to-all) and split the experts;
- `edp_shard`: the ranks with the same experts inside one dp_shard × cp group, over which
  ZeRO shards the expert states (what `dp_shard_cp` is for dense ones);
- `edp`: `dp_replicate × edp_shard`, all the ranks with the same experts, over which expert
  gradients are summed (what `dp_cp` is for dense ones).
With ep = 1 there is no `ep` group, and `edp_shard` and `edp` are `dp_shard_cp` and `dp_cp`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product

import torch
import torch.distributed as dist

from ndtrain.comm.group import Group
from ndtrain.comm.stats import CommStats

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_DIMS = ("ep", "edp_shard")  # the two factors of dp_shard × cp under expert parallelism
COMPOSITES = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
}


@dataclass(frozen=True)
class MeshShape:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # experts split over ep of the dp_shard × cp ranks (not a factor of the world)

    def __post_init__(self):
        if (self.dp_shard * self.cp) % self.ep:
            raise ValueError(f"ep = {self.ep} must divide dp_shard × cp = {self.dp_shard * self.cp}")

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in DIMS)

    @property
    def world(self) -> int:
        return math.prod(self.sizes)

    def size(self, name: str) -> int:
        if name in ("edp_shard", "edp"):
            return self.size("dp_shard_cp" if name == "edp_shard" else "dp_cp") // self.ep
        return math.prod(getattr(self, d) for d in COMPOSITES.get(name, (name,)))

    def coords(self, rank: int) -> dict[str, int]:
        """Row-major coordinates of `rank`, tp fastest."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside a mesh of {self.world}")
        out = {}
        for d in reversed(DIMS):
            rank, out[d] = divmod(rank, getattr(self, d))
        return {d: out[d] for d in DIMS}

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for d in DIMS:
            rank = rank * getattr(self, d) + coords.get(d, 0)
        return rank

    def group_ranks(self, dims: tuple[str, ...]) -> list[list[int]]:
        """Every group along `dims`: lists of ranks differing only in those coordinates,
        each list ordered by the group's own row-major index."""
        others = [d for d in DIMS if d not in dims]
        groups = []
        for fixed in product(*(range(getattr(self, d)) for d in others)):
            base = dict(zip(others, fixed))
            members = []
            for varying in product(*(range(getattr(self, d)) for d in dims)):
                members.append(self.rank_of({**base, **dict(zip(dims, varying))}))
            groups.append(members)
        return groups

    def group_of(self, rank: int, dims: tuple[str, ...]) -> list[int]:
        return next(g for g in self.group_ranks(dims) if rank in g)

    def expert_coords(self, rank: int) -> dict[str, int]:
        """This rank's `ep` and `edp_shard` coordinates (see the module docstring)."""
        c = self.coords(rank)
        i = c["dp_shard"] * self.cp + c["cp"]
        return {"ep": i % self.ep, "edp_shard": i // self.ep}

    def expert_group_ranks(self, name: str) -> list[list[int]]:
        """Every `ep`, `edp_shard` or `edp` group, each ordered by rank."""
        def key(rank: int) -> tuple:
            c, e = self.coords(rank), self.expert_coords(rank)
            fixed = {"ep": ("pp", "dp_replicate", "tp"), "edp_shard": ("pp", "dp_replicate", "tp"),
                     "edp": ("pp", "tp")}[name]
            kept = {"ep": "edp_shard", "edp_shard": "ep", "edp": "ep"}[name]
            return tuple(c[d] for d in fixed) + (e[kept],)
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world):
            groups.setdefault(key(rank), []).append(rank)
        return list(groups.values())


class ParallelMesh:
    """Coordinates and process groups of this rank; built once, passed explicitly."""

    def __init__(self, shape: MeshShape, rank: int, device: torch.device,
                 groups: dict[str, Group], stats: CommStats):
        self.shape, self.rank, self.device, self.stats = shape, rank, device, stats
        self.coords = shape.coords(rank)
        self._groups = groups

    # -- construction --------------------------------------------------------
    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "ParallelMesh":
        """The one-process mesh: every dimension has size 1, no groups."""
        return cls.build(MeshShape(), torch.device(device))

    @classmethod
    def build(cls, shape: MeshShape, device: torch.device | str = "cpu") -> "ParallelMesh":
        """Build from the initialised default process group (or alone when world is 1).

        Uses torch's DeviceMesh over the dimensions larger than one, and flattens the
        composite dimensions from it, so the groups are the ones torch would make.
        """
        device = torch.device(device)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if world != shape.world:
            raise ValueError(f"mesh {dict(zip(DIMS, shape.sizes))} needs {shape.world} processes, "
                             f"but the world has {world}")
        stats = CommStats()
        live = tuple(d for d in DIMS if getattr(shape, d) > 1)
        device_mesh = None
        if live:
            from torch.distributed.device_mesh import init_device_mesh
            device_mesh = init_device_mesh(device.type, tuple(getattr(shape, d) for d in live),
                                           mesh_dim_names=live)
        groups: dict[str, Group] = {}
        for name in DIMS + tuple(COMPOSITES):
            dims = COMPOSITES.get(name, (name,))
            members = shape.group_of(rank, dims)
            live_dims = tuple(d for d in dims if d in live)
            pg = None
            if live_dims:
                sub = device_mesh[live_dims] if len(live_dims) > 1 else device_mesh[live_dims[0]]
                if len(live_dims) > 1:
                    sub = sub._flatten(f"{'_'.join(live_dims)}_flat")
                pg = sub.get_group()
                assert dist.get_process_group_ranks(pg) == members, (name, members)
            groups[name] = Group(name, members, members.index(rank), pg, stats, device)
        groups.update(expert_groups(shape, rank, device, stats, groups))
        return cls(shape, rank, device, groups, stats)

    # -- queries ---------------------------------------------------------------
    def group(self, name: str) -> Group:
        return self._groups[name]

    def stage_group(self) -> Group:
        """Every rank of this pipeline stage (all dimensions but pp), made on first use by
        every rank at once (Muon's matrix owners, parallel/muon.py); no other run pays for it."""
        if "stage" not in self._groups:
            dims = tuple(d for d in DIMS if d != "pp")
            mine, pg = self.shape.group_of(self.rank, dims), None
            if len(mine) > 1:
                for ranks in self.shape.group_ranks(dims):  # new_group is collective over the world
                    made = dist.new_group(ranks)
                    pg = made if ranks == mine else pg
            self._groups["stage"] = Group("stage", mine, mine.index(self.rank), pg, self.stats, self.device)
        return self._groups["stage"]

    def size(self, name: str) -> int:
        return self.shape.size(name)

    def coord(self, name: str) -> int:
        """This rank's index along a (possibly composite) dimension."""
        return self._groups[name].rank

    @property
    def world(self) -> int:
        return self.shape.world

    @property
    def dp_rank(self) -> int:
        return self.coord("dp")

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.shape.pp - 1

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    def describe(self) -> str:
        """E.g. "pp=2 × dp=2 × tp=2"; "dp_replicate=2 × dp_shard=2" for hybrid sharding;
        "dp=4 (ep=2)" when experts are split over 2 of the 4."""
        names = dict(zip(DIMS, DIMS))
        if self.shape.dp_replicate == 1:
            names["dp_shard"] = "dp"
        live = [f"{names[d]}={getattr(self.shape, d)}" for d in DIMS if getattr(self.shape, d) > 1]
        text = " × ".join(live) if live else "single process"
        return text + (f" (ep={self.shape.ep})" if self.shape.ep > 1 else "")


def expert_groups(shape: MeshShape, rank: int, device: torch.device, stats: CommStats,
                  groups: dict[str, Group]) -> dict[str, Group]:
    """The `ep`, `edp_shard` and `edp` groups of this rank (module docstring). Every rank
    creates every group, in the same order, as `new_group` requires."""
    if shape.ep == 1:
        return {"ep": Group("ep", [rank], 0, None, stats, device),
                "edp_shard": groups["dp_shard_cp"], "edp": groups["dp_cp"]}
    out = {}
    for name in ("ep", "edp_shard", "edp"):
        for members in shape.expert_group_ranks(name):
            pg = dist.new_group(members) if len(members) > 1 else None
            if rank in members:
                out[name] = Group(name, members, members.index(rank), pg, stats, device)
    return out
