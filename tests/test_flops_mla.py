"""DeepSeek-V3's FLOPs (issue 35): `flops_per_token` for multi-head latent attention and
multi-token prediction against torch's FlopCounterMode over one forward and backward of the
deepseek-v3-tiny preset (MLA with a low-rank query, value width 16 < query·key width 24, a
dense first block, sigmoid group-limited MoE with a shared expert, two MTP modules), the
method of tests/test_flops.py: what the counter does not see is derived term by term, never
fitted, so formula − counted = `unseen` is an identity:
- the parameters N keeps that no matmul runs: every norm's weight (the blocks', the final
  one, the latent norms q_a_norm and kv_a_norm, each MTP module's three), 6 each;
- the attention convention (tests/test_flops.py `unseen`): the formula prices a query at the
  visible area s/2, the kernels compute every visible pair, Σᵢ (i + 1)/s per query;
- latent attention's zero-padded values (model/mla.py): the fused op runs AV at the
  query·key width, the formula prices it at the value width (model FLOPs, not the padding's).
Per visible pair and head, QKᵀ costs 2·qk forward and 4·qk backward, AV 2·v and 4·v.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ndtrain.data.batch import MicroBatch
from ndtrain.model.args import PRESETS, flops_per_token
from ndtrain.model.llama import AttentionCore, Transformer, apply_rope
from ndtrain.model.lora import freeze_base
from ndtrain.model.moe import RoutingLog
from ndtrain.model.mtp import MTPStep

B, S = 1, 32
DS = PRESETS["deepseek-v3-tiny"].with_(vocab_size=96, max_seq_len=S, mtp_depth=2)
# LoRA on latent attention's projections and the dense MLP (model/args.py lora_layers): a frozen
# base (4·N), the adapters (6 per parameter), no gradient for the first block's wq_a and wkv_a
LORA = DS.with_(lora_rank=4, lora_alpha=8.0, lora_targets=("wq", "wk", "wv", "wo", "w1", "w2", "w3"))


def visible_keys_attention(self, q, k, v, cos, sin, cache=None, layer_key=None, doc_ids=None, sinks=None):
    """AttentionCore's computation with each query times only the keys it sees (causal); q
    and k rotated here only where the core rotates (latent attention rotates before it)."""
    b, s = q.shape[:2]
    if self.rotate:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = []
    for i in range(s):
        scores = (q[:, :, i:i + 1] @ k[:, :, :i + 1].transpose(-1, -2)) * q.shape[-1] ** -0.5
        out.append(torch.softmax(scores, -1) @ v[:, :, :i + 1])
    return torch.cat(out, 2).transpose(1, 2).reshape(b, s, -1)


def counted_flops(args, monkeypatch) -> tuple[float, Transformer]:
    """Matmul FLOPs per token of one forward and backward of the model and its MTP modules
    (each module's logits summed into the objective, as the head's), after checking that the
    counted attention gives the model's own logits and MTP losses (fp64)."""
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(0)
    model.double()
    if args.lora_rank:
        with torch.no_grad():
            for name, p in model.named_parameters():  # the adapters act (B ≠ 0)
                if name.endswith(".lora.b"):
                    p.normal_(0.0, 0.02)
        freeze_base(model)
    tokens = torch.randint(0, args.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    mb = MicroBatch(tokens, tokens)

    def forward():
        routing = RoutingLog()
        routing.mtp = MTPStep(lambda out, _: out.sum(), 1.0, mb)
        logits = model(tokens, routing=routing)
        return logits, routing.take_loss()

    with torch.no_grad():
        fused = forward()
    monkeypatch.setattr(AttentionCore, "forward", visible_keys_attention)
    with FlopCounterMode(display=False) as counter:
        logits, mtp = forward()
        (logits.sum() + mtp).backward()
    torch.testing.assert_close((logits, mtp), fused, rtol=1e-12, atol=1e-12)
    return counter.get_total_flops() / (B * S), model


def unseen(args, model) -> float:
    """formula − counted, term by term (module docstring)."""
    norms = sum(p.numel() for p in model.parameters() if p.ndim == 1)  # 4 each under a frozen base
    qk, v = args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim
    pairs, area = sum(i + 1 for i in range(S)) / S, S / 2
    per_layer = 6.0 * args.n_heads * ((qk + v) * area - 2 * qk * pairs)
    return (4.0 if args.lora_rank else 6.0) * norms + (args.n_layers + args.mtp_depth) * per_layer


@pytest.mark.parametrize("args", [DS, LORA], ids=["full", "lora"])
def test_mla_and_mtp_flops_count_the_matmuls_that_run(args, monkeypatch, one_thread):
    """The identity, and two controls that it can fail: the formula without the MTP modules,
    and with the value width priced at the query·key width, each miss it by > 1%."""
    counted, model = counted_flops(args, monkeypatch)
    formula = flops_per_token(args, S)
    assert formula - counted == pytest.approx(unseen(args, model), abs=1e-12 * counted), (formula, counted)
    no_mtp = flops_per_token(args.with_(mtp_depth=0), S)
    assert abs(no_mtp - counted - unseen(args, model)) > 0.01 * counted
    wide_v = flops_per_token(args.with_(v_head_dim=args.qk_nope_head_dim + args.qk_rope_head_dim), S)
    assert abs(wide_v - counted - unseen(args, model)) > 0.01 * counted
