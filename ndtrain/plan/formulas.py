"""The papers' closed forms the planner stands on (sources in docs/plan.md).

- Training FLOPs per token (Kaplan et al. 2020; Narayanan et al. 2021, appendix;
  Korthikanti et al. 2022, appendix): 6N for the matmuls, N the weights that take part in
  one (every layer's, and the output head's; not the embedding lookup), plus the attention
  scores QKᵀ and AV: 12·L·h·s when the whole s×s matrix is counted (Megatron's papers,
  PaLM), 6·L·h·s when the masked half of a causal matrix is not (Llama 3, FlashAttention,
  and ndtrain's own MFU: `model/args.flops_per_token`).
- MFU: the model's FLOPs (without recomputation) per second over the peak of all devices.
- ZeRO (Rajbhandari et al. 2020, section 5): with Ψ parameters in p bytes, gradients in g
  bytes and K bytes of optimizer state each, a rank of N holds pΨ + gΨ + KΨ, KΨ/N with the
  optimizer states partitioned (P_os), (g + K)Ψ/N with the gradients too (P_os+g), all of it
  over N with the parameters too (P_os+g+p). The paper's mixed-precision Adam: 2 + 2 + 12.
  ndtrain accumulates bf16 gradients in fp32 (g = 4): `parallel/zero.model_state_bytes`.
- Megatron's FLOPs per iteration of a GPT (B sequences of s tokens, L layers, h hidden, V
  vocabulary; the whole attention matrix counted): model FLOPs 72·B·s·L·h²·(1 + s/(6h) +
  V/(12·h·L)) (Korthikanti et al. 2022, appendix; the MFU convention); hardware FLOPs with
  full recomputation 96·B·s·L·h²·(1 + s/(6h) + V/(16·h·L)) (Narayanan et al. 2021, appendix:
  one more forward of every layer), the count behind Megatron's published "achieved
  teraFLOP/s"; with selective recomputation 72·B·s·L·h²·(1 + s/(3h) + V/(12·h·L)), the
  form that gives Korthikanti et al.'s HFU column (Table 5) from their iteration times.
- Narayanan et al. 2021 (section 5.1): end-to-end training time ≈ 8·T·P / (n·X) for T tokens,
  P parameters, n GPUs at X FLOP/s each (hardware FLOPs: 6 per parameter and token for the
  model, 2 more for the recomputed forward).
- A GPT layer (Megatron: LayerNorm and biases, 4h GeLU MLP, learned positions) has 12h² +
  13h parameters; with V·h embeddings and s·h positions, Narayanan et al.'s
  P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)).
"""

from __future__ import annotations


def training_flops_per_token(matmul_params: float, layers: int, hidden: int, seq_len: int,
                             causal: bool = True) -> float:
    """6N + 6·L·h·s (causal half) or 6N + 12·L·h·s (the whole attention matrix)."""
    return 6.0 * matmul_params + (6.0 if causal else 12.0) * layers * hidden * seq_len


def mfu(model_flops: float, seconds: float, devices: int, peak: float) -> float:
    return model_flops / (seconds * devices * peak)


def zero_states(psi: float, stage: int, n: int, param_bytes: float = 2, grad_bytes: float = 2,
                k: float = 12) -> float:
    """Model-state bytes per rank under ZeRO `stage` (0: plain data parallelism) over n ranks."""
    params, grads, optimizer = param_bytes * psi, grad_bytes * psi, k * psi
    return params / (n if stage >= 3 else 1) + grads / (n if stage >= 2 else 1) + optimizer / (n if stage >= 1 else 1)


def gpt_params(layers: int, hidden: int, vocab: int = 51200, seq_len: int = 2048) -> int:
    """Parameters of a Megatron GPT, counted by piece."""
    h = hidden
    attention = 3 * h * h + 3 * h + h * h + h  # QKV and the output projection, with biases
    mlp = h * 4 * h + 4 * h + 4 * h * h + h  # h → 4h → h, with biases
    norms = 2 * 2 * h  # two LayerNorms (weight and bias)
    return layers * (attention + mlp + norms) + vocab * h + seq_len * h + 2 * h  # + embeddings, final norm


def gpt_matmul_params(layers: int, hidden: int, vocab: int = 51200) -> int:
    """The weights that take part in a matmul: 12h² per layer and the (tied) head V·h."""
    return 12 * layers * hidden * hidden + vocab * hidden


def megatron_flops_per_token(layers: int, hidden: int, vocab: int, seq_len: int, recompute: str = "none") -> float:
    """Megatron's FLOPs per token of a GPT (the iteration formulas above over B·s tokens):
    recompute "none" gives the model FLOPs, "selective" and "full" the hardware FLOPs."""
    h, s, L, V = hidden, seq_len, layers, vocab
    if recompute == "full":
        return 96.0 * L * h * h * (1 + s / (6 * h) + V / (16 * h * L))
    attention = s / (3 * h) if recompute == "selective" else s / (6 * h)
    return 72.0 * L * h * h * (1 + attention + V / (12 * h * L))


def narayanan_training_seconds(tokens: float, params: float, gpus: int, flops_per_gpu: float) -> float:
    """Narayanan et al.'s end-to-end estimate, 8·T·P / (n·X)."""
    return 8.0 * tokens * params / (gpus * flops_per_gpu)
