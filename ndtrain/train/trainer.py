"""The training loop: data → schedule → clip → optimizer → metrics, with evaluation and
checkpoints. Every layout runs this same loop; what differs lives in `Parallelized`."""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch

from ndtrain.checkpoint import store
from ndtrain.comm.ops import all_reduce_scalars
from ndtrain.config import Config
from ndtrain.data.batch import MicroBatch
from ndtrain.data.loader import BatchLoader
from ndtrain.data.prepare import PreparedData
from ndtrain.mesh import DIMS, ParallelMesh
from ndtrain.model.args import flops_per_token
from ndtrain.observe.memory import per_rank
from ndtrain.observe.metrics import MetricsLog
from ndtrain.observe.mfu import peak_flops
from ndtrain.observe.plots import plot_loss, plot_moe_load
from ndtrain.observe.progress import TrainProgress
from ndtrain.model.loss import count_targets
from ndtrain.parallel.parallelize import Parallelized, build
from ndtrain.parallel.precision import LossScaleExhausted
from ndtrain.train.optim import lr_at
from ndtrain.train.step import TrainStep


class TrainingError(RuntimeError):
    """A runtime fault of the run itself (divergence, bad resume): shown without traceback."""


class Trainer:
    def __init__(self, cfg: Config, mesh: ParallelMesh, data: PreparedData, run_dir: Path | None,
                 *, local_world: int = 1):
        self.cfg, self.mesh, self.data = cfg, mesh, data
        self.run_dir = Path(run_dir) if run_dir is not None else None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        t = cfg.train
        self.args = cfg.model_args(vocab_size=data.vocab_size)
        self.par: Parallelized = build(self.args, mesh, cfg)
        self.stepper = TrainStep(self.par, cfg)
        # The random stream for dropout (weights come from per-name generators), seeded after
        # the build so no layout's construction shifts it. The ranks of a tp group share it:
        # they hold the same activations, or slices of a tensor one device would have drawn
        # for whole (parallel/tensor.py); tp is the innermost mesh dimension.
        torch.manual_seed(t.seed * 100_003 + mesh.rank // mesh.shape.tp)
        self.train_loader = BatchLoader(data.stream("train"), t.seq_len, t.global_batch, t.seed)
        self.val_loader = BatchLoader(data.stream("val"), t.seq_len, t.global_batch, t.seed, shuffle=False)
        self.flops_per_token = flops_per_token(self.args, t.seq_len)
        self.peak, self.peak_source = peak_flops(mesh.device, t.precision, cfg.data.cache_dir)
        # A CPU peak is a whole machine's; a GPU peak is one device's.
        self.n_peak_units = mesh.world // local_world if mesh.device.type == "cpu" else mesh.world
        self.step = 0
        self._measured_steps = 0
        self.is_logger = mesh.rank == 0
        self.history: list[dict] = []

    # -- data -----------------------------------------------------------------------
    def local_batch(self, loader: BatchLoader, step: int):
        """This rank's rows of the global batch of `step`, cut into micro-batches."""
        t = self.cfg.train
        per_rank = t.global_batch // self.mesh.dp_size
        start = self.mesh.dp_rank * per_rank
        inputs, targets = loader.rows(step, start, start + per_rank)
        rows = MicroBatch(inputs, targets).to(self.mesh.device)
        return rows.split(t.micro_batch), count_targets(targets)

    # -- one step -------------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        t = self.cfg.train
        t0 = time.perf_counter()
        self.mesh.stats.reset()
        micro, local_targets = self.local_batch(self.train_loader, step)
        n_targets = all_reduce_scalars([local_targets], self.mesh.group("dp_cp"))[0]
        # The activation peak: every step from the allocator on a GPU; on the CPU, where
        # watching every operation slows the step, on the first two steps of a run (the
        # first has no optimizer state yet; later steps repeat the second).
        measure = self.mesh.device.type == "cuda" or self._measured_steps < 2
        local_loss = self.stepper.forward_backward(micro, n_targets, measure_memory=measure)
        self._measured_steps += 1
        grad_norm = self.stepper.clip_grad_norm(t.grad_clip)
        lr = lr_at(step, t)
        scale = self.stepper.scaler.scale if self.stepper.scaler else None
        stepped = self.stepper.optimizer_step(lr)
        loss = self.par.reduce_loss(local_loss)
        if self.mesh.device.type == "cuda":
            torch.cuda.synchronize(self.mesh.device)
        dt = time.perf_counter() - t0
        tokens_per_s = t.global_batch * t.seq_len / dt
        mfu = (self.flops_per_token * tokens_per_s / (self.peak * self.n_peak_units)
               if self.peak else None)
        comm = self.mesh.stats.as_metrics()
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": tokens_per_s, "mfu": mfu, "step_time_s": dt,
                  "tokens": (step + 1) * t.global_batch * t.seq_len,
                  "comm_bytes": sum(comm.values()), "comm": comm, "memory": self.memory_per_rank()}
        if scale is not None:
            record.update(loss_scale=scale, skipped=not stepped)
        if self.par.routing_stats is not None:
            record["moe"] = self.par.routing_stats
        return record

    def memory_per_rank(self) -> dict[str, list[int]]:
        """Bytes of parameters, gradients, optimizer state and the activation peak, one
        entry per rank (observe/memory.py)."""
        mine = self.stepper.memory.as_dict()
        table = per_rank(list(mine.values()), self.mesh.device)
        return {k: [int(row[i]) for row in table] for i, k in enumerate(mine)}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over `eval_batches` fixed validation batches."""
        self.par.model.eval()
        total, count = 0.0, 0
        for k in range(self.cfg.train.eval_batches):
            micro, n = self.local_batch(self.val_loader, k)
            total += float(self.par.evaluate(micro))
            count += n
        self.par.model.train()
        total, count = all_reduce_scalars([total, count], self.mesh.group("dp_cp"))
        return total / max(count, 1)

    # -- the loop -------------------------------------------------------------------
    def fit(self, stop_after: int = 0) -> dict:
        """Train from `self.step` to `train.steps` (or `stop_after` steps in this call), then
        save a checkpoint. Returns the summary on rank 0."""
        t, run = self.cfg.train, self.cfg.run
        stop = min(t.steps, self.step + stop_after) if stop_after else t.steps
        log = self.is_logger and self.run_dir is not None
        metrics = MetricsLog(self.run_dir / "metrics.jsonl", self.step) if log else None
        progress = TrainProgress(t.steps, self.step, enabled=self.is_logger and run.progress,
                                 log_every=t.log_every)
        self.par.model.train()
        try:
            for step in range(self.step, stop):
                try:
                    record = self.train_step(step)
                except LossScaleExhausted as e:
                    raise TrainingError(f"step {step}: {e}; stopping ({self._last_checkpoint()})") from None
                self.step = step + 1
                if not math.isfinite(record["loss"]):
                    raise TrainingError(self._diverged_message(step, record["loss"]))
                if record.get("skipped"):
                    progress.print(f"step {step}: fp16 gradients overflowed; step skipped, loss scale "
                                   f"{record['loss_scale']:g} → {self.stepper.scaler.scale:g}")
                due = (t.eval_every and self.step % t.eval_every == 0) or self.step == t.steps
                if due and t.eval_batches:  # eval_batches = 0: no evaluation, no val_loss
                    record["val_loss"] = self.evaluate()
                self.history.append(record)
                if metrics:
                    metrics.write(record)
                progress.update(record)
                if t.save_every and self.step % t.save_every == 0 and self.step != stop:
                    self.save()
        finally:
            progress.close()
            if metrics:
                metrics.close()
        if self.run_dir is not None:
            self.save()
        return self.finish() if log else {}

    def _last_checkpoint(self) -> str:
        last = store.latest(self.run_dir) if self.run_dir else None
        return f"last good checkpoint: {last}" if last else "no checkpoint was saved before it"

    def _diverged_message(self, step: int, loss: float) -> str:
        return (f"step {step}: loss is {loss}; stopping ({self._last_checkpoint()}). "
                "Try a lower train.lr or train.grad_clip.")

    def finish(self) -> dict:
        """Rank 0: loss plot and summary.json."""
        data = self.data
        val = next((r["val_loss"] for r in reversed(self.history) if "val_loss" in r), None)
        steady = self.history[len(self.history) // 5:] or self.history  # skip warm-up steps
        summary = {
            "steps": self.step,
            "final_loss": self.history[-1]["loss"] if self.history else None,
            "val_loss": val,
            "unigram_val_loss": data.unigram_val_loss,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady) if steady else None,
            "mfu": (statistics.median(r["mfu"] for r in steady) if steady and steady[0]["mfu"] is not None else None),
            "mfu_peak_source": self.peak_source,
            "layout": self.mesh.describe(),
            "run_dir": str(self.run_dir),
            "checkpoint": str(store.latest(self.run_dir)),
        }
        if self.cfg.run.plot:
            png = plot_loss(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png",
                            baseline=data.unigram_val_loss, title=f"{self.cfg.model.preset} · {self.mesh.describe()}")
            summary["plot"] = str(png)
            if self.args.is_moe:
                summary["moe_plot"] = str(plot_moe_load(self.run_dir / "metrics.jsonl", self.run_dir / "moe_load.png"))
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    # -- checkpoints ----------------------------------------------------------------
    def save(self) -> Path:
        par, mesh = self.par, self.mesh
        live = {d for d in DIMS if getattr(mesh.shape, d) > 1}
        model_is_full = live <= set(store.expand_dims(par.model_replicated))
        rng = {"cpu": torch.get_rng_state()}
        if mesh.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(mesh.device)
        parts = {"optim": (self.stepper.state_dict(), par.optim_replicated),
                 "rng": (rng, store.PER_RANK)}
        if model_is_full:
            parts["model"] = (par.states.local_state(), DIMS)
        else:
            parts["model"] = (par.full_model_state(), DIMS)
            parts["model_shard"] = (par.states.local_state(), par.model_replicated)
        meta = {"model_args": self.args.to_dict(), "tokens": self.step * self.cfg.train.global_batch * self.cfg.train.seq_len,
                "model_sharded": not model_is_full, "ep": mesh.shape.ep}
        return store.save(self.run_dir, self.step, mesh, parts, meta)

    def resume(self, path: Path) -> None:
        mesh, par = self.mesh, self.par
        meta = store.read_meta(path)
        here = dict(zip(DIMS, mesh.shape.sizes))
        if meta.get("mesh") != here or meta.get("ep", 1) != mesh.shape.ep:
            raise TrainingError(f"checkpoint {path} was written with layout {meta.get('mesh')}, ep = {meta.get('ep', 1)}; "
                                f"this run has {here}, ep = {mesh.shape.ep}; resuming needs the same layout")
        if meta.get("model_sharded"):
            state = store.load_part(path, "model_shard", mesh, par.model_replicated, mesh.device)
        else:
            state = store.load_part(path, "model", mesh, DIMS, mesh.device)
        par.states.load_local_state(state)
        self.stepper.load_state_dict(store.load_part(path, "optim", mesh, par.optim_replicated, mesh.device))
        rng = store.load_part(path, "rng", mesh, store.PER_RANK)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and mesh.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], mesh.device)
        self.step = int(meta["step"])
