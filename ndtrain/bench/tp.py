"""`ndtrain bench tp`: our tensor + sequence parallelism against PyTorch's DTensor TP + SP.

Both run the same model (same initial weights) on the same batch and micro-batches over the
same ranks, one training step each (forward, backward, clip, AdamW), alternated round by
round, with the same recomputed regions (torch's `checkpoint` on the anchor) and, in bf16,
autocast on the anchor (torchtitan's choice for TP without FSDP). The DTensor side
is the torchtitan-style plan: ColwiseParallel / RowwiseParallel on the projections,
SequenceParallel on the norms, the embedding row-wise into a sequence-split stream, and
`loss_parallel` on vocab-split logits. The same plan is the anchor of tests/test_tp.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ndtrain.bench.common import (TRAINING, Bench, Contest, alternate, anchor_autocast, anchor_clip,
                                  anchor_recompute, announce, bench_config, describe, report)
from ndtrain.config import ConfigError
from ndtrain.launch import launch_local, shutdown
from ndtrain.model.args import ModelArgs
from ndtrain.model.llama import Transformer
from ndtrain.parallel.parallelize import build_model
from ndtrain.model.loss import IGNORE
from ndtrain.parallel.states import param_groups
from ndtrain.train.optim import build_optimizer

MODEL = ("model.preset=small", "model.n_layers=8", "model.dim=256", "model.ffn_dim=768", "model.n_heads=8",
         "model.n_kv_heads=4", "model.vocab_size=4096")
SETTINGS = ("model.tie_embeddings=false", "train.seq_len=128", "train.global_batch=8", "parallel.sp=true",
            "run.progress=false")
BENCH = Bench("tp", MODEL, SETTINGS, TRAINING + ("parallel.tp", "parallel.sp"))


def dtensor_plan(n_layers: int, sp: bool) -> dict:
    """The module → ParallelStyle plan for our Transformer, with or without SP."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)

    stream = Shard(1) if sp else Replicate()  # the residual stream between regions
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "output": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    for i in range(n_layers):
        p = f"layers.{i}."
        plan.update({
            p + "attention.wq": ColwiseParallel(), p + "attention.wk": ColwiseParallel(),
            p + "attention.wv": ColwiseParallel(), p + "attention.wo": RowwiseParallel(output_layouts=stream),
            p + "feed_forward.w1": ColwiseParallel(), p + "feed_forward.w3": ColwiseParallel(),
            p + "feed_forward.w2": RowwiseParallel(output_layouts=stream),
        })
        if sp:
            plan.update({
                p + "attention_norm": SequenceParallel(), p + "ffn_norm": SequenceParallel(),
                # attention(x, cos, sin, cache, layer_key): only x is a sequence-split tensor
                p + "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),
                                                    desired_input_layouts=(Replicate(), None, None, None, None)),
                p + "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                       desired_input_layouts=(Replicate(),)),
            })
    return plan


def dtensor_model(args: ModelArgs, seed: int, device: torch.device, tp_mesh, sp: bool) -> Transformer:
    """The plain model with our initial weights, parallelised by DTensor over `tp_mesh`
    (a 1-D torch DeviceMesh). Needs KV heads divisible by its size and untied embeddings."""
    from torch.distributed.tensor.parallel import parallelize_module
    model = build_model(args, seed, device)
    return parallelize_module(model, tp_mesh, dtensor_plan(args.n_layers, sp))


def dtensor_loss_backward(model, x, y, n_targets: float, autocast=None) -> torch.Tensor:
    """Forward, loss from vocab-split logits with `loss_parallel`, backward (inside it too).
    `autocast`: a context for the forward and the loss (bf16)."""
    from contextlib import nullcontext

    from torch.distributed.tensor.parallel import loss_parallel
    with loss_parallel():
        with autocast or nullcontext():
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, -2), y.flatten(), ignore_index=IGNORE,
                                   reduction="sum") / n_targets
        loss.backward()
    return loss.full_tensor().detach() if hasattr(loss, "full_tensor") else loss.detach()


def _worker(cfg_dict: dict, rounds: int, steps: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    c = Contest.start(cfg_dict)
    try:
        t, device = c.cfg.train, c.env.device
        tp_mesh = init_device_mesh(device.type, (c.cfg.parallel.tp,))
        ref = dtensor_model(c.args, t.seed, device, tp_mesh, c.cfg.parallel.sp)
        anchor_recompute(ref, t.recompute)
        opt = build_optimizer(param_groups(ref.named_parameters(), t.weight_decay), t, device)

        def step_dtensor():
            for mb in c.micro:
                dtensor_loss_backward(ref, mb.tokens, mb.targets, c.n_targets, anchor_autocast(c.cfg, device))
            anchor_clip(ref, t.grad_clip)
            opt.step()
            opt.zero_grad()  # to None: DTensor keeps SP norm gradients Partial, not zeroable in place

        times = alternate({"ndtrain": c.step_ours, "torch-dtensor-tp": step_dtensor}, rounds, steps, device)
        return report(times, c.tokens, "tok/s", "ndtrain/torch-dtensor-tp",
                      numerator="ndtrain", denominator="torch-dtensor-tp")
    finally:
        shutdown()


def run(args) -> int:
    if not any(o.startswith("parallel.tp=") for o in args.overrides):
        args.overrides = [f"parallel.tp={args.nproc}"] + list(args.overrides)  # TP over every rank
    cfg = bench_config(args, BENCH)
    a, p = cfg.model_args(), cfg.parallel
    if a.tie_embeddings:
        raise ConfigError("model.tie_embeddings", True, "DTensor's plan cannot shard one weight as both embedding "
                          "and head; bench tp needs untied embeddings")
    if a.n_kv_heads % p.tp:
        raise ConfigError("model.n_kv_heads", a.n_kv_heads, f"DTensor's plan splits KV heads; they must be "
                          f"divisible by parallel.tp = {p.tp}")
    announce(args, cfg, f"bench tp: tp={p.tp} sp={p.sp} · {describe(cfg)} · "
                        f"{args.rounds} rounds × {args.steps} steps, alternating")
    out = launch_local(args.nproc, _worker, cfg.to_dict(), args.rounds, args.steps)[0]
    print(out)
    return 0
