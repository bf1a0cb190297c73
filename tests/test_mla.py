"""Multi-head latent attention (model/mla.py, issue 35): generation's latent cache equals the
uncached forward, and holds the latent and the rotary key, not keys and values."""

import pytest
import torch

from ndtrain.model.args import PRESETS, kv_cache_elements_per_token
from ndtrain.model.llama import KVCache, Transformer

ARGS = PRESETS["deepseek-v3-tiny"].with_(mtp_depth=0)


def _model(args):
    torch.manual_seed(0)
    model = Transformer(args).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0, 0.2)
    return model


@pytest.mark.slow  # the default tier's budget (issue 35)
def test_the_latent_cache_equals_the_uncached_forward():
    """fp64: a prompt, then one token at a time through the cache, against one forward of
    the whole sequence; and two packed documents (doc_ids) the same way. Only summation
    order differs (1e-12)."""
    for interleave in (False, True):
        model = _model(ARGS.with_(rope_interleave=interleave))
        x = torch.randint(0, ARGS.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
        docs = torch.tensor([[0] * 25 + [1] * 15, [0] * 40])
        with torch.no_grad():
            for doc_ids in (None, docs):
                full = model(x, doc_ids=doc_ids)
                cache = KVCache(64)
                parts = [model(x[:, :17], cache=cache, doc_ids=None if doc_ids is None else doc_ids[:, :17])]
                for i in range(17, 40):
                    parts.append(model(x[:, i:i + 1], cache=cache,
                                       doc_ids=None if doc_ids is None else doc_ids[:, i:i + 1]))
                torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-12)


def test_the_cache_holds_the_latent_and_the_rotary_key():
    model = _model(ARGS)
    cache = KVCache(16)
    with torch.no_grad():
        model(torch.zeros((3, 5), dtype=torch.long), cache=cache)
    per_position = sum(t[0, 0].numel() for t in (*cache.k.values(), *cache.v.values()))
    assert per_position == kv_cache_elements_per_token(ARGS) == ARGS.n_layers * (32 + 8)
    gqa = ARGS.with_(attention="gqa", q_lora_rank=0, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0,
                     v_head_dim=0, head_dim=None)
    assert kv_cache_elements_per_token(gqa) == ARGS.n_layers * 2 * 4 * 16  # what the heads' K and V would hold
