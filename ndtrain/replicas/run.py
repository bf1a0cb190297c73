"""A replica group's part in a run under run.fault_tolerance = "replicas": what the trainer
asks of it at each step (trainer.py calls these where a step synchronises), and how a
restarted group joins (docs/faults.md).

The group is a whole layout of its own (its own process group and mesh, with
parallel.dp_replicate = 1): TP, PP, CP, ZeRO inside it are untouched. Across groups there
is only the lighthouse (lighthouse.py) and its exchanges (exchange.py): per step, the
target count and the summed gradients; with DiLoCo, only the outer step's deltas.
"""

from __future__ import annotations

import time

import torch

from ndtrain.config import Config
from ndtrain.replicas.diloco import DiLoCo
from ndtrain.replicas.exchange import Exchange
from ndtrain.replicas.lighthouse import Lighthouse, Quorum
from ndtrain.replicas.requeue import Requeue


def inner_config(cfg: Config, replicas: int) -> Config:
    """The layout of one replica group: dp_replicate = 1 and its share of the global batch."""
    from dataclasses import replace
    p = replace(cfg.parallel, dp=cfg.parallel.dp // replicas, dp_replicate=1)
    t = replace(cfg.train, global_batch=cfg.train.global_batch // replicas)
    return replace(cfg, parallel=p, train=t)


class ReplicaRun:
    def __init__(self, env: dict, cfg: Config, mesh, par, optimizer, heartbeat_s: float):
        self.replica, self.replicas = env["replica"], env["replicas"]
        self.lh = Lighthouse(env["replica"], env["replicas"], env["incarnation"], env["port"], mesh.rank, mesh.world,
                             heartbeat_s)
        self.exchange = Exchange(self.lh, mesh.device)
        self.mesh, self.par, self.optimizer = mesh, par, optimizer
        t = cfg.train
        self.rows_per_replica = t.global_batch  # cfg is the inner config: this group's share
        self.seq_len, self.steps = t.seq_len, t.steps
        self.requeue = Requeue(self.replicas) if cfg.run.lost_rows == "requeue" else None
        self.diloco = DiLoCo(par.states.optim_params(), t.diloco_inner_steps, t.diloco_outer_lr,
                             t.diloco_outer_momentum) if t.diloco_inner_steps else None
        self.quorum: Quorum | None = None
        self.summed: tuple[torch.Tensor, torch.Tensor] | None = None  # the step's loss and target count
        if self.diloco is None:
            par.across_replicas = self.sum_grads
        self._admitted: Quorum | None = None
        self._anchored = False  # DiLoCo: the anchors are the parameters once the run started

    @property
    def joining(self) -> bool:
        return self.lh.joining

    @property
    def saves(self) -> bool:
        """Whether this group writes the run's checkpoints: the first of the live ones."""
        return not self.lh.last or self.lh.last[0][0] == self.replica

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoint_dir(self, run_dir):
        """Where this group writes its checkpoints (None: it writes none). Without DiLoCo
        every group holds the same state: the first live one writes the run's. Under DiLoCo
        each group's weights and inner AdamW differ inside a round: group 0 writes the run's,
        group R its own under run_dir/replicaR, and each resumes its own."""
        if self.diloco is None:
            return run_dir if self.saves else None
        return run_dir if self.replica == 0 else run_dir / f"replica{self.replica}"

    def own_checkpoint(self, run_dir, path):
        """The checkpoint this group resumes, given the run's (`path`, group 0's): under
        DiLoCo its own of the same step when it wrote one that passes the checks, else the
        run's (a group that was down then starts from group 0's state, as a joiner would)."""
        from ndtrain.checkpoint import store
        if self.diloco is None or self.replica == 0:
            return path
        own = store.step_dir(self.checkpoint_dir(run_dir), store.step_of(path))
        return own if own.is_dir() and store.problem(own) is None else path

    def checkpoint_extra(self) -> tuple[tuple[dict, tuple[str, ...]] | None, dict]:
        """DiLoCo's tensors for checkpoint/layout.share, and meta.json's facts: DiLoCo's H
        (the step in a round is the step modulo H), the re-queued parts not trained yet."""
        facts = {"lost_rows_queue": [list(p) for p in self.requeue.queue]} if self.requeue is not None else {}
        if self.diloco is None:
            return None, facts
        return self.diloco.checkpoint_state(), {**facts, "diloco_inner_steps": self.diloco.inner_steps}

    @torch.no_grad()
    def load_checkpoint(self, source, tie_embeddings: bool, meta: dict) -> str | None:
        """The re-queued parts not trained yet, and DiLoCo's anchors and outer momentum, of a
        checkpoint that has them (one without DiLoCo's, or saved mid-round with another H:
        the round restarts from the weights, and the returned line says so)."""
        from ndtrain.checkpoint.layout import held
        if self.requeue is not None:
            self.requeue.queue = [tuple(p) for p in meta.get("lost_rows_queue", [])]
        if self.diloco is None:
            return None
        step, h = int(meta["step"]), meta.get("diloco_inner_steps")
        state, kinds = self.diloco.checkpoint_state()
        if h is None or not source.has("diloco_anchor"):
            return f"the checkpoint of step {step} has no DiLoCo state: the outer momentum starts from zero"
        if h != self.diloco.inner_steps and step % h:
            return (f"the checkpoint of step {step} is inside a round of train.diloco_inner_steps = {h}: its "
                    f"anchor is dropped, a round of {self.diloco.inner_steps} starts from the weights")
        for piece in held(self.par.states, tie_embeddings, state, kinds if source.has("diloco_momentum") else kinds[:1]):
            source.fill(piece.key, piece.piece, piece.data)
        self._anchored = True
        return None

    # -- a restarted group --------------------------------------------------------------
    def join(self) -> int:
        """Wait to be admitted, receive the state from a live peer, and return the step to
        continue from. A transfer that fails (a peer died during it) waits for the next."""
        self._prime_optimizer()
        while True:
            q = self.lh.admission()
            if self.exchange.send_state(q, self.state_tensors):
                self.par.states.after_step()  # masters → parameters (ZeRO: gathered again)
                if self.requeue is not None:  # the source wrote it before sending
                    self.requeue.decode(self.lh.store.get(f"{q.key}/queue").decode())
                self.lh.store.set(f"ft/joined/{self.replica}/{self.lh.incarnation}", q.key)
                self._admitted, self._anchored = q, True
                tag = q.key.split("/")[2]
                return int(tag)

    @torch.no_grad()
    def _prime_optimizer(self) -> None:
        """The optimizer's state tensors, as a live group holds them after a step (a step at
        lr 0 on zero gradients creates them): the transfer fills them."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if all(p in self.optimizer.state and self.optimizer.state[p] for p in params):
            return
        grads = [p.grad for p in params]
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for p in params:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        self.optimizer.step()
        for p, g in zip(params, grads):
            p.grad = g
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr

    def state_tensors(self) -> list[torch.Tensor]:
        """Everything a step depends on, in the same order in every group: the optimizer's
        parameters and their state, the model's buffers, DiLoCo's anchors and momentum."""
        out = []
        for p in self.par.states.optim_params():
            out.append(p.data)
            state = self.optimizer.state.get(p, {})
            out += [state[k] for k in sorted(state) if torch.is_tensor(state[k])]
        out += [b for _, b in sorted(self.par.states.buffers().items())]
        if self.diloco is not None:
            out += self.diloco.state_tensors()
        return out

    # -- each step ------------------------------------------------------------------------
    def begin(self, step: int) -> Quorum | None:
        """The step's quorum, after sending the state to any group admitted now. DiLoCo: at
        the first step of a round only (joiners enter between rounds)."""
        if self._admitted is not None:  # this group just joined at this step
            q, self._admitted = self._admitted, None
            return self._started(q)
        if self.diloco is not None:
            if not self._anchored:
                self.diloco.anchor()
            self._anchored = True
            if step % self.diloco.inner_steps:
                return None
        q = self.exchange.start(str(step), admit=step > 0)  # a live group's optimizer has its state after step 0
        while q.joiners:
            if self.requeue is not None:
                self.lh.store.set(f"{q.key}/queue", self.requeue.encode())
            if self.exchange.send_state(q, self.state_tensors):
                break
            q = self.exchange.retry(q)
        return self._started(q)

    def _started(self, q: Quorum) -> Quorum:
        self.quorum = q
        if self.requeue is not None:
            self.requeue.assign(q.replicas)
        return q

    def batch(self, local_batch, step: int):
        """This rank's rows of `step` (`local_batch`: Trainer.local_batch), and under
        run.lost_rows = "requeue" those of the queued part this group takes, after them."""
        own = local_batch("train", step)
        extra = self.requeue.extra(self.replica) if self.requeue is not None else None
        if extra is None:
            return own
        more = local_batch("train", *extra)
        return type(own)(list(own.micro_batches) + list(more.micro_batches), own.n_targets + more.n_targets)

    def count(self, local: torch.Tensor) -> torch.Tensor:
        """The step's target count over the live groups (DiLoCo: this group's own)."""
        if self.diloco is not None:
            return local
        self.quorum, n = self.exchange.count(self.quorum, float(local))
        self._local, self._used = float(local), n
        return torch.full((), n, dtype=local.dtype, device=local.device)

    def sum_grads(self, local_loss: torch.Tensor) -> None:
        """Parallelized.across_replicas: the group's synchronised gradients, and the step's
        loss (from this rank's share `local_loss`), summed over the live groups. Leaves the
        loss and the target count the gradients are divided by in `summed`. Not under
        DiLoCo (local steps)."""
        box = self.par.reduce_loss(local_loss).reshape(1).clone()
        grads = self.par.states.replica_grads() + [box]
        self.quorum, n = self.exchange.sum_grads(self.quorum, grads, self._local, self._used)
        self.summed = box[0], torch.full((), n, dtype=torch.float32, device=self.mesh.device)

    def after_update(self, step: int) -> None:
        """DiLoCo: the outer step at the end of each round."""
        if self.diloco is not None and self.diloco.outer_due(step):
            self.quorum = self.diloco.outer_step(self.exchange, step)
            self.par.states.after_step()

    def record(self, step: int) -> dict:
        """The step's metrics: which replica groups' rows it used, the tokens it skipped, and
        when it ended (the host's clock: docs/faults.md draws the groups' timelines from it)."""
        if self.quorum is None:
            return {}
        if self.diloco is not None and not self.diloco.outer_due(step):
            return {}
        live = self.quorum.replicas
        rounds = self.diloco.inner_steps if self.diloco is not None else 1
        part = self.rows_per_replica * self.seq_len
        if self.requeue is None:
            return {"replicas": live, "skipped_tokens": (self.replicas - len(live)) * part * rounds,
                    "ended_at": time.time()}
        out = self.requeue.settle(step, live)
        last = step == self.steps - 1  # the parts still queued are dropped
        return {"replicas": live, **out, "requeued_tokens": len(out["requeued"]) * part,
                "skipped_tokens": len(self.requeue.queue) * part if last else 0, "ended_at": time.time()}
