"""Hugging Face MoE models in and out: `transformers` builds tiny random Mixtral and
Qwen3-MoE models from a config (no download) and saves them; the HF converter
(model/hf.py: one HF tensor per expert is one piece of our stack, checkpoint/sources.py)
loads them into our decoder, whose logits equal theirs within 1e-5 in fp32. The way back,
`hf_names`, names every HF tensor exactly once."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

E, K = 4, 2
FAMILIES = {
    # windows of 8 over 24 tokens (issue 22: a window on every layer)
    "mixtral": dict(num_local_experts=E, num_experts_per_tok=K, intermediate_size=48, sliding_window=8),
    "qwen3_moe": dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=48, intermediate_size=96,
                      norm_topk_prob=True, decoder_sparse_step=1, head_dim=24, use_sliding_window=True,
                      sliding_window=8),
}


def hf_model(folder, family):
    """Saved; routers with clear preferences (no near-tie can flip between two
    implementations), norm weights randomised (HF starts them at 1, hiding a wrong map)."""
    config = transformers.AutoConfig.for_model(
        family, vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        **FAMILIES[family])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.3)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_moe_logits_match_through_the_converter(family, tmp_path):
    from ndtrain.checkpoint.layout import load_model
    from ndtrain.checkpoint.sources import HFSource
    from ndtrain.model import hf
    from ndtrain.model.llama import Transformer

    theirs = hf_model(tmp_path, family)
    source = HFSource(tmp_path)
    args = source.args
    assert (args.moe_experts, args.moe_top_k, args.moe_norm_topk, args.expert_dim) == (E, K, True, 48)
    assert (args.sliding_window, args.window_layers) == (8, None)
    ours = Transformer(args).eval()
    load_model(source, ours)
    names = [n for p, _ in ours.named_parameters() for n, _ in hf.hf_names(p, args)]
    assert sorted(names) == sorted(theirs_on_disk(tmp_path)) and len(set(names)) == len(names)

    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: logits.append(out[0]))
             for layer in theirs.model.layers]
    with torch.no_grad():
        expected = theirs(tokens).logits
        mine = ours(tokens)
    for h in hooks:
        h.remove()
    for router in logits:  # every token's k-th and (k+1)-th router logits stand apart
        ranked = router.sort(-1, descending=True).values
        assert (ranked[:, K - 1] - ranked[:, K]).min() > 1e-3  # ~1000× the fp32 gap between the two
    torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-5)


def theirs_on_disk(folder):
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return list(f.keys())
