"""gpt_oss, gemma3_text and olmo2 in and out of Hugging Face (issue 35). `transformers`
builds a tiny random model of each from its config class (no download), eager attention
(gpt-oss's sinks and Gemma's reference), every bias, sink and norm randomised (HF starts them
at 0 or 1, which would hide a wrong mapping); we read the folder.

- Our logits equal transformers' within 1e-5 (fp32) at 160 positions: past the original
  context of gpt-oss's YaRN (32) and many windows of 8 (gpt-oss: every other layer; Gemma 3:
  five of six, with their own rotary base, the global ones linearly scaled); greedy
  generation picks the tokens HF's `generate` picks (our KV cache against theirs).
- `convert --from-hf` then `--to-hf` gives back every tensor bit for bit (gpt-oss: gate and
  up re-interleaved, the matrices transposed back) and a config transformers builds the same
  model from; a gpt-oss export says which format the experts are written in.
- OpenAI's MXFP4 experts (`*_blocks`, `*_scales`) are dequantized on import to exactly what
  transformers' own dequantization gives (`convert_moe_packed_tensors`), and the model reads
  like the HF model holding those values; the export writes them unquantized, with no
  quantization_config.
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_helpers import ours_from, parity_and_round_trip

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, PROMPT, NEW = 96, 160, 60, 6
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        num_hidden_layers=7, sliding_window=8, query_pre_attn_scalar=24, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, dict(
        num_hidden_layers=2, head_dim=None, rope_parameters={"rope_type": "default", "rope_theta": 20000.0})),
}
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
              max_position_embeddings=256, swiglu_limit=2.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})


def make_gpt_oss(folder):
    config = transformers.GptOssConfig(**CONFIG)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM._from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
            elif "norm" in n:
                p.uniform_(0.5, 1.5)
            elif "q_proj" in n or "k_proj" in n:
                p.mul_(4)
            elif "experts" in n:
                p.normal_(0, 0.3)  # the clamp (limit 2) binds for some gates and ups
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def hf_gpt_oss(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss") / "model"
    return folder, make_gpt_oss(folder)


def tokens(n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(3))


def test_gpt_oss_logits_generation_and_round_trip(hf_gpt_oss, tmp_path, capsys):
    folder, theirs = hf_gpt_oss
    ours = ours_from(folder)
    a = ours.args
    assert (a.attn_sinks, a.o_bias, a.qkv_bias, a.moe_router_bias, a.moe_expert_bias, a.moe_swiglu_limit) == \
        (True, True, True, True, True, 2.0)
    assert (a.sliding_window, a.window_layers, a.moe_router, a.moe_experts, a.moe_top_k) == (8, (0,), "topk_softmax", 4, 2)
    assert json.loads(a.rope_scaling)["rope_type"] == "yarn"
    said = parity_and_round_trip(folder, theirs, ours, tmp_path, capsys, tokens(PROMPT), tokens(SEQ), NEW)
    assert "experts are written unquantized, as float32 gate_up_proj and down_proj (not MXFP4)" in said, said


def make_family(folder, name: str):
    config_class, model_class, extra = FAMILIES[name]
    config = config_class(**{k: v for k, v in {**BASE, **extra}.items() if v is not None})  # None: not a key of it
    torch.manual_seed(0)
    model = model_class._from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(-0.5, 0.5) if name.startswith("gemma") else p.uniform_(0.5, 1.5)
            elif "q_proj" in n or "k_proj" in n:
                p.mul_(4)
    model.save_pretrained(folder)
    return model


@pytest.mark.slow  # the default tier's budget: gpt_oss's parity above is the acceptance's
@pytest.mark.parametrize("name", FAMILIES)
def test_family_logits_generation_and_round_trip(name, tmp_path, capsys):
    theirs = make_family(tmp_path / "model", name)
    ours = ours_from(tmp_path / "model")
    if name == "gemma3_text":
        a = ours.args
        assert (a.rope_local_theta, a.rope_theta, a.window_layers, a.qk_norm, a.norm_offset) == \
            (500.0, 50000.0, (0, 1, 2, 3, 4, 6), True, 1.0)
        assert json.loads(a.rope_scaling) == {"rope_type": "linear", "factor": 4.0}
    if name == "olmo2":
        a = ours.args
        assert (a.qk_norm, a.qk_norm_all, a.pre_norm, a.sandwich_norm, a.rope_theta) == (True, True, False, True, 2e4)
    parity_and_round_trip(tmp_path / "model", theirs, ours, tmp_path, capsys, tokens(PROMPT), tokens(SEQ), NEW)


def _quantize(t: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks and scales of a matrix shaped like `t` [E, cols, rows] (x·W)."""
    e, cols, rows = t.shape
    blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.int64).to(torch.uint8)
    scales = torch.randint(122, 130, (e, rows, cols // 32), generator=g, dtype=torch.int64).to(torch.uint8)
    return blocks, scales


def test_mxfp4_experts_are_dequantized_on_import_and_exported_unquantized(hf_gpt_oss, tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from ndtrain.cli import main

    folder, theirs = hf_gpt_oss
    tensors = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    quantized, dequantized = dict(tensors), {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _quantize(tensors[name], g)
        del quantized[name]
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # transformers' own
        assert dequantized[name].shape == tensors[name].shape
    mx = tmp_path / "mxfp4"
    mx.mkdir()
    save_file(quantized, mx / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (mx / "config.json").write_text(json.dumps(config))

    ours = ours_from(mx)
    state = dict(theirs.state_dict())
    state.update(dequantized)
    reference = transformers.GptOssForCausalLM._from_config(theirs.config, attn_implementation="eager").float().eval()
    reference.load_state_dict(state)
    x = tokens(SEQ)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference(input_ids=x).logits, atol=1e-5, rtol=1e-5)

    run, out = tmp_path / "run", tmp_path / "out"
    assert main(["convert", "--from-hf", str(mx), "--to", str(run)]) == 0
    assert main(["convert", "--to-hf", str(run), "--out", str(out), "--dtype", "bf16"]) == 0
    assert "as bfloat16 gate_up_proj and down_proj (not MXFP4)" in capsys.readouterr().err
    exported = load_file(out / "model.safetensors")
    for name, t in dequantized.items():  # e2m1 × 2^k: exact in bf16
        assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name].float(), t), name
    assert not any(n.endswith(("_blocks", "_scales")) for n in exported)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_mxfp4_without_its_scales_is_refused(hf_gpt_oss, tmp_path):
    from safetensors.torch import load_file, save_file

    from ndtrain.cli import main

    folder, _ = hf_gpt_oss
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj"
    tensors[name + "_blocks"] = _quantize(tensors.pop(name), torch.Generator().manual_seed(0))[0]
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    (bad / "config.json").write_text((folder / "config.json").read_text())
    assert main(["convert", "--from-hf", str(bad), "--to", str(tmp_path / "run")]) == 2
    assert not (tmp_path / "run").exists()
