"""`ndtrain bench dp`: our bucketed data parallelism against torch's DistributedDataParallel.

Same model, same weights, same batch, same optimizer, same ranks; one training step each
(forward, backward with gradient all-reduce, AdamW), alternated round by round.
"""

from __future__ import annotations

import torch

from ndtrain.bench.common import alternate, bench_config, report
from ndtrain.launch import init_process, launch_local, shutdown
from ndtrain.mesh import MeshShape, ParallelMesh
from ndtrain.parallel.parallelize import build, build_model
from ndtrain.train.loss import token_loss_sum
from ndtrain.train.optim import build_optimizer, param_groups

BENCH_DEFAULTS = ["model.preset=small", "model.n_layers=8", "model.dim=256", "model.ffn_dim=768",
                  "model.vocab_size=4096", "train.seq_len=128", "train.global_batch=16",
                  "parallel.bucket_mb=2", "run.progress=false"]


def synthetic_batch(args, rows: int, seq_len: int, rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + rank)
    tokens = torch.randint(0, args.vocab_size, (rows, seq_len + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _worker(cfg_dict: dict, rounds: int, steps: int) -> str:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ndtrain.config import from_dict
    cfg = from_dict(cfg_dict)
    env = init_process(cfg.run.device, cfg.run.threads)
    try:
        mesh = ParallelMesh.build(MeshShape(dp_shard=env.world), env.device)
        args = cfg.model_args()
        t = cfg.train
        rows = t.global_batch // env.world
        x, y = synthetic_batch(args, rows, t.seq_len, env.rank, env.device)
        n_targets = float(t.global_batch * t.seq_len)

        ours = build(args, mesh, cfg)

        def step_ours():
            ours.forward_backward([(x, y)], n_targets)
            ours.optimizer_step(t.lr)

        ref = build_model(args, t.seed, env.device)
        ddp = DDP(ref, bucket_cap_mb=cfg.parallel.bucket_mb)
        opt = build_optimizer(param_groups(ref.named_parameters(), t.weight_decay), t, env.device)

        def step_ddp():
            loss = token_loss_sum(ddp(x), y) / n_targets
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        times = alternate({"ndtrain": step_ours, "torch-ddp": step_ddp}, rounds, steps, env.device)
        tokens = t.global_batch * t.seq_len
        return report(times, tokens, "tok/s", "ndtrain/torch-ddp", numerator="ndtrain", denominator="torch-ddp")
    finally:
        shutdown()


def run(args) -> int:
    cfg = bench_config(args, BENCH_DEFAULTS)
    p = cfg.parallel
    a = cfg.model_args()
    print(f"bench dp: {args.nproc} ranks · model dim={a.dim} layers={a.n_layers} · "
          f"batch {cfg.train.global_batch}×{cfg.train.seq_len} · bucket {p.bucket_mb} MB · "
          f"{args.rounds} rounds × {args.steps} steps, alternating", flush=True)
    out = launch_local(args.nproc, _worker, cfg.to_dict(), args.rounds, args.steps)[0]
    print(out)
    return 0
