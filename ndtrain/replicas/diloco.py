"""DiLoCo (Douillard et al. 2023): each replica group takes `train.diloco_inner_steps` = H
steps of its own optimizer on its own rows, with gradients summed inside the group only;
then an outer step. The outer gradient is the replicas' averaged delta, anchor − params,
and torch's SGD with Nesterov momentum (`train.diloco_outer_lr`, `..._momentum`) moves the
anchor by it; every replica group then starts the next round from the new anchor. A
replica group that died misses the round: the mean is over the groups that are alive at
the outer step (replicas/exchange.py). The inner optimizer's moments stay each group's own.
"""

from __future__ import annotations

import torch

from ndtrain.replicas.exchange import Exchange
from ndtrain.replicas.lighthouse import Quorum


KINDS = ("diloco_anchor", "diloco_momentum")  # their keys in a checkpoint: KIND/NAME


class DiLoCo:
    def __init__(self, params: list[torch.Tensor], inner_steps: int, lr: float, momentum: float):
        self.params, self.inner_steps = params, inner_steps
        self.anchors = [p.detach().clone() for p in params]
        self.outer = torch.optim.SGD(self.anchors, lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.prime()

    @torch.no_grad()
    def anchor(self) -> None:
        """Start a round from the parameters as they are (after a resume)."""
        for a, p in zip(self.anchors, self.params):
            a.copy_(p)

    def outer_due(self, step: int) -> bool:
        """Whether step `step` (counting from 0) ends a round."""
        return (step + 1) % self.inner_steps == 0

    @torch.no_grad()
    def outer_step(self, exchange: Exchange, step: int) -> Quorum:
        """The averaged delta over the live replicas, the outer step, and every parameter set
        to the new anchor. Returns the quorum whose deltas were averaged."""
        deltas = [a - p.detach() for a, p in zip(self.anchors, self.params)]
        q = exchange.average(exchange.start(f"{step}o"), deltas)
        for a, d in zip(self.anchors, deltas):
            a.grad = d
        self.outer.step()
        for a, p in zip(self.anchors, self.params):
            a.grad = None
            p.copy_(a)
        return q

    @torch.no_grad()
    def prime(self) -> None:
        """Create the momentum buffers (zeros, as SGD would on its first step) so a joiner
        holds the same tensors a live group sends it."""
        if self.outer.defaults["momentum"]:
            for a in self.anchors:
                self.outer.state[a].setdefault("momentum_buffer", torch.zeros_like(a))

    def checkpoint_state(self) -> tuple[dict, tuple[str, ...]]:
        """What a checkpoint holds of DiLoCo, as checkpoint/layout.py's `share` and `held`
        take it: per optimizer tensor, its round's anchor and its outer momentum."""
        kinds = KINDS if self.outer.defaults["momentum"] else KINDS[:1]
        state = {p: {"diloco_anchor": a, **({"diloco_momentum": self.outer.state[a]["momentum_buffer"]}
                                             if len(kinds) > 1 else {})}
                 for p, a in zip(self.params, self.anchors)}
        return state, kinds

    def state_tensors(self) -> list[torch.Tensor]:
        """What a joiner receives besides the parameters: the anchors and the momentum."""
        out = list(self.anchors)
        for a in self.anchors:
            if "momentum_buffer" in self.outer.state[a]:
                out.append(self.outer.state[a]["momentum_buffer"])
        return out
