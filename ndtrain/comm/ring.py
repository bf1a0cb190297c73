"""Our own ring all-reduce: a reduce-scatter and an all-gather built from send/recv.

The bandwidth-optimal all-reduce of S bytes over n ranks (Patarasuk and Yuan 2009; the
ring of NCCL and gloo) cuts the tensor into n chunks and passes them around the ring
r → r+1 in 2(n−1) steps:
- reduce-scatter, n−1 steps: at step k rank r sends its running sum of chunk (r − k) mod n
  and adds what it receives into chunk (r − k − 1) mod n. After the last step rank r holds
  the complete sum of chunk (r + 1) mod n.
- all-gather, n−1 steps: rank r passes on the complete chunk it got last, (r + 1 − k) mod
  n, and stores the one it receives, (r − k) mod n.
Each rank sends 2(n−1) chunks of S/n bytes, 2(n−1)/n·S in all: the wire bytes CommStats
charges an all-reduce. Chunks are `tensor_split` pieces, so sizes that n does not divide
work (they differ by one element). Every step posts its send and its receive together
(`ops.send_recv`, one NCCL group), so the ring cannot deadlock, and the messages are
counted in the group's CommStats as sends and receives.

This is for measuring the interconnect and for teaching: the engine calls the backend's
all-reduce (`ops.all_reduce`), and `ndtrain bench comm` times the two side by side.
"""

from __future__ import annotations

import torch

from ndtrain.comm import ops
from ndtrain.comm.group import Group


def _step(send: torch.Tensor, recv: torch.Tensor, group: Group) -> None:
    """Send to the next rank and receive from the previous one. A chunk has the same
    size at both ends of its message, so an empty one is skipped by both."""
    n, r = group.size, group.rank
    sends = [(send, (r + 1) % n)] if send.numel() else []
    recvs = [(recv, (r - 1) % n)] if recv.numel() else []
    for work in ops.send_recv(sends, recvs, group):
        work.wait()


def _reduce_scatter(chunks: list[torch.Tensor], incoming: torch.Tensor, group: Group) -> None:
    """In place: afterwards chunk (r + 1) mod n of rank r is the group's sum of it."""
    n, r = group.size, group.rank
    for k in range(n - 1):
        into = chunks[(r - k - 1) % n]
        buffer = incoming[:into.numel()]
        _step(chunks[(r - k) % n], buffer, group)
        into.add_(buffer)


def _all_gather(chunks: list[torch.Tensor], incoming: torch.Tensor, group: Group) -> None:
    """From chunk (r + 1) mod n complete on rank r to every chunk complete everywhere."""
    n, r = group.size, group.rank
    for k in range(n - 1):
        into = chunks[(r - k) % n]
        buffer = incoming[:into.numel()]
        _step(chunks[(r + 1 - k) % n], buffer, group)
        into.copy_(buffer)


@torch.no_grad()
def ring_all_reduce(t: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum `t` over the group in place, by a ring of sends and receives; returns `t`."""
    if not group.active or group.size == 1 or t.numel() == 0:
        return t
    flat = t.view(-1) if t.is_contiguous() else t.reshape(-1).clone()
    chunks = list(torch.tensor_split(flat, group.size))
    incoming = torch.empty_like(chunks[0])  # tensor_split puts the larger chunks first
    _reduce_scatter(chunks, incoming, group)
    _all_gather(chunks, incoming, group)
    if flat.data_ptr() != t.data_ptr():
        t.copy_(flat.view_as(t))
    return t
