"""The load-balanced ("zigzag") sequence layout of context parallelism, on the data side.

Each sequence of S tokens is cut into 2·cp chunks of c = S/(2·cp) tokens. CP rank r holds
chunks r and 2·cp−1−r, in that order:

    cp = 2, S = 8:   tokens 0 1 | 2 3 | 4 5 | 6 7      rank 0: 0 1 6 7    rank 1: 2 3 4 5

Under causal attention a token attends to the tokens before it, so a rank holding only the
end of the sequence would do most of the work; pairing chunk r with chunk 2·cp−1−r gives
every rank the same number of (query, key) pairs.

One permutation is applied to every [b, S] field of a micro-batch: tokens, targets (already
shifted: target i is token i+1 of the unsharded sequence, so no target is lost at a chunk
boundary), RoPE positions and document ids, and loss weights. The model therefore sees true
global positions and never learns about the layout; only the attention back ends
(`attention.py`) know it, to build masks from global token indices.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch
from torch import Tensor

from ndtrain.comm import ops
from ndtrain.data.batch import MicroBatch


def chunks_of(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) that CP rank `rank` holds, in local order."""
    return rank, 2 * cp - 1 - rank


def zigzag_index(seq_len: int, cp: int, rank: int, device: torch.device | str | None = None) -> Tensor:
    """Global positions (0..seq_len-1) of the seq_len/cp tokens that CP rank `rank` holds,
    in local order."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens cannot be cut into 2·cp = {2 * cp} equal chunks")
    c = seq_len // (2 * cp)
    first, second = chunks_of(rank, cp)
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


def gathered_index(seq_len: int, cp: int, device: torch.device | str | None = None) -> Tensor:
    """Global positions of every rank's tokens concatenated in rank order (what an
    all-gather or an all-to-all over the CP group delivers)."""
    return torch.cat([zigzag_index(seq_len, cp, r, device) for r in range(cp)])


def shard(mb: MicroBatch, cp: int, rank: int, mtp_depth: int = 0) -> MicroBatch:
    """This CP rank's tokens of every row: each [b, S] field permuted by the one zigzag
    index. Positions are made explicit (0..S-1 where the batch gave none), so RoPE keeps
    each token's true position. `mtp_depth` > 0: first the inputs and targets of the
    multi-token prediction modules, from the whole rows (model/mtp.lookahead: module d at
    position i reads token i + d, which another rank may hold)."""
    if mtp_depth:
        from ndtrain.model.mtp import lookahead
        mb = lookahead(mb, mtp_depth)
    b, s = mb.tokens.shape
    index = zigzag_index(s, cp, rank, mb.tokens.device)
    if mb.positions is None:
        mb = replace(mb, positions=torch.arange(s, device=mb.tokens.device).expand(b, s))
    return replace(mb, **{f.name: getattr(mb, f.name)[:, index] for f in fields(mb)
                          if getattr(mb, f.name) is not None})


def unshard(local: Tensor, group) -> Tensor:
    """The whole rows [b, S] of a per-token tensor that each CP rank holds in its zigzag
    order [b, S/cp] (what `shard` gave it): all-gathered over `group` (the cp group) and
    put back in sequence order. Collective over cp."""
    b, s_local = local.shape
    gathered = local.new_empty((group.size * b, s_local))
    ops.all_gather(gathered, local.contiguous(), group)
    index = gathered_index(s_local * group.size, group.size, local.device)
    out = torch.empty((b, s_local * group.size), dtype=local.dtype, device=local.device)
    out[:, index] = gathered.view(group.size, b, s_local).permute(1, 0, 2).reshape(b, -1)
    return out
