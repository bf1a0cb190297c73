"""Autoregressive sampling with a KV cache, for the `generate` command and RL rollouts."""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor

from ..model.llama import KVCache, Transformer


def next_token(logits: Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """Pick a token from one position's logits [vocab]: the argmax when temperature is 0,
    else a draw from the softmax of logits/temperature restricted to the top_k (0: all)."""
    if temperature == 0:
        return int(logits.argmax())
    # On the CPU in fp32: the same seed draws the same token on any device and dtype.
    logits = logits.float().cpu() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def sample(model: Transformer, prompt_ids: list[int], max_new_tokens: int,
           temperature: float = 0.8, top_k: int = 50, seed: int = 0,
           eot_id: int | None = None, stop_ids: Collection[int] = ()) -> list[int]:
    """Continue `prompt_ids` by up to `max_new_tokens` tokens and return only the new ones,
    stopping after `eot_id` or any of `stop_ids` (which is included). The prompt is cut from the left so that
    prompt and continuation fit in the model's `max_seq_len`."""
    if not prompt_ids:
        raise ValueError("sample: prompt_ids is empty")
    if max_new_tokens <= 0:
        return []
    stops = set(stop_ids) | ({eot_id} if eot_id is not None else set())
    max_len = model.args.max_seq_len
    max_new_tokens = min(max_new_tokens, max_len)
    # The last new token is never fed back, so the cache holds prompt + max_new - 1 positions.
    prompt_ids = prompt_ids[-(max_len - max_new_tokens + 1):]

    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    cache = KVCache(max_len)
    was_training = model.training
    model.eval()
    try:
        tokens = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        new: list[int] = []
        while True:
            logits = model(tokens, cache=cache)[0, -1]
            token = next_token(logits, temperature, top_k, generator)
            new.append(token)
            if token in stops or len(new) == max_new_tokens:
                return new
            tokens = torch.tensor([[token]], dtype=torch.long, device=device)
    finally:
        model.train(was_training)
