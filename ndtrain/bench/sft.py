"""`ndtrain bench sft`: supervised fine-tuning on packed rows against padded rows.

The same model, ranks and optimizer train on the embedded instruction set (data/sft.py)
laid out two ways: packed by best-fit decreasing (several examples per row, document
masks) and one example per row, padded. One training step each (forward, backward,
gradient all-reduce, clip, AdamW), alternated round by round, on a global batch of the
same number of rows. What counts is the answer tokens a second trains on: a packed row
holds more of them, and a masked attention costs more than a plain causal one. Reported:
each layout's padding fraction and answer tokens per step, the rounds, and the ratio.
"""

from __future__ import annotations

import torch

from ndtrain.bench.common import TRAINING, Bench, alternate, announce, bench_config, describe, report

# Both contenders are the same trainer on the same data: every key reaches both, except
# data.packing, which is what they differ in. The model starts from random weights.
BENCH = Bench("sft", ("model.preset=small",),
              ("data.path=stdlib-functions", "train.seq_len=256", "train.global_batch=16", "run.progress=false"),
              TRAINING + ("parallel.", "data.path", "data.tokenizer", "data.vocab_size", "data.val_fraction",
                          "data.truncate", "data.on_bad_record", "data.cache_dir"))


def _worker(cfg_dict: dict, data, rounds: int, steps: int) -> str:
    from ndtrain.config import from_dict
    from ndtrain.launch import init_process, shutdown
    from ndtrain.mesh import ParallelMesh
    from ndtrain.model.loss import count_targets
    from ndtrain.parallel.parallelize import build
    from ndtrain.train.sft import SFT
    from ndtrain.train.step import TrainStep
    from ndtrain.train.worker import mesh_shape

    cfg = from_dict(cfg_dict)
    env = init_process(cfg.run.device, cfg.run.threads)
    try:
        mesh = ParallelMesh.build(mesh_shape(cfg), env.device)
        t = cfg.train
        ours = TrainStep(build(cfg.model_args(), mesh, cfg), cfg)
        per_rank = t.global_batch // mesh.dp_size
        start = mesh.dp_rank * per_rank
        tasks, steps_run, answers = {}, {}, {}
        for packing in ("bfd", "none"):
            cfg.data.packing = packing
            tasks[packing], steps_run[packing], answers[packing] = SFT(cfg, data), 0, []

        def step(packing: str) -> None:
            task, s = tasks[packing], steps_run[packing]
            mine = task.rows("train", s, start, start + per_rank).to(env.device)
            n = count_targets(task.rows("train", s, 0, t.global_batch).targets)  # the whole global batch's
            answers[packing].append(n)
            ours.forward_backward(mine.split(t.micro_batch), float(n))
            ours.clip_grad_norm(t.grad_clip)
            ours.optimizer_step(t.lr)
            steps_run[packing] = s + 1

        times = alternate({"packed": lambda: step("bfd"), "padded": lambda: step("none")}, rounds, steps, env.device)
        timed = rounds * steps  # the warm-up round's steps come first
        work = {name: sum(answers[p][-timed:]) / timed for name, p in (("packed", "bfd"), ("padded", "none"))}
        lines = [f"{name}: {len(tasks[p].train_rows):,} rows of {tasks[p].train_rows.examples:,} examples, "
                 f"{100 * tasks[p].train_rows.padding_fraction:.1f}% padding, {work[name]:,.0f} answer tokens per step"
                 for name, p in (("packed", "bfd"), ("padded", "none"))]
        return "\n".join(lines) + "\n" + report(times, work, "answer tok/s", "ndtrain sft packed/padded",
                                                numerator="packed", denominator="padded")
    finally:
        shutdown()


def run(args) -> int:
    from ndtrain.data.sft import prepare_sft
    from ndtrain.train.sft import make_template
    from ndtrain.launch import launch_local

    cfg = bench_config(args, BENCH)
    d, t = cfg.data, cfg.train
    data = prepare_sft(d.path, make_template(cfg), t.seq_len, d.truncate, d.val_fraction, d.on_bad_record, d.cache_dir)
    cfg.model.vocab_size = data.vocab_size
    announce(args, cfg, f"bench sft: packed vs padded rows · {args.nproc} ranks · {describe(cfg)} · {d.path} · "
                        f"{args.rounds} rounds × {args.steps} steps, alternating")
    print(launch_local(args.nproc, _worker, cfg.to_dict(), data, args.rounds, args.steps)[0])
    return 0
