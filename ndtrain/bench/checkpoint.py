"""`ndtrain bench checkpoint`: our checkpoints against torch.distributed.checkpoint (DCP).

Same state on both sides: after one training step of a data-parallel layout (default: the
125M preset on 2 ranks, fp32), every parameter and AdamW's two moments. Each rank holds all
of it; each side writes every tensor once, dealing the replicated tensors out to the ranks
(ours: `layout.my_share`; DCP's default planner: `dedup_save_plans`, smallest plan first).
DCP writes through its `FileSystemWriter` (one file per rank, one thread) and reads back in
place with `dcp.load`.

- save: ours hashes every byte (SHA-256, kept in meta.json) and checks every value is finite
  on the way; DCP does neither.
- load: ours is what a resume does: every file's size and checksum checked (each file by one
  rank), then each rank reads its pieces and the masters become parameters; DCP reads its
  files into the same tensors.

Rounds alternate (ours, DCP); each save goes to a fresh folder, removed after the round, out
of the timing. Throughput is the state's bytes over the wall time of the slowest rank; the
save throughput ratio is above 1.00 where ours is faster.

Then the stall of training per save, synchronous against `run.async_save` (checkpoint/
background.py). A round is `--steps` training steps after a save at its start, timed on the
slowest rank: with no save (the baseline), a synchronous save, and an async save (waited for
at the round's end, as the next save would wait for it); rounds alternate after a warm-up
round. The stall per save is a kind's median round less the baseline's median, so it holds
what the save costs the steps beside it too (the background thread shares the cores). The
last line is the async/sync stall ratio (lower is better: below 1.00, async saves stall
training less).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ndtrain.bench.common import Bench, Contest, announce, bench_config, describe, report
from ndtrain.checkpoint import layout, store
from ndtrain.checkpoint.background import BackgroundSave, save_group
from ndtrain.checkpoint.sources import CheckpointSource
from ndtrain.launch import launch_local, shutdown

# Data parallel only: DCP would need DTensors to describe our shards.
BENCH = Bench("checkpoint", ("model.preset=125M", "model.vocab_size=32000"),
              ("train.seq_len=64", "train.global_batch=2", "run.progress=false"),
              ("model.", "train.precision", "train.seq_len", "train.global_batch", "train.seed", "parallel.dp",
               "run.device", "run.threads"))


def _dcp_state(par, optimizer, tie: bool) -> dict[str, torch.Tensor]:
    """The same tensors ours writes, whole (every rank holds them), under the same keys."""
    out = {}
    for s in par.states.optim_slices():
        name = layout.TIED.get(s.name, s.name) if tie else s.name
        out[f"weight/{name}"] = s.holder
        for kind in layout.MOMENTS:
            out[f"{kind}/{name}"] = optimizer.state[s.holder][kind]
    return out


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _worker(cfg_dict: dict, rounds: int, steps: int, root: str) -> str:
    import torch.distributed.checkpoint as dcp

    c = Contest.start(cfg_dict)
    try:
        c.step_ours()  # AdamW's moments exist after one step
        par, optimizer, tie = c.ours.par, c.ours.optimizer, c.args.tie_embeddings
        state = _dcp_state(par, optimizer, tie)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        rank, root = dist.get_rank(), Path(root)

        def save_ours(k):
            return lambda: layout.save(root / f"ours{k}", 1, par, optimizer, tie, {"model_args": c.args.to_dict()})

        def save_dcp(k):
            return lambda: dcp.save(state, checkpoint_id=str(root / f"dcp{k}"))

        def load_ours():
            path = store.step_dir(root / "ours-keep", 1)
            assert store.problem(path) is None  # every file's size and SHA-256, as a resume checks
            layout.load(CheckpointSource(path), par, tie, optimizer, 1)

        def load_dcp():
            dcp.load(state, checkpoint_id=str(root / "dcp-keep"))

        save_ours("-keep")()
        save_dcp("-keep")()
        times = {"ndtrain save": [], "torch-dcp save": [], "ndtrain load": [], "torch-dcp load": []}
        for k in range(rounds + 1):  # round 0 warms up
            row = {"ndtrain save": _timed(save_ours(k)), "torch-dcp save": _timed(save_dcp(k)),
                   "ndtrain load": _timed(load_ours), "torch-dcp load": _timed(load_dcp)}
            if rank == 0:
                shutil.rmtree(root / f"ours{k}")
                shutil.rmtree(root / f"dcp{k}")
            dist.barrier()
            if k:
                for name, t in row.items():
                    times[name].append(t)
        mb = nbytes / 1e6
        head = f"state {mb:,.0f} MB: {len(state) // 3} parameters and AdamW's 2 moments, {next(iter(state.values())).dtype}"
        loads = report({k: times[k] for k in ("ndtrain load", "torch-dcp load")}, mb, "MB/s",
                       "ndtrain/torch-dcp load", numerator="ndtrain load", denominator="torch-dcp load")
        saves = report({k: times[k] for k in ("ndtrain save", "torch-dcp save")}, mb, "MB/s",
                       "ndtrain/torch-dcp save", numerator="ndtrain save", denominator="torch-dcp save")
        return "\n".join([head, loads, saves, _stall(c, root, rounds, steps)])
    finally:
        shutdown()


def _stall(c, root: Path, rounds: int, steps: int) -> str:
    """Seconds of training per round of `steps` steps with no save, a synchronous save or an
    async one at its start (module docstring); the table and the stall ratio line."""
    par, optimizer, tie = c.ours.par, c.ours.optimizer, c.args.tie_embeddings
    saver = BackgroundSave(par.mesh.device, save_group(600.0))
    meta = {"model_args": c.args.to_dict()}

    def save_async(folder):
        entries, facts = layout.share(1, par, optimizer, tie, meta)
        saver.start(folder, 1, entries, facts)

    kinds = {"no save": lambda folder: None,
             "sync save": lambda folder: layout.save(folder, 1, par, optimizer, tie, meta),
             "async save": save_async}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for k in range(rounds + 1):  # round 0 warms up (and allocates the async side's host buffers)
        for name, save in kinds.items():
            folder = root / f"stall{k}-{name.split()[0]}"

            def round_():
                save(folder)
                for _ in range(steps):
                    c.step_ours()
                saver.wait()
            t = _timed(round_)
            if dist.get_rank() == 0:
                shutil.rmtree(folder, ignore_errors=True)
            dist.barrier()
            if k:
                times[name].append(t)
    med = {n: statistics.median(v) for n, v in times.items()}
    stall = {n: med[n] - med["no save"] for n in ("sync save", "async save")}
    lines = [f"training stall per save: rounds of {steps} steps after a save, seconds (slowest rank)",
             "round  " + "  ".join(f"{n:>10}" for n in kinds)]
    lines += [f"{i + 1:>5}  " + "  ".join(f"{times[n][i]:>10.3f}" for n in kinds) for i in range(rounds)]
    lines.append("median " + "  ".join(f"{med[n]:>10.3f}" for n in kinds))
    lines.append(f"stall per save: sync {stall['sync save']:.3f} s, async {stall['async save']:.3f} s")
    lines.append(f"ndtrain async/sync checkpoint stall ratio: {stall['async save'] / stall['sync save']:.2f}")
    return "\n".join(lines)


def run(args) -> int:
    cfg = bench_config(args, BENCH)
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ndtrain-bench-checkpoint-"))
    announce(args, cfg, f"bench checkpoint: {args.nproc} ranks, dp={cfg.parallel.dp} · {describe(cfg)} · "
                        f"{args.rounds} rounds, alternating · {root}")
    try:
        print(launch_local(args.nproc, _worker, cfg.to_dict(), args.rounds, args.steps, str(root))[0])
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    return 0
