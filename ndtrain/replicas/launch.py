"""Replica groups under watch (run.fault_tolerance = "replicas"): the parent starts
`parallel.dp_replicate` groups of local ranks, each a process group of its own, hosts the
lighthouse's store (lighthouse.py), and when a rank of a group dies, fails or hangs (no
heartbeat for `heartbeat_s`), ends that group only: it marks the group's incarnation down
(the other groups finish their step without it), and starts the group again as a new
incarnation, which joins the others at a step boundary with the state of a live peer.

The watching of each group is the supervisor's (ndtrain/supervisor.py: reports, exit codes,
heartbeats); what differs is what a failure ends. A fault of the run itself (a bad config,
divergence) ends every group. A group that finishes is marked down as well: the others
no longer wait for it. When every group that is not still waiting to join has finished,
the waiting ones are ended: the run is over.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from multiprocessing.connection import wait

from ndtrain.supervisor import (BASE_PRELOAD, GRACE_S, POLL_S, TRAINER_PRELOAD, Failure, RankFailure, Results,
                                _Attempt, _check, _collect, _exit_reason, _rank_main, _root_cause)


def _replica_rank(fn, args, env: dict):
    """A rank of a replica group: its place among the groups, then the usual work. Its
    local rank and world are the machine's (a GPU each, CPU threads shared by all groups)."""
    os.environ.update({k: str(v) for k, v in env.items()})
    size = int(os.environ["WORLD_SIZE"])
    os.environ.update(LOCAL_RANK=str(int(env["NDTRAIN_REPLICA"]) * size + int(os.environ["RANK"])),
                      LOCAL_WORLD_SIZE=str(int(env["NDTRAIN_REPLICAS"]) * size))
    return fn(*args)


class _Group:
    def __init__(self, ctx, replica: int, incarnation: int, size: int, fn, args, lighthouse_port: int,
                 replicas: int):
        import torch.distributed as dist
        self.replica, self.incarnation, self.size = replica, incarnation, size
        self.store = dist.TCPStore("127.0.0.1", 0, size + 1, is_master=True, wait_for_workers=False)
        beats, steps = ctx.Array("d", size, lock=False), ctx.Array("q", size, lock=False)
        for r in range(size):
            beats[r] = time.monotonic()
        results = ctx.Queue()
        env = {"NDTRAIN_REPLICA": replica, "NDTRAIN_REPLICAS": replicas, "NDTRAIN_REPLICA_INCARNATION": incarnation,
               "NDTRAIN_LIGHTHOUSE_PORT": lighthouse_port}
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(_replica_rank, (fn, args, env), r, size, self.store.port, incarnation, os.getpid(),
                                   results, beats, steps))
                 for r in range(size)]
        for p in procs:
            p.start()
        self.run = _Attempt(procs, beats, steps, results)
        self.first_failure: float | None = None

    @property
    def done(self) -> bool:
        return len(self.run.out) == self.size

    def handles(self) -> list:
        """What `wait` wakes on for this group: a report in its queue (the queue's end of its
        pipe), the exit of a process still running."""
        return [self.run.results._reader] + [p.sentinel for p in self.run.procs if p.exitcode is None]

    def poll(self, heartbeat_s: float) -> Failure | None:
        """The root cause once this group has failed (after the grace for its other reports).
        A rank killed by a signal is the cause at once: it sends no report, and the other
        groups are waiting on it (the supervisor's grace, for a report in flight and for
        the root cause among the group's errors, would only keep them waiting)."""
        if not self.run.results.empty():
            _collect(self.run)
        reported = set(self.run.out) | {f.rank for f in self.run.failures}
        killed = [Failure(r, _exit_reason(p.exitcode)) for r, p in enumerate(self.run.procs)
                  if r not in reported and p.exitcode is not None and p.exitcode < 0]
        if killed:
            self.run.failures += killed
            return killed[0]
        _check(self.run, heartbeat_s)
        if not self.run.failures:
            return None
        self.first_failure = self.first_failure or time.monotonic()
        settled = len(self.run.out) + len({f.rank for f in self.run.failures}) == self.size
        if settled or time.monotonic() - self.first_failure >= GRACE_S:
            return _root_cause(self.run.failures)
        return None

    def kill(self) -> None:
        for p in self.run.procs:
            if p.is_alive():
                p.kill()
        for p in self.run.procs:
            p.join(timeout=10)


def fork_context(preload: tuple[str, ...] = ()):
    """The fork server's context, with what it imports before it forks a rank. The server
    is one per process, started by the first launch: later lists are ignored."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*BASE_PRELOAD, *TRAINER_PRELOAD, *preload])
    return ctx


def launch_replicas(nproc: int, replicas: int, fn, args: tuple, *, max_restarts: int, heartbeat_s: float,
                    preload: tuple[str, ...] = (), log=print) -> Results:
    """Run `fn(*args)` on `replicas` groups of `nproc // replicas` watched local ranks; returns
    their results by global rank (a group still waiting to join at the end: None). Each group
    is restarted up to `max_restarts` times. Raises RankFailure for a fault of the run, when
    a group's restarts are spent, or when no group is left."""
    import torch.distributed as dist
    ctx = fork_context(preload)
    size = nproc // replicas
    lighthouse = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    for r in range(replicas):
        lighthouse.set(f"ft/inc/{r}", "0")
    start = (lambda r, inc: _Group(ctx, r, inc, size, fn, args, lighthouse.port, replicas))
    groups = {r: start(r, 0) for r in range(replicas)}
    restarts = dict.fromkeys(range(replicas), 0)
    out: dict[int, list] = {}
    try:
        while True:
            wait([h for r, g in groups.items() if r not in out for h in g.handles()], timeout=POLL_S)
            for r, g in list(groups.items()):
                if r in out:
                    continue
                if g.done:
                    out[r] = [g.run.out[i] for i in range(size)]
                    lighthouse.set(f"ft/down/{r}/{g.incarnation}", "finished")
                    continue
                failure = g.poll(heartbeat_s)
                if failure is None:
                    continue
                g.kill()
                lighthouse.set(f"ft/down/{r}/{g.incarnation}", failure.summary[:200])
                rank = r * size + failure.rank
                alive = [x for x in groups if x != r and x not in out]
                if failure.of_the_run or restarts[r] >= max_restarts or not alive:
                    raise RankFailure(rank, failure.summary, failure.traceback)
                restarts[r] += 1
                log(f"replica group {r} lost rank {rank} ({failure.summary}) at step {g.run.step()}; the other groups "
                    f"go on; restarting it to rejoin from a live peer (restart {restarts[r]} of {max_restarts})")
                lighthouse.set(f"ft/inc/{r}", str(g.incarnation + 1))
                groups[r] = start(r, g.incarnation + 1)
            waiting = [r for r, g in groups.items() if r not in out and g.incarnation > 0
                       and not lighthouse.check([f"ft/joined/{r}/{g.incarnation}"])]
            if len(waiting) == replicas:  # every group lost before one could hand its state on
                raise RankFailure(waiting[0] * size, "every replica group was lost: none is left to send its "
                                  "state to the restarted ones")
            if len(out) + len(waiting) == replicas and out:
                for r in waiting:
                    log(f"replica group {r} was still waiting to rejoin when the run ended")
                    groups[r].kill()
                    out[r] = [None] * size
                return Results(x for r in range(replicas) for x in out[r])
    finally:
        for g in groups.values():
            g.kill()

