"""`ndtrain bench dp`: our bucketed data parallelism against torch's DistributedDataParallel.

Same model, same weights, same batch, same optimizer, same ranks; one training step each
(forward, backward with gradient all-reduce, AdamW), alternated round by round.
"""

from __future__ import annotations


from ndtrain.bench.common import Contest, alternate, bench_config, report
from ndtrain.launch import launch_local, shutdown
from ndtrain.parallel.parallelize import build_model
from ndtrain.model.loss import token_loss_sum
from ndtrain.parallel.states import param_groups
from ndtrain.train.optim import build_optimizer

BENCH_DEFAULTS = ["model.preset=small", "model.n_layers=8", "model.dim=256", "model.ffn_dim=768",
                  "model.vocab_size=4096", "train.seq_len=128", "train.global_batch=16",
                  "parallel.bucket_mb=2", "run.progress=false"]


def _worker(cfg_dict: dict, rounds: int, steps: int) -> str:
    from torch.nn.parallel import DistributedDataParallel as DDP

    c = Contest.start(cfg_dict)
    try:
        t, device = c.cfg.train, c.env.device
        ref = build_model(c.args, t.seed, device)
        ddp = DDP(ref, bucket_cap_mb=c.cfg.parallel.bucket_mb)
        opt = build_optimizer(param_groups(ref.named_parameters(), t.weight_decay), t, device)

        def step_ddp():
            loss = token_loss_sum(ddp(c.x), c.y) / c.n_targets
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        times = alternate({"ndtrain": c.step_ours, "torch-ddp": step_ddp}, rounds, steps, device)
        return report(times, c.tokens, "tok/s", "ndtrain/torch-ddp", numerator="ndtrain", denominator="torch-ddp")
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
