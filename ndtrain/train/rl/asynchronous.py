"""Asynchronous rollouts: generator processes sample while the training ranks train.

With `rl.generate_ranks = N` > 0, training rank 0 starts N generator processes
(`train/rl/generator.py`) beside the training world, each holding one whole model (the
training model's weights, in the compute dtype, on one process) and a frozen reference.
They are not ranks of the torch.distributed world: they take control messages (their
setup, the notice of each version of the weights) from training rank 0 and send their
rollouts back over a local authenticated socket (`multiprocessing.connection`), and take
the weights over the weight bridge (`parallel/weight_bridge.py`: a two-member gloo group
per pipeline stage and generator, with the stage's sender rank).

**The schedule**: rollout t is sampled by generator (t − start) mod N with the weights of
rollout t − K, K = `rl.max_staleness` (the weights the synchronous job samples rollout t − K
with; before the run's first rollout, its first weights): `rl.async_weights = fixed`, so that
a run is a function of its seed. With `newest`, a generator samples with the newest weights
it holds when it starts the rollout, at least those of rollout t − K (every generator then
receives every version): staleness at most K, fresher when the generators keep up, and a
run no longer a function of its seed alone. So with K ≥ 1 a generator samples rollout t + 1
while the ranks train on rollout t; with K = 0 the ranks wait for each rollout, as in the
synchronous job.

**Partial rollouts** (`rl.partial_rollout = continue`): a generator samples rollout t
`rl.partial_tokens` new tokens at a time, segment j with the weights of min(version + j, t)
(`rollout.generate_in_segments`), so it needs the versions from version_of(t) to t; every
token travels with its version, and `RL.assemble` weights each stale token by its own.

**Before rollout t's update** every training rank calls `take(t)`:
1. if any generator will sample with the current weights (version t), rank 0 sends those a
   notice over the socket and every training rank takes part in moving the weights over the
   bridge (`weight_bridge.send`): parameter by parameter, made whole on the stage that holds
   it by weight_sync's collectives and broadcast by the stage's sender to each generator
   (posted), whose inbox thread receives them into a shadow state while it samples;
2. rank 0 waits for rollout t from its generator while the weights move; every sender then
   waits until they are taken (`finish`, within the limit, before the optimizer step); the
   senders' failures and bytes are gathered (under pipeline parallelism), and rank 0
   broadcasts the rollout, or the one line of a failure, to the training ranks;
3. each rank assembles the batch (`RL.assemble`): the old log-probabilities by the training
   forward (the proximal policy), and for a stale rollout the importance weights from the
   behaviour policy (the sampler's recorded log-probabilities) to it.

**Nothing hangs.** Every exchange has a limit (`rl.exchange_timeout_s`; a generator's start
and connection at least START_S, since a process start under load can take that); a
generator that exits (killed, crashed) is noticed at the next poll. The failure travels with the rollout's
broadcast, so every training rank ends with the same one line naming the generator's rank
and the update (`TrainingError`, exit status 1). A generator that hears nothing from the
trainer within the limit, or whose connection closes, exits with one line. A stop request
(Ctrl-C, SIGTERM) while rank 0 waits for a rollout travels the same way: every training rank
raises `supervisor.Interrupted` at that update, and the run saves the update before it, as
a stop during a synchronous rollout does.
"""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, Listener

import torch.distributed as dist

from ndtrain import supervisor
from ndtrain.config import Config
from ndtrain.parallel import weight_bridge
from ndtrain.train.trainer import TrainingError

START_S = 120.0  # the least a generator is given to start (Python, torch, the model) and connect
KEY_ENV = "NDTRAIN_GENERATOR_KEY"  # the socket's key reaches a generator by its environment, never its argv


def version_of(t: int, start: int, staleness: int) -> int:
    """The rollout whose weights sample rollout t."""
    return max(start, t - staleness)


def owner_of(t: int, start: int, n: int) -> int:
    return (t - start) % n


class AsyncRollouts:
    """Training rank 0's generators, and every training rank's side of the exchange."""

    def __init__(self, cfg: Config, trainer, start: int):
        r = cfg.rl
        self.cfg, self.start, self.n, self.k = cfg, start, r.generate_ranks, r.max_staleness
        self.timeout = r.exchange_timeout_s
        self.newest = r.async_weights == "newest"
        # partial rollouts: a rollout takes newer weights every partial_tokens new tokens, up to this many times
        self.segments = math.ceil(r.max_new_tokens / r.partial_tokens) if r.partial_rollout == "continue" else 1
        self.total = math.ceil(cfg.train.steps / r.ppo_epochs)
        self.world = trainer.mesh.world
        self.lead = trainer.mesh.rank == 0
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.error: str | None = None  # rank 0: a failed send, reported with the next rollout
        self.silent: set[int] = set()  # generators that let a limit pass: alive perhaps, but not answering
        self.pushed = weight_bridge.Sent()  # this rank's part of the last push
        self.sending, self.sending_what = None, None  # the push posted, not yet finished; (version, update)
        self.failures: list = []  # this rank's failed sends: (generator, while what, update, (late, why))
        self.sent_names: set = set()  # every name this rank sent over the bridge (its stage's, on its sender)
        self.segments_used: dict = {}  # rank 0: rollout -> the version of each segment (RL.timeline, tests)
        self.times: dict = {}  # the last rollout's wall-clock times (RL.timeline)
        self.store, address = None, None
        self.stages = trainer.mesh.size("pp")
        self.stage = weight_bridge.senders(trainer.mesh.shape).index(trainer.mesh.rank) \
            if trainer.mesh.rank in weight_bridge.senders(trainer.mesh.shape) else None
        if self.lead:
            self.store, address = weight_bridge.open_store(self._start_limit())
            self._spawn(trainer, address)
        if self.world > 1:  # the other senders need the bridge's address; nobody joins after a failed start
            box = [(address, self.error)]
            dist.broadcast_object_list(box, src=0)
            address, failed = box[0]
        else:
            failed = self.error
        self.groups: dict[int, object] = {}  # generator -> this sender's bridge group with it
        self.plan = weight_bridge.plan(trainer.args, cfg)
        if self.stage is not None and failed is None:
            made = weight_bridge.join(address, [(self.stage, g) for g in range(self.n)], 0, self.timeout,
                                      self._start_limit())
            for (_, g), group in made.items():
                if isinstance(group, str):
                    self.failures.append((g, "while joining the weight bridge", start, (False, group)))
                else:
                    self.groups[g] = group

    # -- the schedule --------------------------------------------------------------
    def rank_of(self, g: int) -> int:
        """A generator's rank in messages: after the training ranks."""
        return self.world + g

    def needs(self, v: int) -> list[int]:
        """The generators that sample with the weights of rollout v (`newest`: every one
        that has a rollout still to sample)."""
        if v == self.start:  # every generator's first weights (its reference too)
            return list(range(self.n))
        if self.newest:
            ahead = max(self.n, self.k + 1) if self.segments > 1 else self.n
            return sorted({owner_of(t, self.start, self.n) for t in range(v, min(self.total, v + ahead))})
        # fixed: rollout t's segment j takes the weights of min(version_of(t) + j, t) (one segment: version_of(t))
        return sorted({owner_of(t, self.start, self.n) for t in range(v, min(self.total, v + self.k + 1))
                       if version_of(t, self.start, self.k) <= v < version_of(t, self.start, self.k) + self.segments})

    # -- processes -----------------------------------------------------------------
    def _start_limit(self) -> float:
        """A generator's start and connection: within the others' wait."""
        return max(self.timeout, min(START_S, 0.9 * self.cfg.run.collective_timeout_s))

    def _spawn(self, trainer, bridge: tuple[str, int]) -> None:
        key = os.urandom(16)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        env = dict(os.environ, **{KEY_ENV: key.hex(), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
        host, port = listener.address
        for g in range(self.n):
            self.procs.append(subprocess.Popen([sys.executable, "-m", "ndtrain.train.rl.generator", host, str(port)],
                                               env=env))
            conn = self._accept(listener, g)
            if conn is None:
                break
            self.conns.append(conn)
        listener.close()
        if self.error is None:
            setup = {"cfg": self.cfg.to_dict(), "args": trainer.args, "template": trainer.task.env.template,
                     "start": self.start, "total": self.total, "staleness": self.k, "generators": self.n,
                     "threads": _threads(), "timeout": self.timeout, "world": self.world,
                     "device": trainer.mesh.device.type, "bridge": bridge, "stages": self.stages,
                     "join_limit": self._start_limit()}
            for g, conn in enumerate(self.conns):
                self._send(g, dict(setup, generator=g), "its setup", 0)

    def _accept(self, listener: Listener, g: int) -> Connection | None:
        box: list = []
        thread = threading.Thread(target=lambda: box.append(listener.accept()), daemon=True)
        thread.start()
        limit = self._start_limit()
        deadline = time.monotonic() + limit
        while thread.is_alive() and time.monotonic() < deadline:
            if self.procs[g].poll() is not None:
                self.error = (f"ndtrain rl: generator rank {self.rank_of(g)} exited with status "
                              f"{self.procs[g].returncode} before it connected (update {self.start})")
                return None
            thread.join(0.2)
        if not box:
            self.error = (f"ndtrain rl: generator rank {self.rank_of(g)} did not connect within {limit:g} s "
                          f"(the larger of rl.exchange_timeout_s and a process start's {START_S:g} s; update "
                          f"{self.start})")
            return None
        return box[0]

    def _send(self, g: int, message, what: str, update: int) -> None:
        """Pickle `message` now (plain pickle: the bytes of every tensor, no shared memory),
        send it by a thread within the limit; a failure is kept for the next rollout's
        broadcast (never raised here: the other ranks are not waiting on a collective)."""
        if self.error is not None:
            return
        data = pickle.dumps(message, protocol=5)
        thread = threading.Thread(target=_send_quietly, args=(self.conns[g], data, False), daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():  # alive and not reading (stopped, stuck), or gone while the send blocked
            self.silent.add(g)
            status = self.procs[g].poll()
            why = (f"exited with status {status}" if status is not None else
                   f"did not take it within {self.timeout:g} s (rl.exchange_timeout_s)")
            self.error = f"ndtrain rl: generator rank {self.rank_of(g)} {why} while sent {what} (update {update})"
        # A send that failed (the connection closed) is no error by itself: the generator left
        # after its last rollout (newest weights: before these came; its exit may take a while
        # on a loaded machine), or died, which the wait for its next rollout finds and names.

    # -- every rollout -------------------------------------------------------------
    def push(self, v: int, trainer, update: int) -> None:
        """Post the current weights (version v) to the generators that need them: a notice
        over the socket (rank 0), then the weights over the bridge (`finish` waits for them).
        Collective over the training ranks when any generator needs them."""
        targets = self.needs(v)
        self.sending, self.sending_what = None, (v, update)
        if not targets:
            return
        if self.lead:
            for g in targets:
                self._send(g, ("weights", v), f"the weights of rollout {v}", update)
        failed = {g for g, *_ in self.failures}
        groups = {} if self.error is not None else {  # (a failure on rank 0 ends the run at this update)
            g: self.groups[g] for g in targets if g in self.groups and g not in failed}
        self.sending = weight_bridge.send(trainer.par, self.cfg, trainer.args, self.plan, groups, self.timeout)

    def finish(self) -> None:
        """Wait until the generators have taken the weights posted by `push` (within the
        limit), keeping any failure. Before the update's optimizer step."""
        self.pushed = weight_bridge.Sent() if self.sending is None else self.sending.finish()
        self.sending = None
        v, update = self.sending_what
        self.sent_names |= self.pushed.names
        self.failures += [(g, f"while sent the weights of rollout {v}", update, why)
                          for g, why in self.pushed.failed.items()]

    def _failures(self) -> tuple[list, int]:
        """Every sender's failures and the bytes all of them sent in the last push (gathered
        over the training ranks under pipeline parallelism: a stage's sender is not rank 0)."""
        if self.stages == 1:
            return self.failures, self.pushed.bytes
        every = [None] * self.world
        dist.all_gather_object(every, (self.failures, self.pushed.bytes))
        return [f for fs, _ in every for f in fs], sum(b for _, b in every)

    def _bridge_error(self, failures: list) -> str | None:
        """Rank 0: the one line of the first failed send over the bridge."""
        if not failures:
            return None
        g, what, update, (late, why) = failures[0]
        proc, status = self.procs[g], self.procs[g].poll()
        if status is None and not late:  # the connection broke: the process is ending, or a moment from it
            try:
                status = proc.wait(min(self.timeout, 5.0))
            except subprocess.TimeoutExpired:
                status = None
        if status is not None:
            text = f"exited with status {status}"
        elif late:
            self.silent.add(g)
            text = f"did not take it within {self.timeout:g} s (rl.exchange_timeout_s)"
        else:
            self.silent.add(g)
            text = f"failed ({why})"
        return f"ndtrain rl: generator rank {self.rank_of(g)} {text} {what} (update {update})"

    def take(self, index: int, task, trainer) -> tuple:
        """Rollout `index`'s batch and metrics, on every training rank. Collective."""
        update = trainer.step
        self.push(index, trainer, update)  # posted: the weights move while rank 0 waits for the rollout
        pushed = time.time()
        t0 = time.perf_counter()
        payload = self._receive(index, update) if self.lead else None
        waited = time.perf_counter() - t0
        self.finish()
        failures, sent = self._failures()
        if self.lead and "error" not in payload:
            error = self.error or self._bridge_error(failures)
            payload = {"error": error} if error else payload
        if self.world > 1:
            box = [payload]
            dist.broadcast_object_list(box, src=0)
            payload = box[0]
        if "error" in payload:
            raise TrainingError(payload["error"])
        if payload.get("interrupted"):
            raise supervisor.Interrupted("a stop request came while waiting for a rollout")
        self.times = {"pushed": pushed, "received": time.time(), "generator": payload.get("times")}
        self.segments_used[index] = payload.get("segments")
        batch, metrics = task.assemble(payload["rounds"], payload["kept"], index, payload["version"], trainer)
        busy, idle = payload["busy_s"], payload["idle_s"]
        metrics.update(trainer_wait_s=waited, weight_sync_s=self.pushed.seconds, weight_sync_bytes=sent,
                       generator_idle=idle / (busy + idle) if busy + idle else 0.0)
        return batch, metrics

    def _receive(self, index: int, update: int) -> dict:
        g = owner_of(index, self.start, self.n)
        if self.error is not None:
            return {"error": self.error}
        conn, proc, rank = self.conns[g], self.procs[g], self.rank_of(g)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if supervisor.stop_requested():  # Ctrl-C, SIGTERM: every training rank stops at this update
                return {"interrupted": True}
            try:
                if conn.poll(0.2):
                    message = pickle.loads(conn.recv_bytes())
                    if message.get("error"):
                        return {"error": f"ndtrain rl: generator rank {rank} failed on rollout {index} (update "
                                         f"{update}): {message['error']}"}
                    if message["index"] != index:
                        return {"error": f"ndtrain rl: generator rank {rank} sent rollout {message['index']} where "
                                         f"rollout {index} was due (update {update})"}
                    return message
            except (EOFError, OSError):  # closed: nothing more will come; its exit (or the limit) says why
                time.sleep(0.2)
            if proc.poll() is not None:
                return {"error": f"ndtrain rl: generator rank {rank} exited with status {proc.returncode} before "
                                 f"sending rollout {index} (update {update})"}
        self.silent.add(g)
        return {"error": f"ndtrain rl: generator rank {rank} sent no rollout {index} within {self.timeout:g} s "
                         f"(rl.exchange_timeout_s; update {update})"}

    def close(self) -> None:
        """Stop the generators (rank 0): a stop message (by a thread, given a second: a
        stopped generator reads nothing), then a short wait, then kill; a generator that let
        a limit pass (stopped, SIGSTOP, or stuck) is killed at once, without the wait."""
        stop = pickle.dumps(("stop",))
        for g in self.silent:
            if g < len(self.procs):
                self.procs[g].kill()
        for g, conn in enumerate(self.conns):
            if g in self.silent:
                continue
            thread = threading.Thread(target=_send_quietly, args=(conn, stop), daemon=True)
            thread.start()
            thread.join(1.0)
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.conns, self.procs = [], []
        if self.lead:  # every generator has ended: its bridge groups close at once (the store last)
            self.groups, self.store = {}, None


def _send_quietly(conn: Connection, data: bytes, close: bool = True) -> None:
    try:
        conn.send_bytes(data)
        if close:
            conn.close()
    except OSError:
        pass


def _threads() -> int:
    import torch
    return torch.get_num_threads()
