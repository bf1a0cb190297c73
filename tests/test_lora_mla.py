"""LoRA on multi-head latent attention (issue 35): adapters on wq_a, wq_b, wkv_a, wkv_b and wo
(the default targets wq, wk, wv, wo read as MLA's query and key-value projections:
model/args.py `lora_layers`), in the main blocks and the MTP module's, and the merged model
(model/lora.py `merged`: W + scale·B·A) gives the adapted model's logits and MTP logits in
fp64."""

import pytest
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


DS_LORA = ["model.preset=deepseek-v3-tiny", "train.moe_aux_loss=0.01", "lora.rank=4", "lora.alpha=8",
           "lora.init=random", "train.micro_batch=2"]
LAYOUTS = [("tp2-sp", ["parallel.tp=2"]), ("pp2-1f1b", ["parallel.pp=2"]), ("cp2-ring", ["parallel.cp=2"])]


def _lora_runs(data_dir, rows):
    from helpers import proof_in_rank, reference_in_rank
    return {name: (reference_in_rank if name == "single" else proof_in_rank)(DS_LORA + o, data_dir) for name, o in rows}


@pytest.mark.slow
def test_lora_on_latent_attention_layouts_equal_one_process(tiny_data):
    """The adapters of MLA's projections (tp: the down-projections' adapters whole on every
    rank, their gradients partial; the up-projections' split with their base) and of the
    MTP block, under tp2 + sp, pp2 and cp2, against one process in fp64."""
    from helpers import assert_proof
    from ndtrain.testing import run_ranks
    ref = run_ranks(_lora_runs, 1, tiny_data, [("single", [])])[0]["single"]
    assert any(".attention.wq_a.lora." in k for k in ref["grads"]) and any(k.startswith("mtp.") for k in ref["grads"])
    for name, proof in run_ranks(_lora_runs, 2, tiny_data, LAYOUTS, timeout=900)[0].items():
        try:
            assert_proof(proof, ref)
        except AssertionError as e:
            raise AssertionError(f"LoRA on MLA {name}: {e}") from None
