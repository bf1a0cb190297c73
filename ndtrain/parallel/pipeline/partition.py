"""Cutting the decoder into pipeline chunks, and which rank holds which chunk.

The blocks are cut into `pp × v` contiguous chunks, placed on the ranks in one of two ways:
- a loop (interleaved 1F1B): chunk c runs on rank c % pp, so a rank holds the v chunks
  r, r + pp, r + 2·pp, ... and an activation travels 0 → 1 → … → pp−1 → 0 → … to the end;
- a V (`vshape`, the ZB-V and DualPipeV schedules, v = 2): the chunks go down the ranks
  and come back up, 0 → … → pp−1 → pp−1 → … → 0, so rank r holds chunks r and 2·pp−1−r,
  the turn (chunk pp−1 to chunk pp) stays on rank pp−1, and the first and the last chunk
  (embedding and head) are both on rank 0.

Balance comes from an explicit cost per piece of the model, in forward FLOPs per token (the
convention of `flops_per_token`): a decoder block costs its matmuls and its attention scores;
the first chunk also pays the embedding (a row read forward, a row accumulated backward);
the last chunk pays the final norm and the output head, which on a large vocabulary is worth
several blocks. Among the contiguous splits with at least one block per chunk, we take the one
whose most expensive chunk is cheapest, since that chunk sets the pace of the whole pipeline.
`parallel.pp_split` ("3,5,5,3": blocks per chunk) replaces the balanced split by hand.

This file is arithmetic only (it builds no tensor), so the config validator and the planner
can split models far larger than this machine. Importing it still loads torch: the
`ndtrain.model` package it reads `ModelArgs` from imports the model itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from ndtrain.config import parse_split, split_error
from ndtrain.model.args import ModelArgs, block_params


@dataclass(frozen=True)
class Chunk:
    index: int  # position in the pipeline, 0 .. n_chunks-1
    layer_ids: tuple[int, ...]
    embed: bool  # holds the token embedding (first chunk)
    head: bool  # holds the final norm and the output head (last chunk)


def layer_costs(args: ModelArgs, seq_len: int) -> tuple[float, list[float], float]:
    """(embedding, [each block], norm + head): forward FLOPs per token."""
    attention = 2.0 * seq_len * args.dim  # causal attention scores
    blocks = [2.0 * block_params(args, i, active=True) + attention for i in range(args.n_layers)]  # + matmuls
    embedding = 2.0 * args.dim
    head = 2.0 * args.dim * args.vocab_size + args.dim
    return embedding, blocks, head


def balanced_counts(costs: list[float], n_chunks: int, first_extra: float, last_extra: float) -> list[int]:
    """Blocks per chunk minimising the most expensive chunk (dynamic programme over cut points).
    Ties go to the split with the most blocks early, which is deterministic."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest possible maximum over the first k chunks holding blocks [0, i)
    best = [[inf] * (n + 1) for _ in range(n_chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(n_chunks + 1)]
    best[0][0] = 0.0
    for k in range(1, n_chunks + 1):
        for i in range(k, n - (n_chunks - k) + 1):
            for j in range(k - 1, i):
                cost = prefix[i] - prefix[j] + (first_extra if k == 1 else 0.0) + (last_extra if k == n_chunks else 0.0)
                value = max(best[k - 1][j], cost)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    counts, i = [], n
    for k in range(n_chunks, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def chunk_counts(args: ModelArgs, n_chunks: int, seq_len: int, split: str = "") -> list[int]:
    """Blocks per chunk: the hand-written `split`, or the cost-balanced one."""
    if split:
        counts = parse_split(split)
        error = split_error(counts, n_chunks, args.n_layers)
        if error:
            raise ValueError(f"parallel.pp_split {split!r} {error}")
        return counts
    if args.n_layers < n_chunks:
        raise ValueError(f"{args.n_layers} layers cannot fill {n_chunks} pipeline chunks")
    embedding, blocks, head = layer_costs(args, seq_len)
    return balanced_counts(blocks, n_chunks, embedding, head)


def make_chunks(counts: list[int]) -> list[Chunk]:
    chunks, start = [], 0
    for c, n in enumerate(counts):
        chunks.append(Chunk(c, tuple(range(start, start + n)), c == 0, c == len(counts) - 1))
        start += n
    return chunks


def chunk_costs(args: ModelArgs, chunks: list[Chunk], seq_len: int) -> list[float]:
    embedding, blocks, head = layer_costs(args, seq_len)
    return [sum(blocks[i] for i in ch.layer_ids) + (embedding if ch.embed else 0.0) + (head if ch.head else 0.0)
            for ch in chunks]


def owner(chunk: int, pp: int, vshape: bool = False) -> int:
    """The pipeline rank that holds `chunk` (`vshape`: odd rounds come back up the ranks)."""
    if vshape and (chunk // pp) % 2:
        return pp - 1 - chunk % pp
    return chunk % pp


def local_chunks(rank: int, pp: int, v: int, vshape: bool = False) -> list[int]:
    """The chunks pipeline rank `rank` holds, in pipeline order."""
    return [k * pp + (pp - 1 - rank if vshape and k % 2 else rank) for k in range(v)]
