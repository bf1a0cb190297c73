"""Messages between pipeline ranks: activations forward, their gradients backward.

Every message of a run has a shape known in advance. The shape crossing each chunk boundary
is agreed once per run (per micro-batch shape) by a probe (`Executor.agree_shapes`): the
sender announces it in a small header; afterwards a message is only its payload, received
into a buffer allocated when the receive is posted and dropped as soon as it has been used.
A gradient has the shape of the activation it belongs to.
"""

from __future__ import annotations

import torch

from ndtrain.comm import ops
from ndtrain.mesh import Group

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # dtype code, ndim, up to 6 dims


class StageLinks:
    """This rank's end of the pipeline's links: the pp group and the agreed shapes."""

    def __init__(self, group: Group, device: torch.device):
        self.group, self.device = group, device
        self.shapes: dict[int, tuple[torch.Size, torch.dtype]] = {}  # boundary c (chunk c → c+1)
        self.pending: list[tuple[object, torch.Tensor]] = []  # sends in flight, with their tensors

    def post(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[int, int]]) -> list:
        """Post one group: `sends` (tensor, peer), `recvs` (boundary, peer). Returns
        [(handle, buffer)] for the receives; the sends are kept until they complete."""
        # A message leaves as one contiguous block: the zero-bubble input gradient can arrive
        # from autograd with any strides, and NCCL sends memory, not tensors.
        sends = [(t.contiguous(), peer) for t, peer in sends]
        buffers = [torch.empty(self.shapes[b][0], dtype=self.shapes[b][1], device=self.device) for b, _ in recvs]
        works = ops.send_recv(sends, [(buf, p) for buf, (_, p) in zip(buffers, recvs)], self.group)
        self.pending += [(w, t) for w, (t, _) in zip(works, sends)]
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]
        return list(zip(works[len(sends):], buffers))

    def wait_sends(self) -> None:
        for w, _ in self.pending:
            w.wait()
        self.pending = []

    # -- the once-per-run shape agreement ---------------------------------------------
    def send_with_header(self, t: torch.Tensor, boundary: int, peer: int) -> None:
        self.shapes[boundary] = (t.shape, t.dtype)
        if t.dim() > _HEADER - 2 or t.dtype not in _DTYPES:
            raise ValueError(f"pipeline messages carry up to {_HEADER - 2} dims of {_DTYPES}; got {t.dtype} {tuple(t.shape)}")
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
        header[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        for w in ops.send_recv([(header, peer), (t.contiguous(), peer)], [], self.group):
            w.wait()

    def recv_with_header(self, boundary: int, peer: int) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        ops.send_recv([], [(header, peer)], self.group)[0].wait()
        code, ndim, *dims = header.tolist()
        self.shapes[boundary] = (torch.Size(dims[:ndim]), _DTYPES[code])
        buf = torch.empty(self.shapes[boundary][0], dtype=_DTYPES[code], device=self.device)
        ops.send_recv([], [(buf, peer)], self.group)[0].wait()
        return buf
