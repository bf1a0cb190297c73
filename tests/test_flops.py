"""The training FLOPs that MFU divides by (model/args.flops_per_token) against an independent
count: torch's FlopCounterMode over one forward and backward of a tiny model, which counts
every matmul (mm, addmm, bmm) that autograd really runs, in LoRA's frozen base (no weight
gradients), its adapters and trained token rows, and in sliding-window layers.

What the counter does not see is derived term by term (`unseen`), never fitted, so the
comparison is an identity:
- elementwise work (norms, activations, softmax, rotary, residuals): the formula counts no
  elementwise work either, except that its N keeps the norms' weights (c·norm weights, c = 6,
  or 4 for a frozen base);
- the attention convention: the formula prices a query at the visible area of the score
  matrix (s/2 causal, w − w²/(2s) in a window of w), the kernels compute every visible pair,
  1/2 more per query (w/(2s) in a window), 12·d each.
On the CPU, SDPA's fused kernel is not among the counter's ops, so each attention core is
replaced here by one that multiplies each query with exactly its visible keys (what the
fused GPU kernels compute, the masked blocks skipped); it gives the model's own logits to
fp64 rounding, so the count is of the same computation.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ndtrain.model.args import PRESETS, flops_per_token, param_count
from ndtrain.model.llama import AttentionCore, Transformer, apply_rope
from ndtrain.model.lora import TARGETS, freeze_base

B, S = 1, 32
TINY = PRESETS["tiny"].with_(vocab_size=96, max_seq_len=S)


def visible_keys_attention(self, q, k, v, cos, sin, cache=None, layer_key=None, doc_ids=None, sinks=None):
    """AttentionCore's computation, each query times only the keys it sees (causal, and its
    window when the layer has one)."""
    b, s = q.shape[:2]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    out = []
    for i in range(s):
        lo = max(0, i - self.window + 1) if self.window else 0
        scores = (q[:, :, i:i + 1] @ k[:, :, lo:i + 1].transpose(-1, -2)) * q.shape[-1] ** -0.5
        out.append(torch.softmax(scores, -1) @ v[:, :, lo:i + 1])
    return torch.cat(out, 2).transpose(1, 2).reshape(b, s, -1)


def counted_flops(args, monkeypatch) -> float:
    """Matmul FLOPs of one forward and backward over B×S tokens, per token, after checking
    that the counted attention gives the model's own logits (fp64)."""
    torch.manual_seed(0)
    model = Transformer(args).double()
    model.init_weights(0)
    model.double()
    with torch.no_grad():
        for name, p in model.named_parameters():  # adapters and token rows act (B, rows ≠ 0)
            if name.endswith((".lora.b", ".lora.rows")):
                p.normal_(0.0, 0.02)
    if args.lora_rank:
        freeze_base(model)
    tokens = torch.randint(0, args.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fused = model(tokens)
    monkeypatch.setattr(AttentionCore, "forward", visible_keys_attention)
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        logits.sum().backward()
    torch.testing.assert_close(logits, fused, rtol=1e-12, atol=1e-12)
    return counter.get_total_flops() / (B * S)


def unseen(args) -> float:
    """What the formula holds and the counter does not see, per token, derived term by term:
    + the norms' weights that N keeps (6 each, 4 for a frozen base: no matmul runs them);
    − the diagonal's half: the kernels multiply every visible pair, Σᵢ min(i + 1, w)/s keys
      per query, the formula prices the visible area (s/2, or w − w²/(2s) in a window), and
      each key costs 12·d (forward 4·d, backward 8·d)."""
    norms = (4 if args.sandwich_norm else 2) * args.n_layers * args.dim + args.dim
    d = args.n_heads * args.head_dim
    diagonal = 0.0
    for layer in range(args.n_layers):
        w = args.window_of(layer) or S
        pairs = sum(min(i + 1, w) for i in range(S)) / S
        area = S / 2 if w >= S else w - w * w / (2 * S)
        diagonal += 12.0 * d * (pairs - area)
    return (4.0 if args.lora_rank else 6.0) * norms - diagonal


def old_formula(args, seq_len: int) -> float:
    """What MFU counted before: 6N and every layer at the full causal length."""
    return 6.0 * param_count(args, embedding=False, active=True) + 6.0 * args.n_layers * seq_len * args.dim


LORA = dict(lora_rank=4, lora_alpha=8.0, lora_targets=TARGETS)
CASES = {
    # the builtin chat template's case: the tied embedding's four new rows train
    "lora-token-rows-tied": TINY.with_(**LORA, lora_tokens=(92, 93, 94, 95), tie_embeddings=True),
    "lora-token-rows-untied": TINY.with_(**LORA, lora_tokens=(92, 93, 94, 95)),
    # nothing trains before block 0: autograd skips the matmuls that read its input
    "lora-attention-only": TINY.with_(lora_rank=4, lora_alpha=8.0, lora_targets=("wq", "wk", "wv", "wo")),
    "lora-all": TINY.with_(**LORA),
    "window-every-layer": TINY.with_(sliding_window=8),
    "window-layers-0-2": TINY.with_(sliding_window=8, window_layers=(0, 2)),
    "lora-window": TINY.with_(**LORA, sliding_window=16, window_layers=(1,)),
    # MoE: the router and the top-k experts a token goes through, frozen; attention adapted
    "lora-moe": PRESETS["tiny-moe"].with_(vocab_size=96, max_seq_len=S, **LORA),
}


@pytest.mark.parametrize("case", CASES)
def test_flops_per_token_counts_the_matmuls_that_run(case, monkeypatch, one_thread):
    """formula − counted = `unseen` to 1e-12 of the total (the counter's integers against
    the formula's floats), and the formula MFU used before (6N, every layer at full length)
    misses that identity by more than 1% of the count (the control that it can fail)."""
    args = CASES[case]
    counted = counted_flops(args, monkeypatch)
    formula = flops_per_token(args, S)
    assert formula - counted == pytest.approx(unseen(args), abs=1e-12 * counted), (formula, counted)
    assert abs(old_formula(args, S) - counted - unseen(args)) > 0.01 * counted
