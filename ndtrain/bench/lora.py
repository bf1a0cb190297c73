"""`ndtrain bench lora`: a LoRA fine-tuning step against a full fine-tuning step.

The same model (random weights: speed does not depend on them), ranks, packed rows of the
embedded instruction set and optimizer settings, built twice: once with every weight
training, once with `lora.rank` adapters (16 by default, every target) on the frozen model.
One training step each (forward, backward, gradient reduction, clip, AdamW), alternated
round by round. Reported: each side's trainable parameters and model-state bytes on rank 0
(parameters, gradients, optimizer state, counted as the memory report counts them), the
rounds, and the ratio of tokens per second (LoRA over full). How well each learns is the
job of benchmarks/lora_vs_full.py (whole runs of the default SFT job).
"""

from __future__ import annotations

from ndtrain.bench.common import TRAINING, Bench, alternate, announce, bench_config, describe, report

BENCH = Bench("lora", ("model.preset=small",),
              ("data.path=stdlib-functions", "train.seq_len=256", "train.global_batch=16", "run.progress=false",
               "lora.rank=16"),
              TRAINING + ("parallel.", "lora.", "data.path", "data.tokenizer", "data.vocab_size", "data.val_fraction",
                          "data.truncate", "data.on_bad_record", "data.cache_dir"))


def _worker(cfg_dict: dict, data, rounds: int, steps: int) -> str:
    from ndtrain.config import from_dict
    from ndtrain.launch import init_process, shutdown
    from ndtrain.mesh import ParallelMesh
    from ndtrain.model.loss import count_targets
    from ndtrain.observe.memory import format_bytes
    from ndtrain.parallel.parallelize import build
    from ndtrain.train.sft import SFT
    from ndtrain.train.step import TrainStep
    from ndtrain.train.worker import mesh_shape

    lora = from_dict(cfg_dict)
    full = from_dict(cfg_dict)
    full.lora.rank = 0
    env = init_process(lora.run.device, lora.run.threads)
    try:
        mesh = ParallelMesh.build(mesh_shape(lora), env.device)
        t = lora.train
        task = SFT(lora, data)
        per_rank = t.global_batch // mesh.dp_size
        start = mesh.dp_rank * per_rank
        sides = {name: TrainStep(build(cfg.model_args(), mesh, cfg), cfg) for name, cfg in (("full", full), ("lora", lora))}
        done = dict.fromkeys(sides, 0)

        def step(name: str) -> None:
            ours, s = sides[name], done[name]
            mine = task.rows("train", s, start, start + per_rank).to(env.device)
            n = count_targets(task.rows("train", s, 0, t.global_batch).targets)
            ours.forward_backward(mine.split(t.micro_batch), float(n))
            ours.clip_grad_norm(t.grad_clip)
            ours.optimizer_step(t.lr)
            done[name] = s + 1

        times = alternate({name: (lambda n=name: step(n)) for name in sides}, rounds, steps, env.device)
        lines = []
        for name, side in sides.items():
            m = side.memory
            trainable = sum(p.numel() for p in side.par.model.parameters() if p.requires_grad)
            lines.append(f"{name}: {trainable:,} trainable parameters on rank 0; model states {format_bytes(m.params)} "
                         f"parameters, {format_bytes(m.grads)} gradients, {format_bytes(m.optimizer)} optimizer")
        return "\n".join(lines) + "\n" + report(times, t.global_batch * t.seq_len, "tok/s", f"ndtrain lora "
                                                f"r{lora.lora.rank}/full", numerator="lora", denominator="full")
    finally:
        shutdown()


def run(args) -> int:
    from ndtrain.config import ConfigError
    from ndtrain.data.sft import prepare_sft
    from ndtrain.launch import launch_local
    from ndtrain.train.sft import make_template

    cfg = bench_config(args, BENCH)
    if not cfg.lora.rank:
        raise ConfigError("lora.rank", 0, "bench lora compares adapters of rank > 0 with full fine-tuning")
    d, t = cfg.data, cfg.train
    data = prepare_sft(d.path, make_template(cfg), t.seq_len, d.truncate, d.val_fraction, d.on_bad_record, d.cache_dir)
    cfg.model.vocab_size = data.vocab_size
    announce(args, cfg, f"bench lora: rank {cfg.lora.rank} adapters vs full fine-tuning · {args.nproc} ranks · "
                        f"{describe(cfg)} · {d.path} · {args.rounds} rounds × {args.steps} steps, alternating")
    print(launch_local(args.nproc, _worker, cfg.to_dict(), data, args.rounds, args.steps)[0])
    return 0
