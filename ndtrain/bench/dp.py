"""`ndtrain bench dp`: our bucketed data parallelism against torch's DistributedDataParallel.

Same model, same weights, same batch and micro-batches, same optimizer, clip, precision and
recomputed regions, same ranks; one training step each (forward, backward with gradient
all-reduce, clip, AdamW), alternated round by round. DDP gets its documented best settings:
`gradient_as_bucket_view=True` (gradients live in the buckets, as ours do), the same bucket
size, `no_sync()` on every micro-batch but the last, bf16 by autocast, and, when
`train.reduce_fp32=false`, its `bf16_compress_hook` (bf16 all-reduce, as ours then does).
"""

from __future__ import annotations

from contextlib import nullcontext

from ndtrain.bench.common import (TRAINING, Bench, Contest, alternate, anchor_autocast, anchor_clip,
                                  anchor_recompute, announce, bench_config, describe, report)
from ndtrain.config import ConfigError
from ndtrain.launch import launch_local, pick_device, shutdown
from ndtrain.model.loss import token_loss_sum
from ndtrain.parallel.parallelize import build_model
from ndtrain.parallel.states import param_groups
from ndtrain.train.optim import build_optimizer

# 2 MB buckets (DDP's default is 25) give the default 7 M-parameter model several buckets to
# overlap with backward; with a preset both sides keep the 25 MB default.
MODEL = ("model.preset=small", "model.n_layers=8", "model.dim=256", "model.ffn_dim=768", "model.vocab_size=4096",
         "parallel.bucket_mb=2")
SETTINGS = ("train.seq_len=128", "train.global_batch=16", "run.progress=false")
BENCH = Bench("dp", MODEL, SETTINGS, TRAINING + ("parallel.dp", "parallel.bucket_mb", "train.reduce_fp32"))


def ddp_anchor(c: Contest):
    """DDP on the same model and its optimizer, with the settings of the module docstring."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    t = c.cfg.train
    model = build_model(c.args, t.seed, c.env.device)
    anchor_recompute(model, t.recompute)
    ddp = DDP(model, bucket_cap_mb=c.cfg.parallel.bucket_mb, gradient_as_bucket_view=True)
    if t.precision == "bf16" and not t.reduce_fp32:
        ddp.register_comm_hook(None, bf16_compress_hook)
    return ddp, build_optimizer(param_groups(model.named_parameters(), t.weight_decay), t, c.env.device)


def _worker(cfg_dict: dict, rounds: int, steps: int) -> str:
    c = Contest.start(cfg_dict)
    try:
        t, device = c.cfg.train, c.env.device
        ddp, opt = ddp_anchor(c)

        def step_ddp():
            for i, mb in enumerate(c.micro):
                with nullcontext() if i == len(c.micro) - 1 else ddp.no_sync():
                    with anchor_autocast(c.cfg, device):
                        loss = token_loss_sum(ddp(mb.tokens), mb.targets) / c.n_targets
                    loss.backward()
            anchor_clip(ddp, t.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=False)  # keep the gradients in DDP's buckets

        times = alternate({"ndtrain": c.step_ours, "torch-ddp": step_ddp}, rounds, steps, device)
        return report(times, c.tokens, "tok/s", "ndtrain/torch-ddp", numerator="ndtrain", denominator="torch-ddp")
    finally:
        shutdown()


def run(args) -> int:
    cfg = bench_config(args, BENCH)
    t = cfg.train
    if t.precision == "bf16" and not t.reduce_fp32 and pick_device(cfg.run.device, 0).type != "cuda":
        raise ConfigError("train.reduce_fp32", False, "DDP's bf16 all-reduce (bf16_compress_hook) needs CUDA; "
                          "on the CPU compare with train.reduce_fp32=true")
    announce(args, cfg, f"bench dp: {args.nproc} ranks · {describe(cfg)} · bucket {cfg.parallel.bucket_mb} MB · "
                        f"{args.rounds} rounds × {args.steps} steps, alternating")
    out = launch_local(args.nproc, _worker, cfg.to_dict(), args.rounds, args.steps)[0]
    print(out)
    return 0
