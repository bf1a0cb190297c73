"""Three interop defects a check of the families, run as a user would, found (issue 35);
each test failed before its fix.

- Phi-3 longrope: a generation whose prompt is shorter than the original context and whose
  output runs past it re-encodes the whole sequence with the long factors at the crossing,
  as transformers' Phi-3 does; the per-step log-probabilities then equal transformers'
  (they parted by 0.05-0.09 when the cache kept keys rotated with the short factors).
- YaRN with max_position_embeddings equal to the original context (Qwen2.5): the model
  encodes factor × original positions, as transformers does; dynamic scaling has no end;
  and a prompt cut to fit says how many tokens it lost.
- The merged export of a LoRA run on a model with q/k/v biases (Qwen2) merges only the
  weights, and an export that fails leaves nothing in its output folder: in
  tests/test_lora.py's export test, whose model now has those biases.
"""

from __future__ import annotations


import pytest
import torch

from hf_helpers import ours_from

transformers = pytest.importorskip("transformers")

VOCAB = 320
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)


def hf_model(folder, model_type: str, **extra):
    """A tiny random model saved in `folder`, q and k sharpened ×4 so the rotary angles
    decide the logits."""
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "q_proj" in n or "k_proj" in n or "qkv_proj" in n:
                p.mul_(4)
    model.save_pretrained(folder)
    return model


def prompt(n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(5))


def test_longrope_generation_across_the_original_context_equals_transformers(tmp_path):
    from ndtrain.generate.sampler import generate, longrope_crossing

    original, width, new = 128, 120, 20
    theirs = hf_model(tmp_path, "phi3", max_position_embeddings=1024, original_max_position_embeddings=original,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                       "short_factor": [1.0 + i / 10 for i in range(8)],
                                       "long_factor": [1.0 + i / 2 for i in range(8)]})
    ours = ours_from(tmp_path)
    assert longrope_crossing(ours.args, width) == original - width + 1
    x = prompt(width)
    with torch.no_grad():
        out = theirs.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                              output_scores=True, return_dict_in_generate=True)
    their_tokens = out.sequences[0, width:].tolist()
    their_logp = [torch.log_softmax(s[0].double(), -1)[t].item() for s, t in zip(out.scores, their_tokens)]
    mine = generate(ours, x.tolist(), new, temperature=0.0)
    assert mine.tokens[0] == their_tokens
    # fp32 logits to ~1e-5 (the parity tests' bound); the defect moved them by 0.05-0.09
    assert max(abs(a - b) for a, b in zip(mine.logprobs[0], their_logp)) < 1e-4


def test_yarn_reaches_factor_times_the_original_context_and_dynamic_has_no_end(tmp_path):
    from ndtrain.model.rope import position_limit

    yarn = hf_model(tmp_path / "yarn", "qwen2", max_position_embeddings=128, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128})
    dynamic = hf_model(tmp_path / "dynamic", "llama", max_position_embeddings=64, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    x = prompt(300)  # past 128 (yarn's max_position_embeddings) and past 2 × 64 (dynamic's old cap)
    for folder, theirs, limit in ((tmp_path / "yarn", yarn, 512), (tmp_path / "dynamic", dynamic, None)):
        ours = ours_from(folder)
        assert position_limit(ours.args) == limit
        with torch.no_grad():
            torch.testing.assert_close(ours(x), theirs(input_ids=x).logits, atol=1e-5, rtol=1e-5)


def test_a_prompt_cut_to_fit_says_how_many_tokens_it_lost():
    from ndtrain.generate.sampler import sample
    from ndtrain.model.args import ModelArgs
    from ndtrain.model.llama import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=50,
                                  max_seq_len=16)).eval()
    lines = []
    out = sample(model, list(range(1, 21)), 4, temperature=0.0, report=lines.append)
    assert len(out) == 4
    assert lines == ["the prompt's first 7 of 20 tokens were dropped: with 4 new tokens it must fit in the 16 "
                     "positions the model encodes"]
    lines.clear()
    sample(model, list(range(1, 14)), 4, temperature=0.0, report=lines.append)
    assert lines == []  # 13 + 4 - 1 = 16 positions fit
