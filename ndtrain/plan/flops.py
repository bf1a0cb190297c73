"""FLOPs of a step in the two conventions papers publish rates in.

- Model FLOPs (MFU; PaLM, Llama 3, ndtrain's own `flops_per_token`): what the model needs,
  6 per active weight and token (forward 2, backward 4; 4 for LoRA's frozen base, which has
  no weight gradient, and 6 per adapter weight) plus the attention scores, causal half, a
  sliding-window layer's over its window. Recomputation is not counted: a faster step with
  less recomputation is a better MFU.
- Hardware FLOPs (HFU; Megatron's published "achieved teraFLOP/s per GPU", Narayanan et
  al. 2021 with full recomputation): what the devices execute, the model FLOPs plus every
  recomputed forward. `train.recompute=full` reruns each block's forward (2 per active
  weight and token, adapters included, the scores again); `every:K` blocks 0, K, 2K, ...;
  `selective` reruns the attention core (the scores, 2·s·d per token and layer, or those of
  the layer's window).

A rate in one convention converts to the other through the step's ratio hardware / model.
"""

from __future__ import annotations

from ndtrain.config import Config
from ndtrain.model.args import ModelArgs, adapter_params, attention_flops_per_token, block_params, flops_per_token
from ndtrain.plan.activations import recomputed


def recompute_flops_per_token(args: ModelArgs, seq_len: int, recompute: str, layers) -> float:
    """Forward FLOPs per token recomputation adds over `layers` (global block indices)."""
    extra = 0.0
    for i in layers:
        mode = recomputed(recompute, i)
        if mode == "full":
            extra += 2.0 * (block_params(args, i, active=True) + adapter_params(args, i))
            extra += attention_flops_per_token(args, seq_len, i)
        elif mode == "selective":
            extra += attention_flops_per_token(args, seq_len, i)
    return extra


def model_flops_per_step(cfg: Config, args: ModelArgs) -> float:
    """The FLOPs MFU counts: flops_per_token × tokens of the global batch."""
    t = cfg.train
    return flops_per_token(args, t.seq_len) * t.global_batch * t.seq_len


def hardware_flops_per_step(cfg: Config, args: ModelArgs) -> float:
    """The FLOPs HFU counts: the model's plus every recomputed forward."""
    t = cfg.train
    extra = recompute_flops_per_token(args, t.seq_len, t.recompute, range(args.n_layers))
    return model_flops_per_step(cfg, args) + extra * t.global_batch * t.seq_len
