"""Generating rows across the ranks: each generation rank samples its share, scores it,
and every rank receives every row.

Under the generation layout (parallel/generation.py) the `world / rl.generate_tp`
generation ranks hold the whole model (or their tp shard of it). `generate_everywhere` deals the rows out
in contiguous shares, one per generation rank; each samples its share in one batch
(generate/sampler.py: left-padded prompts, a KV cache, one random stream per row, so a
row's completion depends on its prompt and seed only), scores each completion with the
reward function, computes the frozen reference's log-probabilities of it, and the shares
are all-gathered (`gather_rows`), so every rank holds the same rows. What a row holds
travels as one fp64 tensor of fixed width (the token ids are exact in fp64).

A stop request (Ctrl-C, SIGTERM: supervisor.py) during a rollout ends it within a token:
the ranks of a generation tp group agree after every token (one all-reduce of a flag, when
its size is above 1), and each row carries whether its share was cut short, so after the
gather every rank raises `supervisor.Interrupted` together. The trainer then abandons the
step and saves the one before it; the resumed run draws the same rollout again (each row's
completion is a function of its prompt and seed).
"""

from __future__ import annotations

import functools
import math
import time
import zlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from ndtrain import supervisor
from ndtrain.comm.group import Group
from ndtrain.comm.ops import all_reduce_scalars
from ndtrain.generate.sampler import generate
from ndtrain.model.loss import IGNORE, chunked_nll, token_nll
from ndtrain.parallel.generation import GenerationLayout, gather_rows

SCORE_FIELDS = ("reward", "format", "correct", "error")
# A sampling step holds a few [rows, vocabulary] tensors (logits, probabilities, their fp64
# cumulative sum, log-probabilities: about 32 bytes per row and token of the vocabulary); a
# generation rank samples its share in batches of at most SAMPLE_BYTES / (32 · V) rows, so
# that holds under SAMPLE_BYTES whatever the batch (all rows at once for a small vocabulary,
# 64 at 128k).
SAMPLE_BYTES = 2**28


def sampling_batches(lo: int, hi: int, vocab_size: int) -> list[tuple[int, int]]:
    """Rows lo..hi-1 in batches of at most SAMPLE_BYTES / (32 · vocab_size) rows."""
    step = max(1, SAMPLE_BYTES // (32 * vocab_size))
    return [(a, min(hi, a + step)) for a in range(lo, hi, step)]


@dataclass
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    long_tail: float = 0.0  # > 0: only this share of prompts may run to max_new_tokens (row_limits)

    def limits(self, prompts: list[list[int]]) -> list[int] | None:
        """rl.long_tail's lengths: a share `long_tail` of the prompts (by a hash of their
        tokens, so the same prompt always) may run to max_new_tokens, the others are cut at
        max_new_tokens // 8 (at least 1); None without a long tail."""
        if not self.long_tail:
            return None
        short = max(1, self.max_new_tokens // 8)
        return [self.max_new_tokens if zlib.crc32(str(p).encode()) % 10_000 < self.long_tail * 10_000 else short
                for p in prompts]


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
    versions: Tensor | None = None  # [n, M] long: the weights' version that sampled each token (None: one for all)
    times: tuple | None = None  # (start, this rank's share sampled, every share gathered): wall-clock seconds

    def score(self, name: str) -> Tensor:
        return self.scores[:, SCORE_FIELDS.index(name)]


@torch.no_grad()
def completion_logprobs(model: nn.Module, prompts: list[list[int]], completions: list[list[int]],
                        width: int, pad_id: int, rows_per_forward: int, chunk: int = 0) -> Tensor:
    """log p [n, width] (fp64, on the host) of each completion's tokens after its prompt
    under `model`: a plain forward of the right-padded rows, each token's log-probability
    minus its cross-entropy as the training step computes it (model/loss.token_nll), on the
    model's device, `rows_per_forward` rows at a time: the logits of more rows never exist
    at once, and only [rows, width] numbers reach the host. `chunk` > 0: the head and the
    loss `chunk` positions at a time (train.loss_chunk, model/loss.chunked_nll)."""
    device = next(model.parameters()).device
    out = torch.zeros((len(prompts), width), dtype=torch.float64)
    was_training = model.training
    model.eval()
    for lo in range(0, len(prompts), rows_per_forward):
        ps, cs = prompts[lo:lo + rows_per_forward], completions[lo:lo + rows_per_forward]
        length = max(len(p) + len(c) for p, c in zip(ps, cs))
        tokens = torch.full((len(ps), length), pad_id, dtype=torch.long)
        targets = torch.full((len(ps), length), IGNORE, dtype=torch.long)
        at = torch.zeros((len(ps), width), dtype=torch.long)  # where each completion token is a target
        for i, (p, c) in enumerate(zip(ps, cs)):
            tokens[i, :len(p) + len(c)] = torch.tensor(p + c)
            targets[i, len(p) - 1:len(p) - 1 + len(c)] = torch.tensor(c, dtype=torch.long)
            at[i] = (torch.arange(width) + len(p) - 1).clamp_max(length - 1)
        tokens, targets = tokens.to(device), targets.to(device)
        if chunk:
            head_fn = functools.partial(chunked_nll, nll=getattr(model, "nll", token_nll), targets=targets, chunk=chunk)
            nll = model(tokens, head_fn=head_fn).view(len(ps), length)
        else:
            nll = token_nll(model(tokens), targets).view(len(ps), length)
        logp = (-nll).gather(1, at.to(device)).double().cpu()
        valid = torch.arange(width)[None, :] < torch.tensor([len(c) for c in cs])[:, None]
        out[lo:lo + len(ps)] = logp.masked_fill(~valid, 0.0)
    model.train(was_training)
    return out


def generate_everywhere(model: nn.Module, layout: GenerationLayout, prompts: list[list[int]], seeds: list[int],
                        sampling: Sampling, stop_ids, pad_id: int,
                        score: Callable[[int, list[int]], tuple[float, float, float, float]],
                        reference: nn.Module | None = None, rows_per_forward: int = 8, chunk: int = 0) -> Generations:
    """Sample a completion for every prompt (row i with seed i) under the generation
    `layout`, scored by `score(i, completion)` → (reward, format, correct, error), every
    row on every rank. Collective (every rank calls it with the same arguments)."""
    n, width = len(prompts), sampling.max_new_tokens
    me, count = layout.ranks
    share = math.ceil(n / count)
    lo, hi = min(n, me * share), min(n, (me + 1) * share)
    cols = 3 * width + 2 + len(SCORE_FIELDS) + (width if reference is not None else 0) + 1
    mine = torch.zeros((share, cols), dtype=torch.float64)  # the last column: the share was cut short
    began = time.time()
    for a, b in sampling_batches(lo, hi, model.args.vocab_size):
        out = generate(model, prompts[a:b], width, sampling.temperature, sampling.top_k, sampling.top_p,
                       seeds[a:b], stop_ids, pad_id, should_stop=_stop_agreed_in(layout.tp),
                       limits=sampling.limits(prompts[a:b]))
        if out.interrupted:  # every rank of this tp group agreed: the gather tells the others
            mine[:, -1] = 1.0
            break
        rows, at = slice(a - lo, b - lo), 3 * width + 2
        mine[rows, :width] = out.token_ids.double()
        mine[rows, width:2 * width] = out.logprob_table
        mine[rows, 2 * width:3 * width] = out.entropy_table
        mine[rows, 3 * width] = out.lengths.double()
        mine[rows, 3 * width + 1] = torch.tensor(out.stopped, dtype=torch.float64)
        mine[rows, at:at + len(SCORE_FIELDS)] = torch.tensor([score(i, t) for i, t in zip(range(a, b), out.tokens)],
                                                             dtype=torch.float64)
        if reference is not None:
            mine[rows, cols - 1 - width:cols - 1] = completion_logprobs(reference, prompts[a:b], out.tokens, width,
                                                                        pad_id, rows_per_forward, chunk)
    sampled = time.time()
    rows = gather_rows(mine.to(layout.mesh.device), layout).cpu()
    if rows[:, -1].any():
        raise supervisor.Interrupted("a stop request cut the rollout short")
    rows = rows[:n]
    at = 3 * width + 2
    return Generations(
        tokens=rows[:, :width].long(), lengths=rows[:, 3 * width].long(), stopped=rows[:, 3 * width + 1] > 0,
        logprobs=rows[:, width:2 * width], entropies=rows[:, 2 * width:3 * width],
        ref_logprobs=rows[:, cols - 1 - width:cols - 1] if reference is not None else None,
        scores=rows[:, at:at + len(SCORE_FIELDS)], times=(began, sampled, time.time()))


def generate_in_segments(weights: Callable[[int], tuple[nn.Module, int]], segment: int, prompts: list[list[int]],
                         seeds: list[int], sampling: Sampling, stop_ids, pad_id: int,
                         score: Callable[[int, list[int]], tuple[float, float, float, float]],
                         reference: nn.Module | None = None, rows_per_forward: int = 8,
                         chunk: int = 0) -> Generations:
    """Partial rollouts (rl.partial_rollout = continue), on one process: every row's
    completion sampled `segment` new tokens at a time, segment j by the weights
    `weights(j)` = (model, version), which may be newer than the last segment's (a weight
    update interrupted the generation; `weights` may wait for them). A row's next segment
    continues its prompt and the tokens so far under the new weights (a fresh prefill: the
    old weights' cache is not reused), with the row's own random stream for that segment
    (its seed for segment 0, `segment_seed` after). Each token keeps the log-probability
    its own version gave it (the behaviour policy of that token) and that version
    (`versions`); the scores and the frozen reference's log-probabilities are the whole
    completion's, as `generate_everywhere` computes them."""
    n, width = len(prompts), sampling.max_new_tokens
    done = [[] for _ in range(n)]  # per row: (token, log p, entropy, version) so far
    stop_set, j = set(stop_ids), 0
    limits = sampling.limits(prompts) or [width] * n
    while True:
        active = [i for i in range(n) if len(done[i]) < limits[i] and not (done[i] and done[i][-1][0] in stop_set)]
        if not active:
            break
        model, version = weights(j)
        new = min(segment, width - j * segment)
        for a, b in sampling_batches(0, len(active), model.args.vocab_size):
            rows = active[a:b]
            out = generate(model, [prompts[i] + [t for t, *_ in done[i]] for i in rows], new, sampling.temperature,
                           sampling.top_k, sampling.top_p, [segment_seed(seeds[i], j) for i in rows], stop_ids, pad_id,
                           should_stop=supervisor.stop_requested, limits=[min(new, limits[i] - len(done[i])) for i in rows])
            if out.interrupted:
                raise supervisor.Interrupted("a stop request cut the rollout short")
            for i, toks, lps, ents in zip(rows, out.tokens, out.logprobs, out.entropies):
                done[i] += [(t, lp, e, version) for t, lp, e in zip(toks, lps, ents)]
        j += 1
    tokens = torch.full((n, width), pad_id, dtype=torch.long)
    versions = torch.zeros((n, width), dtype=torch.long)
    logprobs, entropies = torch.zeros((n, width), dtype=torch.float64), torch.zeros((n, width), dtype=torch.float64)
    for i, row in enumerate(done):
        if row:
            t, lp, e, v = zip(*row)
            tokens[i, :len(row)], versions[i, :len(row)] = torch.tensor(t), torch.tensor(v)
            logprobs[i, :len(row)], entropies[i, :len(row)] = torch.tensor(lp, dtype=torch.float64), torch.tensor(e)
    completions = [[t for t, *_ in row] for row in done]
    ref = (completion_logprobs(reference, prompts, completions, width, pad_id, rows_per_forward, chunk)
           if reference is not None else None)
    return Generations(tokens=tokens, lengths=torch.tensor([len(c) for c in completions]),
                       stopped=torch.tensor([bool(c) and c[-1] in stop_set for c in completions]),
                       logprobs=logprobs, entropies=entropies, ref_logprobs=ref,
                       scores=torch.tensor([score(i, c) for i, c in enumerate(completions)], dtype=torch.float64)
                       .view(n, len(SCORE_FIELDS)), versions=versions)


def segment_seed(seed: int, j: int) -> int:
    """A row's random stream for segment j of a partial rollout (its own seed for the first)."""
    return seed if j == 0 else zlib.crc32(f"{seed}/segment/{j}".encode())


def _stop_agreed_in(tp: Group) -> Callable[[], bool]:
    """Whether any rank of this generation tp group was asked to stop: they generate
    together, so they must end at the same token."""
    if not tp.active:
        return supervisor.stop_requested
    return lambda: all_reduce_scalars([float(supervisor.stop_requested())], tp)[0] > 0
