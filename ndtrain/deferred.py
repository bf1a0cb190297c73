"""Device values of many steps read on the host at once: one host sync per log window.

A training step leaves its figures on the device (the loss, the gradient norm, the target
count, MoE routing tables), so the host never waits for the device inside a step. Its record
holds them as tensors, or as `Lazy(fn, tensors)` for a figure computed from them on the host.
`settle(records)` copies every such tensor of every record to the host in one transfer (the
one synchronisation) and puts the values in their place: a Python number for a 0-dim tensor,
nested lists otherwise, `fn(*host tensors)` for a `Lazy`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Lazy:
    """A record value computed on the host from device tensors once they are read."""

    fn: Callable
    tensors: tuple[torch.Tensor, ...]

    def value(self):
        """Computed now (a host sync of its own)."""
        return self.fn(*(t.cpu() for t in self.tensors))


def _leaves(records: list[dict]):
    for record in records:
        for value in record.values():
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, Lazy):
                yield from value.tensors


def settle(records: list[dict]) -> None:
    """Replace the device values of `records` in place by host values (module docstring)."""
    leaves = list(_leaves(records))
    if not leaves:
        return
    flat = torch.cat([t.detach().reshape(-1).double() for t in leaves]).cpu()  # the one sync
    host, at = {}, 0
    for t in leaves:
        host[id(t)] = flat[at:at + t.numel()].view(t.shape).to(t.dtype)
        at += t.numel()
    for record in records:
        for key, value in record.items():
            if isinstance(value, torch.Tensor):
                record[key] = host[id(value)].tolist()
            elif isinstance(value, Lazy):
                record[key] = value.fn(*(host[id(t)] for t in value.tensors))
