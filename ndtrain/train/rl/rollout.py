"""Generating rows across the ranks: each generation rank samples its share, scores it,
and every rank receives every row.

Under the generation layout (parallel/generation.py) the `world / tp` generation ranks
hold the whole model (or their tp shard of it). `generate_everywhere` deals the rows out
in contiguous shares, one per generation rank; each samples its share in one batch
(generate/sampler.py: left-padded prompts, a KV cache, one random stream per row, so a
row's completion depends on its prompt and seed only), scores each completion with the
reward function, computes the frozen reference's log-probabilities of it, and the shares
are all-gathered (`gather_rows`), so every rank holds the same rows. What a row holds
travels as one fp64 tensor of fixed width (the token ids are exact in fp64).

A stop request (Ctrl-C, SIGTERM: supervisor.py) during a rollout ends it within a token:
the ranks of a tensor-parallel group agree after every token (one all-reduce of a flag,
when tp > 1), and each row carries whether its share was cut short, so after the gather
every rank raises `supervisor.Interrupted` together. The trainer then abandons the step
and saves the one before it; the resumed run draws the same rollout again (each row's
completion is a function of its prompt and seed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from ndtrain import supervisor
from ndtrain.comm.ops import all_reduce_scalars
from ndtrain.generate.sampler import generate
from ndtrain.mesh import ParallelMesh
from ndtrain.model.llama import widened
from ndtrain.parallel.generation import gather_rows, generation_rank

SCORE_FIELDS = ("reward", "format", "correct", "error")


@dataclass
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass
class Generations:
    """Every row's completion, on every rank."""

    tokens: Tensor  # [n, M] long: the new tokens, padded with pad_id after `lengths`
    lengths: Tensor  # [n] long
    stopped: Tensor  # [n] bool: ended with a stop token (else cut at max_new_tokens)
    logprobs: Tensor  # [n, M] fp64: log p of each new token as the sampler computed it
    entropies: Tensor  # [n, M] fp64
    ref_logprobs: Tensor | None  # [n, M] fp64: under the frozen reference
    scores: Tensor  # [n, len(SCORE_FIELDS)] fp64

    def score(self, name: str) -> Tensor:
        return self.scores[:, SCORE_FIELDS.index(name)]


@torch.no_grad()
def completion_logprobs(model: nn.Module, prompts: list[list[int]], completions: list[list[int]],
                        width: int, pad_id: int) -> Tensor:
    """log p [n, width] of each completion's tokens after its prompt, under `model` (a plain
    forward of the right-padded rows: what a training forward computes)."""
    rows = [p + c for p, c in zip(prompts, completions)]
    length = max(len(r) for r in rows)
    device = next(model.parameters()).device
    tokens = torch.full((len(rows), length), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = torch.tensor(r)
    was_training = model.training
    model.eval()
    logp = torch.log_softmax(widened(model(tokens.to(device))), dim=-1).double().cpu()
    model.train(was_training)
    out = torch.zeros((len(rows), width), dtype=torch.float64)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        at = torch.arange(len(p) - 1, len(p) - 1 + len(c))
        out[i, :len(c)] = logp[i, at, torch.tensor(c, dtype=torch.long)]
    return out


def generate_everywhere(model: nn.Module, mesh: ParallelMesh, prompts: list[list[int]], seeds: list[int],
                        sampling: Sampling, stop_ids, pad_id: int,
                        score: Callable[[int, list[int]], tuple[float, float, float, float]],
                        reference: nn.Module | None = None) -> Generations:
    """Sample a completion for every prompt (row i with seed i), scored by
    `score(i, completion)` → (reward, format, correct, error), every row on every rank.
    Collective (every rank calls it with the same arguments)."""
    n, width = len(prompts), sampling.max_new_tokens
    me, ranks = generation_rank(mesh)
    share = math.ceil(n / ranks)
    lo, hi = min(n, me * share), min(n, (me + 1) * share)
    cols = 3 * width + 2 + len(SCORE_FIELDS) + (width if reference is not None else 0) + 1
    mine = torch.zeros((share, cols), dtype=torch.float64)  # the last column: the share was cut short
    if hi > lo:
        out = generate(model, prompts[lo:hi], width, sampling.temperature, sampling.top_k, sampling.top_p,
                       seeds[lo:hi], stop_ids, pad_id, should_stop=_stop_agreed_in(mesh))
        if out.interrupted:  # every rank of this tp group agreed: the gather tells the others
            mine[:, -1] = 1.0
        else:
            _fill(mine, out, range(lo, hi), width, pad_id, score)
            if reference is not None:
                mine[:hi - lo, cols - 1 - width:cols - 1] = completion_logprobs(reference, prompts[lo:hi], out.tokens,
                                                                                width, pad_id)
    rows = gather_rows(mine.to(mesh.device), mesh).cpu()
    if rows[:, -1].any():
        raise supervisor.Interrupted("a stop request cut the rollout short")
    rows = rows[:n]
    at = 3 * width + 2
    return Generations(
        tokens=rows[:, :width].long(), lengths=rows[:, 3 * width].long(), stopped=rows[:, 3 * width + 1] > 0,
        logprobs=rows[:, width:2 * width], entropies=rows[:, 2 * width:3 * width],
        ref_logprobs=rows[:, cols - 1 - width:cols - 1] if reference is not None else None,
        scores=rows[:, at:at + len(SCORE_FIELDS)])


def _stop_agreed_in(mesh: ParallelMesh) -> Callable[[], bool]:
    """Whether any rank of this tensor-parallel group was asked to stop: they generate
    together, so they must end at the same token."""
    group = mesh.group("tp")
    if not group.active:
        return supervisor.stop_requested
    return lambda: all_reduce_scalars([float(supervisor.stop_requested())], group)[0] > 0


def _fill(mine: Tensor, out, rows: range, width: int, pad_id: int, score) -> None:
    """This share's rows: tokens (padded), log-probabilities, entropies, length, whether
    it stopped, and its scores."""
    at = 3 * width + 2
    for j, i in enumerate(rows):
        c = len(out.tokens[j])
        row = mine[j]
        row[:width] = pad_id
        row[:c] = torch.tensor(out.tokens[j], dtype=torch.float64)
        row[width:width + c] = torch.tensor(out.logprobs[j], dtype=torch.float64)
        row[2 * width:2 * width + c] = torch.tensor(out.entropies[j], dtype=torch.float64)
        row[3 * width], row[3 * width + 1] = c, float(out.stopped[j])
        row[at:at + len(SCORE_FIELDS)] = torch.tensor(score(i, out.tokens[j]), dtype=torch.float64)
