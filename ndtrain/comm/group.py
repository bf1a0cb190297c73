"""`Group`: one rank's view of one (possibly composite) mesh dimension, what every collective
in `ndtrain.comm` is called on. The mesh (mesh.py) builds them; a dimension of size one has
`pg = None` and the collectives return at once for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ndtrain.comm.stats import CommStats


@dataclass
class Group:
    """One rank's view of one (possibly composite) mesh dimension."""

    name: str
    ranks: list[int]
    rank: int  # this process's index inside the group
    pg: dist.ProcessGroup | None
    stats: CommStats = field(repr=False, default_factory=CommStats)
    device: torch.device = field(default=torch.device("cpu"))  # where its messages live

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def active(self) -> bool:
        return self.pg is not None
