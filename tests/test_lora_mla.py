"""LoRA on multi-head latent attention (issue 35): adapters on wq_a, wq_b, wkv_a, wkv_b and wo
(the default targets wq, wk, wv, wo read as MLA's query and key-value projections:
model/args.py `lora_layers`), in the main blocks and the MTP module's, and the merged model
(model/lora.py `merged`: W + scale·B·A) gives the adapted model's logits and MTP logits in
fp64."""

import torch

from ndtrain.model.args import PRESETS, lora_layers
from ndtrain.model.llama import Transformer
from ndtrain.model.lora import LoRALinear, is_adapter, merged
from ndtrain.model.mtp import predict

BASE = PRESETS["deepseek-v3-tiny"].with_(vocab_size=64, max_seq_len=16, mtp_depth=1)
LORA = BASE.with_(lora_rank=4, lora_alpha=8.0, lora_targets=("wq", "wk", "wv", "wo", "w1", "w2", "w3"),
                  lora_init="random")


def test_mla_targets_resolve_to_its_projections():
    assert lora_layers(LORA) == ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "w1", "w2", "w3")
    assert lora_layers(LORA.with_(q_lora_rank=0, lora_targets=("wq", "wkv_b"))) == ("wq", "wkv_b")


def test_lora_on_latent_attention_equals_the_merged_model(one_thread):
    torch.manual_seed(0)
    model = Transformer(LORA).double()
    with torch.no_grad():
        for name, p in model.named_parameters():  # B ≠ 0: the adapters act
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0, 0.1)
    adapted = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    for block in ["layers.0", "layers.3", "mtp.0.block"]:
        assert {f"{block}.attention.{x}" for x in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")} <= adapted
    assert "layers.0.feed_forward.w1" in adapted  # the dense first block's MLP
    plain = Transformer(BASE).double()
    plain.load_state_dict(merged(model.state_dict(), LORA.lora_alpha / LORA.lora_rank))
    tokens = torch.randint(0, BASE.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), plain(tokens)
        base = Transformer(BASE).double()
        base.load_state_dict({k: v for k, v in model.state_dict().items() if not is_adapter(k)})
        assert (ours - base(tokens)).abs().max() > 1e-3  # the adapters act
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    for a, b in zip(predict(model, tokens), predict(plain, tokens)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
