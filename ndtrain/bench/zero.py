"""`ndtrain bench zero`: our ZeRO-3 against PyTorch FSDP2 (`fully_shard`, one unit per block).

Same model, weights, batch, optimizer (AdamW, no clipping), precision and ranks; one
training step each (forward and backward with all-gathers and reduce-scatters, then the
sharded AdamW step), alternated round by round. Both free each block after its forward and
prefetch the next. Then one more step of each, untimed, measures the peak memory per rank:
the CUDA allocator's peak on a GPU; on the CPU, the model states held before the step plus
the peak the step allocates (observe/memory.py), counting the blocks each gathers.
"""

from __future__ import annotations

import torch

from ndtrain.bench.common import Contest, alternate, bench_config, report
from ndtrain.bench.dp import BENCH_DEFAULTS
from ndtrain.launch import launch_local, shutdown
from ndtrain.observe.memory import format_bytes, measure_peak, optimizer_tensors, per_rank, storage_bytes
from ndtrain.parallel.parallelize import build_model
from ndtrain.parallel.precision import compute_dtype, reduce_dtype
from ndtrain.model.loss import token_loss_sum
from ndtrain.parallel.states import param_groups
from ndtrain.train.optim import build_optimizer

ZERO_DEFAULTS = BENCH_DEFAULTS + ["parallel.zero=3"]


def _fsdp2(cfg, args, world: int, device):
    """The anchor: FSDP2 on the same model, one `fully_shard` per block plus the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    t = cfg.train
    model = build_model(args, t.seed, device)
    device_mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype(t.precision),
                                  reduce_dtype=reduce_dtype(t.precision, t.reduce_fp32))
    for block in model.layers.values():
        fully_shard(block, mesh=device_mesh, mp_policy=policy, reshard_after_forward=cfg.parallel.reshard_after_forward)
    fully_shard(model, mesh=device_mesh, mp_policy=policy, reshard_after_forward=cfg.parallel.reshard_after_forward)
    optimizer = build_optimizer(param_groups(model.named_parameters(), t.weight_decay), t, device)
    return model, optimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _fsdp2_held(model, optimizer) -> int:
    tensors = [_local(p) for p in model.parameters()]
    tensors += [_local(p.grad) for p in model.parameters() if p.grad is not None]
    return storage_bytes(tensors + [_local(v) for v in optimizer_tensors(optimizer)])


def _fsdp2_gathered(model) -> int:
    """Bytes of FSDP2's unsharded parameters right now: while a module is unsharded, its
    registered parameters are plain tensors, otherwise DTensors."""
    return storage_bytes(p for p in model.parameters() if not hasattr(p, "to_local"))


def _peak(step, device, held: int, extra) -> int:
    with measure_peak(device, extra) as peak:
        step()
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return held + peak["bytes"]


def _worker(cfg_dict: dict, rounds: int, steps: int) -> str:
    c = Contest.start(cfg_dict)
    try:
        device = c.env.device
        ref, opt = _fsdp2(c.cfg, c.args, c.env.world, device)

        def step_fsdp2():
            loss = token_loss_sum(ref(c.x), c.y) / c.n_targets
            loss.backward()
            opt.step()
            opt.zero_grad()

        times = alternate({"ndtrain": c.step_ours, "torch-fsdp2": step_fsdp2}, rounds, steps, device)
        ours = c.ours
        peaks = [_peak(c.step_ours, device, ours.held_bytes(), lambda: ours.par.states.gathered_bytes),
                 _peak(step_fsdp2, device, _fsdp2_held(ref, opt), lambda: _fsdp2_gathered(ref))]
        memory = "\n".join(f"peak memory rank {r}: ndtrain {format_bytes(a)} · torch-fsdp2 {format_bytes(b)}"
                           for r, (a, b) in enumerate(per_rank(peaks, device)))
        return memory + "\n" + report(times, c.tokens, "tok/s", "ndtrain/torch-fsdp2",
                                      numerator="ndtrain", denominator="torch-fsdp2")
    finally:
        shutdown()


def run(args) -> int:
    cfg = bench_config(args, ZERO_DEFAULTS)
    a, t = cfg.model_args(), cfg.train
    print(f"bench zero: ZeRO-{cfg.parallel.zero} vs FSDP2 · {args.nproc} ranks · model dim={a.dim} "
          f"layers={a.n_layers} · batch {t.global_batch}×{t.seq_len} · {t.precision} · "
          f"reshard_after_forward={cfg.parallel.reshard_after_forward} · "
          f"{args.rounds} rounds × {args.steps} steps, alternating", flush=True)
    out = launch_local(args.nproc, _worker, cfg.to_dict(), args.rounds, args.steps)[0]
    print(out)
    return 0
