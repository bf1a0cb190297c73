"""Autoregressive sampling with a KV cache, for the `generate` command and RL rollouts.

`generate` continues a batch of prompts of different lengths at once. The prompts are
left-padded to one length; the padding is a document of its own (`doc_ids` 0, the prompt
and its continuation 1), so no token ever attends to it (model/llama.KVCache keeps each
cached position's document), and every row's positions start at 0 at its first real
token, as they would if it were alone. One forward reads the prompts (prefill), then one
forward per new token reads only that token.

Each row draws from its own random stream (`seeds`), by inverse transform sampling: a
uniform number u from the row's generator, and the first token whose cumulative
probability exceeds u. A row's continuation therefore depends on its prompt and its seed,
never on which other rows share its batch or on which rank generates it. Each row's numbers
for every step are drawn before the first step, in one go (the same numbers, in the same
order, whatever the batch). What a row records besides its tokens: the log-probability of
each under the model *without* temperature or filtering (the policy RL trains: it equals
what a training forward computes), and the entropy of that distribution.

Everything a step computes stays on the device: the host reads one boolean per step
(whether any row is still running, to stop early), and the rows' tokens, log-probabilities
and entropies once, at the end.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..model.llama import KVCache, widened
from ..model.rope import position_limit, scaling_of


@dataclass
class Generated:
    tokens: list[list[int]]  # the new tokens of each row, its stop token included if it stopped
    logprobs: list[list[float]]  # log p of each new token under the untempered, unfiltered model
    entropies: list[list[float]]  # entropy (nats) of the model's distribution at each new token
    stopped: list[bool]  # the row ended with a stop token (else it ran to max_new_tokens)
    # The same as tensors on the host, [b, max_new_tokens] (pad_id, 0 after a row's length):
    token_ids: Tensor | None = None
    lengths: Tensor | None = None  # [b]
    logprob_table: Tensor | None = None  # fp64
    entropy_table: Tensor | None = None  # fp64
    interrupted: bool = False  # `should_stop` ended the generation early: the rows are unfinished


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Logits [b, V] with −inf outside each row's `top_k` largest (0: all) and outside the
    smallest set of largest-probability tokens whose probabilities add up to `top_p`
    (the most likely token always stays)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, index = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens ranked above
        drop = before >= top_p
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(-1, index, drop), float("-inf"))
    return logits


def draw(logits: Tensor, temperature: float, top_k: int, top_p: float, u: Tensor | None) -> Tensor:
    """One token per row of `logits` [b, V]: the argmax when temperature is 0, else a draw
    from softmax(filtered logits / temperature) with each row's uniform number `u` [b]
    (fp64, on the logits' device)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filter_logits(widened(logits) / temperature, top_k, top_p), dim=-1)
    cdf = torch.cumsum(probs.double(), dim=-1)
    token = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
    return token.clamp_max(logits.shape[-1] - 1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """tokens, positions and doc_ids [b, P] of prompts left-padded to the longest, P."""
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    doc_ids = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if len(p):
            tokens[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            doc_ids[i, width - len(p):] = 1
    pad = torch.tensor([width - len(p) for p in prompts])
    positions = (torch.arange(width)[None, :] - pad[:, None]).clamp_min(0)
    return tokens.to(device), positions.to(device), doc_ids.to(device)


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, seeds: Sequence[int] | None = None,
             stop_ids: Collection[int] = (), pad_id: int = 0, use_cache: bool = True,
             should_stop: Callable[[], bool] | None = None, limits: Sequence[int] | None = None) -> Generated:
    """Continue every prompt by up to `max_new_tokens` tokens, a row ending after any of
    `stop_ids`. `model(tokens, positions=, cache=, doc_ids=)` returns logits [b, s, V] (a
    `Transformer`, or a tensor-parallel one that gathers its vocabulary); `seeds`: one per
    row (default: the row's index). Prompt plus continuation must fit in
    `model.args.max_seq_len`. `use_cache=False` recomputes every position at every step
    (the same tokens, for `ndtrain bench generate`). `should_stop()`, asked after every
    token, ends the generation early with `interrupted` set (a stop request during an RL
    rollout; it must answer alike on every rank of a tensor-parallel model). `limits`: each
    row's own largest number of new tokens (at most `max_new_tokens`; a row cut there did
    not stop)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    seeds = list(range(len(prompts))) if seeds is None else list(seeds)
    if len(seeds) != len(prompts):
        raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
    width, limit = max(len(p) for p in prompts), position_limit(model.args)
    if limit is not None and width + max_new_tokens - 1 > limit:
        raise ValueError(f"generate: prompts of up to {width} tokens and {max_new_tokens} new ones exceed the "
                         f"{limit} positions the model encodes")
    device = next(model.parameters()).device
    b = len(prompts)
    if max_new_tokens <= 0:
        return Generated([[] for _ in range(b)], [[] for _ in range(b)], [[] for _ in range(b)], [False] * b)
    u = None
    if temperature != 0:  # every row's numbers for every step, from its own stream
        u = torch.stack([torch.rand(max_new_tokens, generator=torch.Generator().manual_seed(int(s)),
                                    dtype=torch.float64) for s in seeds]).to(device)
    stops = torch.tensor(sorted(set(stop_ids)) or [-1], device=device)
    was_training = model.training
    model.eval()
    try:
        *table, interrupted = _sample(model, prompts, max_new_tokens, temperature, top_k, top_p, u, stops, pad_id,
                                      use_cache, device, should_stop,
                                      None if limits is None else torch.tensor(list(limits), device=device))
    finally:
        model.train(was_training)
    token_ids, logprobs, entropies, lengths = (t.cpu() for t in table)  # the one transfer of the results
    stop_set = set(stop_ids)
    tokens = [row[:n] for row, n in zip(token_ids.tolist(), lengths.tolist())]
    return Generated(tokens, [logprobs[i, :len(t)].tolist() for i, t in enumerate(tokens)],
                     [entropies[i, :len(t)].tolist() for i, t in enumerate(tokens)],
                     [bool(t) and t[-1] in stop_set for t in tokens], token_ids, lengths, logprobs, entropies,
                     interrupted)


def _sample(model, prompts, max_new_tokens: int, temperature: float, top_k: int, top_p: float, u: Tensor | None,
            stops: Tensor, pad_id: int, use_cache: bool, device,
            should_stop=None, limits: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
    """The decoding loop on the device: tokens [b, M], their log-probabilities and the
    entropies [b, M] (fp64), each row's length [b], and whether `should_stop` ended it."""
    b, width = len(prompts), max(len(p) for p in prompts)
    cache = KVCache(width + max_new_tokens) if use_cache else None
    # The loop step whose forward first reaches past a longrope model's original context
    # (its longest position is width + step): there the cache's keys, rotated with the short
    # factors, are dropped and the whole sequence is encoded again with the long ones, as
    # transformers' Phi-3 does; None: no such step.
    reencode = longrope_crossing(model.args, width) if use_cache else None
    tokens, positions, doc_ids = left_pad(prompts, pad_id, device)
    seen = (tokens, positions, doc_ids)  # without a cache: everything so far, every step
    next_pos = positions[:, -1] + 1
    out_tokens = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=device)
    out_logp = torch.zeros((b, max_new_tokens), dtype=torch.float64, device=device)
    out_entropy = torch.zeros_like(out_logp)
    lengths = torch.zeros(b, dtype=torch.long, device=device)
    running = torch.ones(b, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        logits = widened(model(tokens, positions=positions, cache=cache, doc_ids=doc_ids, last=True)[:, -1])
        token = draw(logits, temperature, top_k, top_p, u[:, step] if u is not None else None)
        logp = torch.log_softmax(logits, dim=-1)
        out_tokens[:, step] = token.masked_fill(~running, pad_id)
        out_logp[:, step] = logp.gather(-1, token[:, None]).squeeze(-1).double().masked_fill(~running, 0.0)
        out_entropy[:, step] = (-(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)).double().masked_fill(~running, 0.0)
        lengths += running.long()
        running &= ~torch.isin(token, stops)
        if limits is not None:
            running &= lengths < limits
        if step == max_new_tokens - 1 or not bool(running.any()):  # the host's one read of this step
            break
        if should_stop is not None and should_stop():
            return out_tokens, out_logp, out_entropy, lengths, True
        tokens = token.masked_fill(~running, pad_id)[:, None]
        positions, doc_ids = next_pos[:, None], torch.ones_like(tokens)
        next_pos = next_pos + 1
        if cache is None or reencode is not None:
            seen = tuple(torch.cat([old, new], dim=1) for old, new in zip(seen, (tokens, positions, doc_ids)))
        if cache is None or step + 1 == reencode:
            tokens, positions, doc_ids = seen
            if cache is not None:
                cache = KVCache(width + max_new_tokens)
    return out_tokens, out_logp, out_entropy, lengths, False


def longrope_crossing(args, width: int) -> int | None:
    """The decoding step (≥ 1) of prompts `width` wide whose forward is the first to hold a
    position beyond a longrope model's original context; None for other scalings or when the
    prompt's own forward already does."""
    p = scaling_of(args.rope_scaling)
    if p["rope_type"] != "longrope":
        return None
    step = p["original_max_position_embeddings"] - width + 1
    return step if step >= 1 else None


def sample(model, prompt_ids: list[int], max_new_tokens: int,
           temperature: float = 0.8, top_k: int = 50, seed: int = 0,
           eot_id: int | None = None, stop_ids: Collection[int] = (), top_p: float = 1.0,
           report: Callable[[str], None] | None = None) -> list[int]:
    """Continue one prompt by up to `max_new_tokens` tokens and return only the new ones,
    stopping after `eot_id` or any of `stop_ids` (which is included). A prompt too long for
    the positions the model encodes (`position_limit`) loses its first tokens, and
    `report` (default: a warning) gets one line saying how many."""
    if not prompt_ids:
        raise ValueError("sample: prompt_ids is empty")
    if max_new_tokens <= 0:
        return []
    stops = set(stop_ids) | ({eot_id} if eot_id is not None else set())
    limit = position_limit(model.args)
    if limit is not None:
        max_new_tokens = min(max_new_tokens, limit)
        # The last new token is never fed back, so the cache holds prompt + max_new - 1 positions.
        keep = limit - max_new_tokens + 1
        if len(prompt_ids) > keep:
            line = (f"the prompt's first {len(prompt_ids) - keep} of {len(prompt_ids)} tokens were dropped: with "
                    f"{max_new_tokens} new tokens it must fit in the {limit} positions the model encodes")
            (report or (lambda m: warnings.warn(m, stacklevel=3)))(line)
            prompt_ids = prompt_ids[-keep:]
    return generate(model, [prompt_ids], max_new_tokens, temperature, top_k, top_p, [seed], stops).tokens[0]
