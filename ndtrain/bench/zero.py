"""`ndtrain bench zero`: our ZeRO-3 against PyTorch FSDP2 (`fully_shard`, one unit per block).

Same model, weights, batch and micro-batches, optimizer (AdamW), clip, precision, recomputed
regions and ranks; one training step each (forward and backward with all-gathers and
reduce-scatters, then the clip and the sharded AdamW step), alternated round by round. Both
free each block after its forward (unless `parallel.reshard_after_forward=false`) and
prefetch the next: FSDP2 by its documented explicit prefetching, block i asking for block
i + 1 in forward (`set_modules_to_forward_prefetch`) and for block i − 1 in backward
(`set_modules_to_backward_prefetch`). bf16 is FSDP2's `MixedPrecisionPolicy` with our
reduction dtype; `parallel.dp_replicate > 1` is HSDP on both sides (FSDP2 on a 2-D mesh).
Both reduce-scatter after every micro-batch (FSDP2's default). Then one more step of each,
untimed, measures the peak memory per rank: the CUDA allocator's peak on a GPU; on the CPU,
the model states held before the step plus the peak the step allocates
(observe/memory.py), counting the blocks each gathers and FSDP2's DTensors as their
local shards.
"""

from __future__ import annotations

import torch

from ndtrain.bench.common import (TRAINING, Bench, Contest, alternate, anchor_clip, anchor_recompute, announce,
                                  bench_config, describe, report)
from ndtrain.bench.dp import MODEL, SETTINGS
from ndtrain.config import ConfigError
from ndtrain.launch import launch_local, shutdown
from ndtrain.model.loss import token_loss_sum
from ndtrain.observe.memory import format_bytes, measure_peak, optimizer_tensors, per_rank, storage_bytes
from ndtrain.parallel.parallelize import build_model
from ndtrain.parallel.precision import compute_dtype, reduce_dtype
from ndtrain.parallel.states import param_groups
from ndtrain.train.optim import build_optimizer

BENCH = Bench("zero", MODEL, SETTINGS + ("parallel.zero=3",),
              TRAINING + ("parallel.dp", "parallel.zero", "parallel.dp_replicate", "parallel.reshard_after_forward",
                          "train.reduce_fp32"))


def _fsdp2(cfg, args, device):
    """The anchor: FSDP2 on the same model, one `fully_shard` per block plus the root, with
    explicit prefetching (module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    t, p = cfg.train, cfg.parallel
    model = build_model(args, t.seed, device)
    anchor_recompute(model, t.recompute)  # before sharding, as torchtitan applies it
    if p.dp_replicate > 1:
        device_mesh = init_device_mesh(device.type, (p.dp_replicate, p.dp_shard),
                                       mesh_dim_names=("replicate", "shard"))
    else:
        device_mesh = init_device_mesh(device.type, (p.dp,))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype(t.precision, t.fp8_base),
                                  reduce_dtype=reduce_dtype(t.precision, t.reduce_fp32, t.fp8_base))
    blocks = list(model.layers.values())
    for block in blocks:
        fully_shard(block, mesh=device_mesh, mp_policy=policy, reshard_after_forward=p.reshard_after_forward)
    fully_shard(model, mesh=device_mesh, mp_policy=policy, reshard_after_forward=p.reshard_after_forward)
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])
    optimizer = build_optimizer(param_groups(model.named_parameters(), t.weight_decay), t, device)
    return model, optimizer


def _fsdp2_held(model, optimizer) -> int:
    """Bytes of FSDP2's model states on this rank (its DTensors count as their local shards)."""
    tensors = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    return storage_bytes(tensors + optimizer_tensors(optimizer))


def _peak(step, device, held: int) -> int:
    """The step's peak on this rank: the CUDA allocator's, or on the CPU what existed when it
    began plus the most it allocated on top (observe/memory.py; both sides free and regather
    their blocks with storage resizes, which the meter counts)."""
    with measure_peak(device) as peak:
        step()
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return held + peak["bytes"]


def _worker(cfg_dict: dict, rounds: int, steps: int) -> str:
    c = Contest.start(cfg_dict)
    try:
        device = c.env.device
        ref, opt = _fsdp2(c.cfg, c.args, device)

        def step_fsdp2():
            for mb in c.micro:
                loss = token_loss_sum(ref(mb.tokens), mb.targets) / c.n_targets
                loss.backward()
            anchor_clip(ref, c.cfg.train.grad_clip)
            opt.step()
            opt.zero_grad()

        times = alternate({"ndtrain": c.step_ours, "torch-fsdp2": step_fsdp2}, rounds, steps, device)
        ours = c.ours
        peaks = [_peak(c.step_ours, device, ours.held_bytes()), _peak(step_fsdp2, device, _fsdp2_held(ref, opt))]
        memory = "\n".join(f"peak memory rank {r}: ndtrain {format_bytes(a)} · torch-fsdp2 {format_bytes(b)}"
                           for r, (a, b) in enumerate(per_rank(peaks, device)))
        return memory + "\n" + report(times, c.tokens, "tok/s", "ndtrain/torch-fsdp2",
                                      numerator="ndtrain", denominator="torch-fsdp2")
    finally:
        shutdown()


def run(args) -> int:
    cfg = bench_config(args, BENCH)
    p = cfg.parallel
    if p.zero != 3:
        raise ConfigError("parallel.zero", p.zero, "bench zero compares ZeRO-3 with FSDP2; use 3")
    hsdp = f" · HSDP {p.dp_replicate}×{p.dp_shard}" if p.dp_replicate > 1 else ""
    announce(args, cfg, f"bench zero: ZeRO-3 vs FSDP2 · {args.nproc} ranks{hsdp} · {describe(cfg)} · "
                        f"reshard_after_forward={p.reshard_after_forward} · "
                        f"{args.rounds} rounds × {args.steps} steps, alternating")
    out = launch_local(args.nproc, _worker, cfg.to_dict(), args.rounds, args.steps)[0]
    print(out)
    return 0
