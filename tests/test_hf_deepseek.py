"""DeepSeek-V3 in and out of Hugging Face (issue 35): `transformers` builds a tiny random
deepseek_v3 model (latent attention with a low-rank query and interleaved rotary pairs,
sigmoid routing over 8 experts in 4 groups, 2 chosen, with a nonzero selection bias, a shared
expert, the first block dense) and saves it; we read it.

In fp32, against transformers:
- our logits equal theirs within 1e-5 at 256 positions;
- greedy generation picks the tokens theirs picks (our latent cache against their cache);
- `convert --from-hf` then `--to-hf` gives back every tensor bit for bit (the router bias
  too), and a config from which transformers builds the same model.
A Kimi K2 config (model_type kimi_k2, DeepSeek-V3's keys) reads as the same model (the
default tier; the rest, which builds transformers models, under -m slow).
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_helpers import ours_from, parity_and_round_trip

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, PROMPT, NEW = 320, 256, 100, 6
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
              routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16,
              qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
              max_position_embeddings=1024, num_mtp_layers=0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
VARIANTS = {
    "lora-query": {},
    # no query bottleneck, half-split rotary, YaRN with DeepSeek's mscale_all_dim (the softmax scale)
    "direct-query-yarn": dict(q_lora_rank=None, rope_interleave=False, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
}


def make(folder, extra):
    config = transformers.DeepseekV3Config(**{**CONFIG, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif "q_" in n or "kv_a" in n:
                p.mul_(4)  # sharper scores: the rotary angles decide the logits
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.uniform_(-0.2, 0.2)  # nonzero: a bias left behind changes the experts chosen
    model.save_pretrained(folder)
    return model


def tokens(n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(3))


@pytest.mark.slow  # transformers models: the slow tier (the default tier's budget, issue 35)
@pytest.mark.parametrize("name", VARIANTS)
def test_deepseek_v3_logits_generation_and_round_trip(name, tmp_path, capsys):
    folder = tmp_path / "hf"
    theirs = make(folder, VARIANTS[name])
    ours = ours_from(folder)
    a = ours.args
    assert (a.attention, a.moe_groups, a.moe_topk_groups, a.first_k_dense, a.moe_route_scale) == ("mla", 4, 2, 1, 2.5)
    assert ours.layers["1"].feed_forward.router.expert_bias.abs().max() > 0

    parity_and_round_trip(folder, theirs, ours, tmp_path, capsys, tokens(PROMPT), tokens(SEQ), NEW)


def test_kimi_k2_config_reads_as_deepseek_v3():
    from ndtrain.model.hf_config import args_from_hf_config
    config = transformers.DeepseekV3Config(**CONFIG).to_dict()
    kimi = {**config, "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}
    assert args_from_hf_config(kimi) == args_from_hf_config(config)


def _mtp_checkpoint(folder, main, mtp):
    """DeepSeek-V3's checkpoint layout of a transformers MtpModel (which transformers' own
    save_pretrained drops): layer n_layers holds enorm, hnorm, eh_proj, shared_head.norm, the
    block under the decoder's names (experts one tensor each), and copies of the embedding
    and head."""
    from safetensors.torch import load_file, save_file
    n = main.config.num_hidden_layers
    state = load_file(folder / "model.safetensors")
    prefix = f"model.layers.{n}."
    for name, t in mtp.named_parameters():
        if not name.startswith("layers.0."):
            continue
        name = name[len("layers.0."):].replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        if name.endswith("experts.gate_up_proj"):
            f = t.shape[1] // 2
            for j in range(t.shape[0]):
                state[f"{prefix}mlp.experts.{j}.gate_proj.weight"] = t[j, :f].detach().clone()
                state[f"{prefix}mlp.experts.{j}.up_proj.weight"] = t[j, f:].detach().clone()
        elif name.endswith("experts.down_proj"):
            for j in range(t.shape[0]):
                state[f"{prefix}mlp.experts.{j}.down_proj.weight"] = t[j].detach().clone()
        else:
            state[prefix + name] = t.detach().clone()
    for name, b in mtp.named_buffers():
        if name.endswith("e_score_correction_bias"):
            state[f"{prefix}mlp.gate.e_score_correction_bias"] = b.detach().clone()
    state[f"{prefix}embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state[f"{prefix}shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.slow
def test_deepseek_v3_mtp_layer_is_read_predicts_like_transformers_and_is_written_back(tmp_path, capsys):
    """The MTP module transformers' model drops on load: read from layer n_layers, its
    predictions equal transformers' MtpModel's (fp32, 1e-5) on h⁰ = the main model's normed
    last hidden state, and `--to-hf` writes the layer back bit for bit."""
    from safetensors.torch import load_file
    from transformers.modeling_layers import MtpModel

    from ndtrain.cli import main as cli
    from ndtrain.model.mtp import predict

    folder = tmp_path / "hf"
    theirs = make(folder, dict(num_mtp_layers=1))
    torch.manual_seed(1)
    mtp = MtpModel(theirs, 1).float().eval()
    with torch.no_grad():
        for n, p in mtp.named_parameters():  # (transformers leaves its experts uninitialised)
            if n.startswith("layers."):
                p.uniform_(0.5, 1.5) if "norm" in n else p.normal_(0, 0.1)
        for n, b in mtp.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.uniform_(-0.2, 0.2)
    _mtp_checkpoint(folder, theirs, mtp)
    ours = ours_from(folder)
    assert ours.args.mtp_depth == 1

    x = tokens(64)
    with torch.no_grad():
        h = theirs.model(input_ids=x).last_hidden_state
        hd = mtp.forward_layer(0, h[:, :-1], torch.arange(1, 64)[None], None, input_ids=x[:, 1:])
        expected = mtp._project_to_logits(hd)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(predict(ours, x)[0][:, :-1], expected, atol=1e-5, rtol=1e-5)

    run, out = tmp_path / "run", tmp_path / "out"
    assert cli(["convert", "--from-hf", str(folder), "--to", str(run)]) == 0
    assert cli(["convert", "--to-hf", str(run), "--out", str(out)]) == 0
    capsys.readouterr()
    original, exported = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert original.keys() == exported.keys()
    for key, t in original.items():
        assert t.dtype == exported[key].dtype and torch.equal(t, exported[key]), key
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1


@pytest.mark.slow
def test_a_transformers_saved_deepseek_v3_without_its_mtp_layer_loads_without_mtp(tmp_path):
    folder = tmp_path / "hf"
    make(folder, dict(num_mtp_layers=1))  # config.json counts one MTP layer; the weights have none
    assert ours_from(folder).args.mtp_depth == 0
