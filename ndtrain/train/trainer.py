"""The training loop: data → schedule → clip → optimizer → metrics, with evaluation and
checkpoints. Every layout runs this same loop; what differs lives in `Parallelized`."""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from ndtrain import supervisor
from ndtrain.checkpoint import layout, sources, store
from ndtrain.checkpoint.background import FAILED, RUNNING, BackgroundSave, save_group
from ndtrain.checkpoint.resume import check_resume_config
from ndtrain.checkpoint.store import CheckpointError, CheckpointWriteError
from ndtrain.comm import ops
from ndtrain.comm.ops import all_reduce_bookkeeping, all_reduce_scalars
from ndtrain.config import Config, ConfigError
from ndtrain.data.batch import MicroBatch
from ndtrain.mesh import ParallelMesh
from ndtrain.model.args import flops_per_token
from ndtrain.model.llama import Transformer
from ndtrain.model.lora import is_adapter
from ndtrain.deferred import Lazy, settle
from ndtrain.observe.memory import per_rank_table
from ndtrain.observe.dashboards import Dashboards
from ndtrain.observe.metrics import MetricsLog, read_metrics, strict_json
from ndtrain.observe.mfu import peak_flops
from ndtrain.observe.progress import TrainProgress
from ndtrain.parallel import context, fp8
from ndtrain.parallel.parallelize import Parallelized, build
from ndtrain.parallel.precision import LossScaleExhausted, LossScaler
from ndtrain.train.optim import lr_at
from ndtrain.train.errors import TrainingError
from ndtrain.train.step import TrainStep
from ndtrain.train.tasks import StepData, Task

STOP_TIME, STOP_SIGNAL = 1, 2  # why the ranks agreed to stop early (Trainer.stop_agreed): the larger wins


def param_counts(args) -> dict[str, int]:
    """The whole model's parameters, and those that train (all of them without LoRA)."""
    with torch.device("meta"):
        named = dict(Transformer(args).named_parameters())  # a tied weight once
    total = sum(p.numel() for p in named.values())
    trainable = sum(p.numel() for n, p in named.items() if is_adapter(n)) if args.lora_rank else total
    return {"trainable_params": trainable, "total_params": total}


class Trainer:
    def __init__(self, cfg: Config, mesh: ParallelMesh, task: Task, run_dir: Path | None,
                 *, local_world: int = 1, control: supervisor.RankControl | None = None,
                 replicas: dict | None = None):
        # `replicas` (run.fault_tolerance = "replicas", replicas/run.py): this rank's place
        # among the replica groups; `cfg` is then the whole run's, and the layout built is
        # one group's (dp_replicate = 1, its share of the global batch).
        self.run_cfg = cfg
        if replicas is not None:
            from ndtrain.replicas.run import inner_config
            cfg = inner_config(cfg, replicas["replicas"])
        self.cfg, self.mesh, self.task = cfg, mesh, task
        # Whoever started this rank (supervisor.py): heartbeats out, stop requests in. None
        # (tests): nobody asks, and no step pays the agreement on stopping.
        self.control = control
        self.stopped = False
        self._counted = False  # whether a metrics line carried the parameter counts yet
        self.run_dir = Path(run_dir) if run_dir is not None else None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        t = cfg.train
        self.args = cfg.model_args(vocab_size=task.vocab_size)
        if self.args.lora_rank and task.new_tokens:  # a chat template's new rows train with the adapters
            self.args = self.args.with_(lora_tokens=task.new_tokens)
        self.par: Parallelized = build(self.args, mesh, cfg, task.objective)
        self.stepper = TrainStep(self.par, cfg)
        self.flops_per_token = flops_per_token(self.args, t.seq_len)
        self.param_counts = param_counts(self.args)  # trainable_params, total_params (LoRA: the adapters train)
        self.peak, self.peak_source = peak_flops(mesh.device, t.precision, cfg.data.cache_dir, t.tf32)
        # A CPU peak is a whole machine's; a GPU peak is one device's.
        self.n_peak_units = mesh.world // local_world if mesh.device.type == "cpu" else mesh.world
        self.step = 0
        # The CPU memory meter watches every operation of the first `meter_steps` steps (the
        # first has no optimizer state yet; later steps repeat the second) and slows them
        # 2-3×; a caller that does not read `memory` (the proofs) sets it to 0.
        self.meter_steps = 2
        self._measured_steps = 0
        self.is_logger = mesh.rank == 0
        self.history: list[dict] = []
        self.refused: list[str] = []  # checkpoints `start` skipped, and why
        # run.async_save: checkpoints written behind training, coordinated over a gloo group
        # of their own (checkpoint/background.py); made here, by every rank in the same order.
        self.saver = BackgroundSave(mesh.device, save_group(cfg.run.collective_timeout_s)) \
            if cfg.run.async_save else None
        self.replicas = None
        if replicas is not None:
            from ndtrain.replicas.run import ReplicaRun
            self.replicas = ReplicaRun(replicas, cfg, mesh, self.par, self.stepper.optimizer, cfg.run.heartbeat_s)

    def report(self, message: str) -> None:
        """A line for the person running the job (rank 0, stderr)."""
        if self.is_logger:
            print(f"ndtrain: {message}", file=sys.stderr, flush=True)

    def seed_dropout(self, step: int) -> None:
        """The random stream of dropout (weights come from per-name generators) is a function
        of the seed, the step and the rank's place in the computation (its pipeline stage
        and data-parallel slot), never of its rank number: a resumed run, on any layout,
        draws what an uninterrupted one draws. The ranks of a cp × tp group share it: they
        hold the same activations, or slices of a tensor one device would have drawn for
        whole (parallel/tensor.py, parallel/context/)."""
        place = f"dropout/{self.cfg.train.seed}/{step}/{self.mesh.coord('pp')}/{self.mesh.coord('dp')}"
        torch.manual_seed(zlib.crc32(place.encode()))

    # -- data -----------------------------------------------------------------------
    def local_batch(self, split: str, step: int, part: int | None = None) -> StepData:
        """This rank's share of the global batch of `step` (of validation batch `step`): its
        data-parallel rows, from the task, and under context parallelism this CP rank's
        tokens of each row (the zigzag layout, parallel/context/layout.py: targets were
        shifted before, so none is lost); cut into micro-batches, with the loss targets the
        task counts in them (the CP ranks' counts add up to the whole rows' and may differ
        between ranks: masked targets fall anywhere). Cut and counted on the host, then
        copied to the device without waiting for it (pinned memory on CUDA). Under replicas,
        `part` of the R parts of the global batch (default: this replica group's)."""
        t = self.cfg.train
        per_rank = t.global_batch // self.mesh.dp_size
        if part is None:
            part = self.replicas.replica if self.replicas is not None else 0
        start = part * t.global_batch + self.mesh.dp_rank * per_rank
        rows = self.task.rows(split, step, start, start + per_rank)
        cp = self.mesh.group("cp")
        if cp.active:
            rows = context.shard(rows, cp.size, cp.rank, self.args.mtp_depth if self.par.mtp_weight else 0)
        n_targets = self.task.targets(rows)
        return StepData(rows.to(self.mesh.device).split(t.micro_batch), n_targets)

    @torch.no_grad()
    def logprobs(self, rows: MicroBatch) -> torch.Tensor:
        """log p(target) [rows, S] of this data-parallel rank's `rows` under the current
        weights, computed by the training layout's forward (micro-batches, the CP shard, the
        pipeline, the vocabulary-parallel loss), whole rows on every rank of the dp group.
        What RL takes as the old policy's log-probabilities. Collective."""
        was_training = self.par.model.training
        self.par.model.eval()
        cp = self.mesh.group("cp")
        rows = rows.to(self.mesh.device)
        local = context.shard(rows, cp.size, cp.rank) if cp.active else rows
        out = torch.cat(self.par.logprobs(local.split(self.cfg.train.micro_batch)))
        self.par.model.train(was_training)
        return context.unshard(out, cp) if cp.active else out

    def logprobs_everywhere(self, batch: MicroBatch) -> torch.Tensor:
        """log p(target) [rows, S] of every row of a global `batch`, on every rank (on the
        host, fp64): each data-parallel rank computes its own share of the rows (`logprobs`),
        then the shares are all-gathered over dp. Collective."""
        mesh, per_rank = self.mesh, batch.size // self.mesh.dp_size
        start = mesh.dp_rank * per_rank
        mine = self.logprobs(batch.rows(start, start + per_rank)).to(mesh.device, torch.float64)
        dp = mesh.group("dp")
        if not dp.active:
            return mine.cpu()
        parts = mine.new_empty((dp.size * mine.shape[0], *mine.shape[1:]))
        ops.all_gather(parts, mine.contiguous(), dp)
        return parts.cpu()

    # -- one step -------------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        """One optimizer step. Its record holds device tensors (loss, gradient norm, target
        count) until `settle_records` reads a window of steps with one host sync; the host
        never waits for the device inside a step (docs/architecture.md, "Host syncs")."""
        t = self.cfg.train
        t0 = time.perf_counter()
        self.mesh.stats.reset()
        rep = self.replicas
        if rep is not None:
            rep.begin(step)
        self.seed_dropout(step)
        self.task.before_update(step, self)
        batch = self.local_batch("train", step) if rep is None else rep.batch(self.local_batch, step)
        fp8.begin_step(self.par.model, step, self.mesh.dp_rank * (t.global_batch // self.mesh.dp_size) // t.micro_batch)
        # The global target count, on the device: a fill (no copy from the host), then a sum.
        local = torch.full((), float(batch.n_targets), dtype=torch.float32, device=self.mesh.device)
        n_targets = all_reduce_bookkeeping(local, self.mesh.group("dp_cp"))
        if rep is not None:  # over the live replica groups (DiLoCo: this group's own)
            n_targets = rep.count(n_targets)
        # The activation peak: every step from the allocator on a GPU; on the CPU, where
        # watching every operation slows the step, on the first `meter_steps` steps.
        measure = self.mesh.device.type == "cuda" or self._measured_steps < self.meter_steps
        local_loss = self.stepper.forward_backward(batch.micro_batches, n_targets, measure_memory=measure)
        self._measured_steps += 1
        summed = None
        if rep is not None and rep.diloco is None:  # the loss and count over the live groups (Parallelized)
            summed, n_targets = rep.summed
        grad_norm = self.stepper.clip_grad_norm(t.grad_clip)
        lr = lr_at(step, t)
        scale = self.stepper.scaler.scale if self.stepper.scaler else None
        stepped = self.stepper.optimizer_step(lr)
        if rep is not None:
            rep.after_update(step)
        loss = self.par.reduce_loss(local_loss) if summed is None else summed
        task_metrics = self.task.step_metrics(self)  # collective, for some tasks
        comm = self.mesh.stats.as_metrics()
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "targets": n_targets,
                  "host_time_s": time.perf_counter() - t0,
                  "tokens": (step + 1) * t.global_batch * t.seq_len,
                  "comm_bytes": sum(comm.values()), "comm": comm}
        if rep is not None:
            record.update(rep.record(step), tokens=(step + 1) * self.run_cfg.train.global_batch * t.seq_len)
        if self.is_log_step(step):  # a collective: kept off the other steps
            record["memory"] = self.memory_per_rank()
        if scale is not None:
            record.update(loss_scale=scale, skipped=not stepped)
        record.update(task_metrics)
        if self.par.routing_stats is not None:
            record["moe"] = self.par.routing_stats
        if self.par.mtp_loss is not None:  # multi-token prediction: its loss per target, over the modules
            record["mtp_loss"] = self.par.mtp_loss
        if not self._counted:  # this process's first line
            record.update(self.param_counts)
            if fp8.recipe_of(t):
                record["fp8_backends"] = self.fp8_backends()
            self._counted = True
        return record

    def fp8_backends(self) -> dict[str, int]:
        """{back end: fp8 linear layers on it}, this rank's (parallel/fp8.backend_counts)."""
        from ndtrain.parallel.precision import compute_dtype
        t = self.cfg.train
        shape = (t.micro_batch, t.seq_len // self.mesh.shape.cp)
        return fp8.backend_counts(self.par.model, shape, compute_dtype(t.precision, t.fp8_base), self.mesh.device)

    def is_log_step(self, step: int) -> bool:
        t = self.cfg.train
        return step % t.log_every == 0 or step == t.steps - 1

    def settle_records(self, records: list[dict], waited_from: float) -> None:
        """Read the device values of a window of steps with one host sync, and give each
        step its timing: the window's time (the host's time in the steps, plus the wait for
        the device to finish them, which began at `waited_from`) shared out in proportion to
        each step's host time. On a GPU the host runs ahead, so only the window's total is
        measured; on the CPU each step's own time is its host time."""
        settle(records)  # the sync: the copy follows all of the window's work on the device
        wait = time.perf_counter() - waited_from
        t = self.cfg.train
        host = sum(r["host_time_s"] for r in records)
        for r in records:
            dt = r.pop("host_time_s") * (1 + wait / host) if host > 0 else wait / len(records)
            r["targets"] = int(r["targets"])
            r["grad_norm"] = r["grad_norm"] if math.isfinite(r["grad_norm"]) else float("inf")
            r.update(step_time_s=dt, tokens_per_s=t.global_batch * t.seq_len / dt, targets_per_s=r["targets"] / dt,
                     mfu=(self.flops_per_token * t.global_batch * t.seq_len / dt / (self.peak * self.n_peak_units)
                          if self.peak else None))

    def memory_per_rank(self) -> Lazy:
        """Bytes of parameters, gradients, optimizer state and the activation peak, one
        entry per rank (observe/memory.py), once the record is settled."""
        mine = self.stepper.memory.as_dict()
        table = per_rank_table(list(mine.values()), self.mesh.device)
        return Lazy(lambda t: {k: [int(row[i]) for row in t.tolist()] for i, k in enumerate(mine)}, (table,))

    @torch.no_grad()
    def evaluate(self, split: str = "val") -> float:
        """Mean loss per target over the task's fixed validation batches (`train.eval_batches`,
        or fewer if the task has fewer) of `split` (a mixture's: val.<source>)."""
        self.par.model.eval()
        total, count = 0.0, 0
        parts = self.replicas.replicas if self.replicas is not None else 1  # each group: every part, alone
        for k in range(self.task.eval_batches(self.cfg.train.eval_batches)):
            for part in range(parts):
                supervisor.heartbeat()
                batch = self.local_batch(split, k, part)
                total += float(self.par.evaluate(batch.micro_batches))
                count += batch.n_targets
        self.par.model.train()
        total, count = all_reduce_scalars([total, count], self.mesh.group("dp_cp"))
        return total / max(count, 1)

    # -- the loop -------------------------------------------------------------------
    def fit(self, stop_after: int = 0) -> dict:
        """Train from `self.step` to `train.steps` (or `stop_after` steps in this call), then
        save a checkpoint. Returns the summary on rank 0. The host reads the device only at
        window ends (log, evaluation and save steps, the last step): each step's metrics line
        is written then, a divergence is caught then, and a stop request is agreed then."""
        t, run = self.cfg.train, self.cfg.run
        if self.replicas is not None and self.replicas.joining:  # a restarted replica group
            self.step = self.replicas.join()
            self.report(f"replica group {self.replicas.replica} rejoined at step {self.step}")
        stop = min(t.steps, self.step + stop_after) if stop_after else t.steps
        log = self.is_logger and self.run_dir is not None
        self._metrics = MetricsLog(self.run_dir / self.metrics_name, self.step,
                                   Dashboards(run, self.run_dir, self.step, self.cfg.to_dict())) if log else None
        self._progress = TrainProgress(t.steps, self.step, enabled=self.is_logger and run.progress,
                                       log_every=t.log_every)
        self.par.model.train()
        saved = None
        deadline = time.monotonic() + run.stop_after_s if run.stop_after_s else math.inf
        window: list[dict] = []
        try:
            for step in range(self.step, stop):
                supervisor.heartbeat(step)
                try:
                    window.append(self.train_step(step))
                except LossScaleExhausted as e:
                    self._flush(window)  # the steps before it keep their lines
                    raise TrainingError(f"step {step}: {e}; stopping ({self._last_checkpoint()})") from None
                except supervisor.Interrupted:  # every rank: a rollout cut short; this step is redone on resume
                    self._flush(window)
                    self.stopped = True
                    break
                self.step = step + 1
                due = (t.eval_every and self.step % t.eval_every == 0) or self.step == t.steps
                save = t.save_every and self.step % t.save_every == 0 and self.step != stop
                if not (due or save or self.is_log_step(step) or self.step == stop):
                    continue
                self.settle_records(window, time.perf_counter())
                self._check(window)
                if due:
                    try:
                        window[-1].update(self.task.evaluate(self))
                    except supervisor.Interrupted:  # the evaluation's rollout: the step itself is done
                        self.stopped = True
                done = due and not self.stopped and self.task.done(window[-1])  # every rank evaluated alike
                self._write(window)
                window = []
                self._poll_save()
                if save:
                    saved = self.save()
                if done or self.stopped:
                    break
                asked = self.stop_agreed(out_of_time=time.monotonic() > deadline)
                if asked:
                    self.stopped = asked == STOP_SIGNAL
                    break
            if self.run_dir is not None and (saved is None or store.step_of(saved) != self.step):
                self.save()
            self.wait_save()  # run.async_save: the last checkpoint is complete before the summary
        except BaseException as e:
            self._abandon_save(e)
            raise
        finally:
            self._progress.close()
            if self._metrics:
                self._metrics.close()
        first_group = self.replicas is None or self.replicas.replica == 0
        return self.finish() if log and first_group else {}

    @property
    def metrics_name(self) -> str:
        """metrics.jsonl; under replicas, replica group 0's (the others: metrics.replica<R>.jsonl)."""
        r = self.replicas.replica if self.replicas is not None else 0
        return "metrics.jsonl" if r == 0 else f"metrics.replica{r}.jsonl"

    def _flush(self, window: list[dict]) -> None:
        """Settle, check and write the steps of a window cut short."""
        if window:
            self.settle_records(window, time.perf_counter())
            self._check(window)
            self._write(window)

    def _check(self, window: list[dict]) -> None:
        """A settled window: stop at the first non-finite loss (its step's line and the ones
        before it are written), report skipped fp16 steps."""
        for record in window:
            if not math.isfinite(record["loss"]):  # its line too: "loss": null, "nonfinite": ["loss"]
                self._write([r for r in window if r["step"] <= record["step"]])
                raise TrainingError(self._diverged_message(record["step"], record["loss"]))
            if record.get("skipped"):
                self._progress.print(f"step {record['step']}: fp16 gradients overflowed; step skipped, loss scale "
                                     f"{record['loss_scale']:g} → {record['loss_scale'] * LossScaler.BACKOFF:g}")

    def _write(self, records: list[dict]) -> None:
        for record in records:
            self.history.append(record)
            if self._metrics:
                try:
                    self._metrics.write(record)
                except OSError as e:  # a full disk: one line, the checkpoints so far kept
                    raise TrainingError(f"step {record['step']}: writing {self._metrics.path} failed "
                                        f"({e.strerror or e}); {self._last_checkpoint()}; free space and run "
                                        "the command again to continue") from None
            self._progress.update(record)

    def stop_agreed(self, out_of_time: bool = False) -> int:
        """Whether any rank was asked to stop (STOP_SIGNAL: a signal, supervisor.py) or ran out
        of `run.stop_after_s` (STOP_TIME); 0 if none. Every rank agrees at the same step
        boundary, with one all-reduce, so all of them save and return."""
        if self.control is None and not self.cfg.run.stop_after_s:
            return 0
        signalled = self.control is not None and self.control.stop
        flag = torch.tensor([STOP_SIGNAL if signalled else STOP_TIME if out_of_time else 0], device=self.mesh.device,
                            dtype=torch.float32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def _last_checkpoint(self) -> str:
        # Every checkpoint written passed the finiteness check, so the newest is good.
        last = store.latest(self.run_dir) if self.run_dir else None
        return f"last good checkpoint: {last}" if last else "no checkpoint was saved before it"

    def _diverged_message(self, step: int, loss: float) -> str:
        return (f"step {step}: loss is {loss}; stopping ({self._last_checkpoint()}). "
                "Try a lower train.lr or train.grad_clip.")

    def finish(self) -> dict:
        """Rank 0: loss plot and summary.json."""
        task = self.task
        last_eval = next((r for r in reversed(self.history) if "val_loss" in r), {})
        val = last_eval.get("val_loss")
        steady = self.history[len(self.history) // 5:] or self.history  # skip warm-up steps
        summary = {
            "steps": self.step,
            "final_loss": self.history[-1]["loss"] if self.history else None,
            "val_loss": val,
            "baseline_val_loss": task.baseline,
            "baseline": task.baseline_label,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady) if steady else None,
            "mfu": (statistics.median(r["mfu"] for r in steady) if steady and steady[0]["mfu"] is not None else None),
            "mfu_peak_source": self.peak_source,
            **self.param_counts,
            "layout": self.mesh.describe(),
            "run_dir": str(self.run_dir),
            "checkpoint": str(store.latest(self.run_dir)),
            "stopped": self.stopped,
        }
        if self.history and "source_tokens" in self.history[-1]:  # a mixture: per source
            summary["source_tokens"] = self.history[-1]["source_tokens"]
            summary["source_val_loss"] = {k.split(".", 1)[1]: v for k, v in last_eval.items()
                                          if k.startswith("val_loss.")}
        if fp8.recipe_of(self.cfg.train):
            summary["fp8"] = fp8.summary(self.cfg.train, self.args)
        if self.cfg.run.plot:
            from ndtrain.observe.plots import plot_loss, plot_moe_load  # matplotlib: only where a run draws
            png = plot_loss(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png",
                            baseline=task.baseline, baseline_label=task.baseline_label, title=f"{self.cfg.model.preset} · {self.mesh.describe()}")
            summary["plot"] = str(png)
            if self.args.is_moe:
                summary["moe_plot"] = str(plot_moe_load(self.run_dir / "metrics.jsonl", self.run_dir / "moe_load.png"))
        (self.run_dir / "summary.json").write_text(strict_json(summary, indent=1))
        return summary

    # -- checkpoints ----------------------------------------------------------------
    def start(self) -> Path | None:
        """Before `fit`: continue the run's newest good checkpoint (on this layout, whatever
        layout wrote it), or else start from `model.init_from`'s weights. Returns the
        checkpoint resumed. Collective."""
        run = self.cfg.run
        supervisor.heartbeat()
        if self.replicas is not None and self.replicas.joining:  # its state comes from a live peer (fit)
            return None
        if self.run_dir is not None and run.resume != "false":
            path = store.select(self.run_dir, self._refused)
            if path is not None and self.replicas is not None:  # DiLoCo: this group's own of that step
                path = self.replicas.own_checkpoint(self.run_dir, path)
            if path is not None:
                self.resume(path)
                self.log_restart(path)
                return path
            self.log_restart(None)
            if run.resume == "true":
                raise TrainingError(f"run.dir {self.run_dir} holds no usable checkpoint to resume")
        if self.cfg.model.init_from:
            source = sources.open_init_source(self.cfg.model.init_from, self._refused)
            sources.grow_vocab(source, self.args.vocab_size)  # tokens added since (a chat template's)
            layout.load(source, self.par, self.args.tie_embeddings)
        return None

    def log_restart(self, path: Path | None) -> None:
        """After a restart (torchrun's or supervisor.py's), rank 0 says what it cost: the
        steps done since the checkpoint resumed and the time since it was written, in a line
        and in restarts.jsonl."""
        count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        if count == 0 or not self.is_logger:
            return
        records = read_metrics(self.run_dir / "metrics.jsonl") if (self.run_dir / "metrics.jsonl").exists() else []
        reached = max((r.get("step", -1) for r in records), default=-1) + 1
        lost_s = time.time() - store.read_meta(path)["saved_at"] if path else None
        record = {"restart": count, "checkpoint": path.name if path else None, "resumed_step": self.step,
                  "reached_step": reached, "steps_lost": max(0, reached - self.step), "time_lost_s": lost_s}
        with open(self.run_dir / "restarts.jsonl", "a") as f:
            f.write(strict_json(record) + "\n")
        lost = f"{record['steps_lost']} step{'s' if record['steps_lost'] != 1 else ''}"
        self.report(f"restart {count}: " + (f"resumed step {self.step} from {path.name}; {lost} and "
                                            f"{lost_s:.1f} s lost" if path else f"no checkpoint yet, starting over; {lost} lost"))

    def _refused(self, message: str) -> None:
        self.refused.append(message)
        self.report(message)

    def save(self) -> Path | None:
        """A checkpoint of this step. Under replicas, written by the first live replica
        group only (None elsewhere); under DiLoCo, by each group (ReplicaRun.checkpoint_dir)."""
        rep = self.replicas
        run_dir = self.run_dir if rep is None else rep.checkpoint_dir(self.run_dir)
        if run_dir is None:
            return None
        extra, facts = rep.checkpoint_extra() if rep is not None else (None, {})
        t, p = self.run_cfg.train, self.cfg.parallel
        scaler = self.stepper.scaler
        meta = {"model_args": self.args.to_dict(), "tokens": self.step * t.global_batch * t.seq_len,
                "config": self.run_cfg.to_dict(), "precision": t.precision, "zero": p.zero,
                "scaler": scaler.state_dict() if scaler else None, **facts}
        supervisor.heartbeat()
        try:
            entries, meta = layout.share(self.step, self.par, self.stepper.optimizer, self.args.tie_embeddings, meta,
                                         extra)
        except CheckpointError as e:
            raise TrainingError(f"{e} ({self._last_checkpoint()}). Try a lower train.lr or train.grad_clip.") from None
        if self.saver is not None:  # waits for the previous one, then only for the copy to the host
            return self._saving(lambda: self.saver.start(run_dir, self.step, entries, meta, t.keep_checkpoints))
        return self._saving(lambda: store.save(run_dir, self.step, entries, meta, t.keep_checkpoints))

    def _saving(self, fn):
        """Run `fn` (a save, or a wait for one written behind training); its failure becomes
        one line naming the last good checkpoint (TrainingError)."""
        try:
            return fn()
        except CheckpointWriteError as e:  # a full disk: say where and how much
            raise TrainingError(f"{e}; stopping ({self._last_checkpoint()})") from None
        except CheckpointError as e:
            raise TrainingError(f"{e} ({self._last_checkpoint()})") from None
        except OSError as e:
            step = self.saver.step if self.saver is not None else self.step
            raise TrainingError(f"step {step}: the checkpoint could not be written: {e} "
                                f"({self._last_checkpoint()})") from None

    def wait_save(self) -> Path | None:
        """Wait for the checkpoint being written behind training, if any; its error, raised."""
        return self._saving(self.saver.wait) if self.saver is not None else None

    def _poll_save(self) -> None:
        """At a window end, while a checkpoint is written behind training: the ranks agree
        (one all-reduce) whether it finished or failed anywhere; a failure stops the run here,
        on every rank. The background agrees on its own outcome, so every rank raises it."""
        if self.saver is None or not self.saver.pending:
            return
        state = self.saver.outcome()
        flags = torch.tensor([state == FAILED, state == RUNNING], dtype=torch.float32, device=self.mesh.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags)
        failed, running = flags.tolist()
        if failed or not running:
            self.wait_save()

    def _abandon_save(self, error: BaseException) -> None:
        """The loop stops on `error` while a checkpoint is written behind training: on an
        interrupt, say that it may be incomplete (the next start checks it); otherwise wait
        for it, and report its own failure without hiding `error`."""
        if self.saver is None or not self.saver.pending:
            return
        step = self.saver.step
        if isinstance(error, KeyboardInterrupt):
            self.report(f"interrupted while the checkpoint of step {step} was written in the background; the next "
                        f"start checks it and falls back to the previous one if it is incomplete")
            return
        try:
            self.wait_save()
        except Exception as e:
            self.report(f"the checkpoint of step {step} written in the background failed too: {e}")

    def resume(self, path: Path) -> None:
        """Load a checkpoint written by any layout: weights, AdamW's moments, the step, the
        fp16 loss scale. The data order and dropout are functions of the step."""
        meta = store.read_meta(path)
        try:
            check_resume_config(self.run_cfg, meta, self.args)
        except ConfigError as e:
            raise TrainingError(f"cannot resume {path}: {e}") from None
        source = sources.CheckpointSource(path, meta)
        layout.load(source, self.par, self.args.tie_embeddings, self.stepper.optimizer, meta.get("optimizer_step", 0))
        if self.cfg.train.optimizer == "muon" and not source.has("momentum_buffer"):
            self.report(f"{path} was trained with AdamW: Muon's matrices start with fresh (zero) momentum, "
                        "the other tensors keep their AdamW moments")
        scaler = self.stepper.scaler
        if scaler is not None and meta.get("scaler"):
            scaler.load_state_dict(meta["scaler"])
        if self.replicas is not None and (note := self.replicas.load_checkpoint(source, self.args.tie_embeddings, meta)):
            self.report(note)
        self.step = int(meta["step"])
