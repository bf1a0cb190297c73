"""Logit parity with Hugging Face MoE models built by transformers from a config (no
download): a tiny random Mixtral, loaded into our decoder, gives the same logits within
1e-5 in fp32.

The conversion here is the test's own until the HF converter (model/hf.py) carries the MoE
names: transformers 5 keeps each block's experts stacked, `mlp.experts.gate_up_proj`
[E, 2F, D] (gate rows first) and `mlp.experts.down_proj` [E, D, F], and the router as
`mlp.gate.weight` [E, D]; ours are `feed_forward.experts.{w1, w3, w2}` and
`feed_forward.router.weight`.
"""

import pytest
import torch

from ndtrain.model import ModelArgs, Transformer

transformers = pytest.importorskip("transformers")

_BLOCK = {
    "self_attn.q_proj.weight": "attention.wq.weight", "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight", "self_attn.o_proj.weight": "attention.wo.weight",
    "input_layernorm.weight": "attention_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "feed_forward.router.weight", "mlp.experts.down_proj": "feed_forward.experts.w2",
}
_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight"}


def ours_from_hf(hf_state: dict) -> dict:
    out = {}
    for name, t in hf_state.items():
        if name in _TOP:
            out[_TOP[name]] = t
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":
            out[f"layers.{layer}.feed_forward.experts.w1"], out[f"layers.{layer}.feed_forward.experts.w3"] = t.chunk(2, 1)
        else:
            out[f"layers.{layer}.{_BLOCK[rest]}"] = t
    return out


def mixtral(experts=4, top_k=2):
    config = transformers.AutoConfig.for_model(
        "mixtral", vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, num_local_experts=experts, num_experts_per_tok=top_k,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # routers with clear preferences: no near-tie can flip between implementations
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.3)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=256, max_seq_len=128,
                     moe_experts=experts, moe_top_k=top_k, moe_ffn_dim=48, moe_router="softmax_topk",
                     moe_norm_topk=True)
    return model, args


def test_mixtral_logits_match():
    hf, args = mixtral()
    ours = Transformer(args)
    ours.load_state_dict(ours_from_hf(hf.state_dict()), strict=False)
    missing = {n for n, _ in ours.named_parameters()} - set(ours_from_hf(hf.state_dict()))
    assert not missing
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: logits.append(out[0]))
             for layer in hf.model.layers]
    with torch.no_grad():
        theirs = hf(tokens).logits
        mine = ours.eval()(tokens)
    for h in hooks:
        h.remove()
    for router in logits:  # every token's k-th and (k+1)-th router logits stand apart
        ranked = router.sort(-1, descending=True).values
        assert (ranked[:, args.moe_top_k - 1] - ranked[:, args.moe_top_k]).min() > 1e-2
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
