"""Local ranks under watch: start them, notice when one dies or hangs, stop the others, start
them all again; and stop them cleanly on a signal.

The parent (the `ndtrain` command) starts one process per rank from a fork server that has
imported torch and ndtrain once, so a restart costs a fraction of a second rather than the
imports. The ranks meet through a TCPStore the parent hosts on a port the OS picks (no race),
as torchrun's agent does (`TORCHELASTIC_USE_AGENT_STORE`); each attempt gets a fresh store,
and the standard variables (RANK, WORLD_SIZE, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, ...).

The parent watches every rank:
- it returns, and its result comes back through a queue, or it raises, and its traceback does;
- it exits without a word (a signal, `os._exit`): its exit code or signal is the reason;
- it falls silent: a rank writes the time into a shared array at every step and while it
  starts, evaluates and saves (`heartbeat`); one silent for `heartbeat_s` is hung.
At the first failure the parent waits half a second for the other reports (the peers of a
dead rank fail too, with "connection closed"; the root cause is the rank that failed for a
reason of its own), kills every rank left, and either starts them all again, up to
`max_restarts` times (they resume from the newest good checkpoint), or raises RankFailure
naming the root cause. A fault of the run itself (a bad config, divergence, corrupt data)
would fail every attempt alike, so it is never restarted.

Signals. A terminal's Ctrl-C reaches the whole process group: the ranks ignore SIGINT and
take SIGTERM as "stop", and the parent turns its first SIGINT or SIGTERM into one SIGTERM per
rank. A rank that is asked to stop finishes its step; the trainer agrees on stopping with the
other ranks at the next log step (at most `train.log_every` steps on), saves a checkpoint and
returns; an RL rollout under way is cut short within a token (`Interrupted`) and its step
redone on resume. A second SIGINT to the
parent kills the ranks at once. Without this parent (torchrun, or one process in the
command's own process) the rank arms SIGINT and SIGTERM itself (`stop_signals`); torchrun's
agent forwards the terminal's signal as well, so two signals within half a second count once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import re
import signal
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field

# What the fork server imports before it forks a rank (each restarted rank starts with them
# too, instead of importing them again): torch._dynamo because torch.optim's Optimizer
# constructor imports it (about a second in each process that builds an optimizer; a
# restarted rank's import competes for the cores with the ranks still training).
BASE_PRELOAD = ("ndtrain.forkserver", "torch", "torch.distributed", "torch._dynamo", "ndtrain.supervisor")
# What a training rank (train, sft, dpo, rl) imports before it can build its trainer: a
# restarted replica group that imported it again took longer than the steps left to rejoin in.
TRAINER_PRELOAD = ("ndtrain.train.worker", "ndtrain.train.trainer")

GRACE_S = 0.5  # after a first failure, how long the other ranks' reports are awaited
DEBOUNCE_S = 0.5  # two stop signals closer than this are one (torchrun forwards the terminal's)
POLL_S = 0.1

# Messages of ranks that only noticed a peer's death; never the root cause.
PEER_LOSS = re.compile(r"Connection closed by peer|Connection reset|Broken pipe|SIGTERM|Signal 15|"
                       r"ProcessGroupGloo|NCCL communicator was aborted|recvBytes|socket", re.I)
# Faults of the run itself: every attempt would meet them again.
RUN_FAULTS = ("TrainingError", "DataError", "ConfigError", "CheckpointError")


# --------------------------------------------------------------------------- inside a rank

@dataclass
class RankControl:
    """What a rank shares with whoever started it: its heartbeat, and whether to stop."""

    rank: int = 0
    beats: object = None  # shared doubles, one per rank (None: nobody watches)
    steps: object = None  # shared integers: the step each rank is on
    stop: bool = False
    stop_signal: int = 0  # the signal that asked to stop, when one did
    last_signal: float = 0.0

    @property
    def watched(self) -> bool:
        return self.beats is not None


_CONTROL = RankControl()  # this process's; the rank bootstrap replaces it


def control() -> RankControl:
    return _CONTROL


def heartbeat(step: int | None = None) -> None:
    """Tell the parent this rank is alive (and on which step)."""
    c = _CONTROL
    if c.beats is not None:
        c.beats[c.rank] = time.monotonic()
        if step is not None:
            c.steps[c.rank] = step


@contextmanager
def beating(every_s: float = 0.2):
    """Beat from a thread while inside: a rank blocked on a peer (a replica group waiting for
    another, replicas/lighthouse.py) is alive, however long the peer takes to be declared
    dead. A stopped process (SIGSTOP) stops this thread too, so a hang is still seen."""
    if _CONTROL.beats is None:
        yield
        return
    done = threading.Event()

    def beat():
        while not done.wait(every_s):
            heartbeat()
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def stop_requested() -> bool:
    return _CONTROL.stop


class Interrupted(Exception):
    """A stop request ended a long phase inside a step (an RL rollout) early, on every rank
    together: the trainer abandons the step and saves the one before it."""


@contextmanager
def stop_signals(signals=(signal.SIGINT, signal.SIGTERM)):
    """While inside: the first signal asks to stop at the next step boundary; another one
    (at least DEBOUNCE_S later) raises KeyboardInterrupt: exit at once. For a rank nobody
    watches (torchrun, or one process run by the command itself). A run entering it starts
    unstopped, whatever stopped an earlier run in this process (the stop stays readable after)."""
    c = _CONTROL
    c.stop, c.stop_signal = False, 0

    def handler(signum, frame):
        now = time.monotonic()
        if not c.stop:
            c.stop, c.stop_signal, c.last_signal = True, signum, now
        elif now - c.last_signal > DEBOUNCE_S:
            raise KeyboardInterrupt
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _watch_parent(pid: int) -> None:
    """A rank whose parent is gone (killed with SIGKILL) must not linger: exit."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(1)


def _rank_main(fn, args, rank: int, world: int, port: int, attempt: int, parent: int, results, beats, steps):
    global _CONTROL
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _CONTROL = RankControl(rank, beats, steps)
    signal.signal(signal.SIGTERM, lambda *_: _CONTROL.__dict__.update(stop=True, stop_signal=signal.SIGTERM))
    heartbeat()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT=str(attempt))
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        lines = str(e).strip().splitlines()
        results.put((rank, False, (f"{type(e).__name__}: {lines[0] if lines else ''}".strip(), traceback.format_exc())))


# --------------------------------------------------------------------------- the parent

class RankFailure(RuntimeError):
    """A rank of a local launch failed. `rank`, `summary` (one line), `traceback`."""

    def __init__(self, rank: int, summary: str, traceback: str = ""):
        self.rank, self.summary, self.traceback = rank, summary, traceback
        super().__init__(f"rank {rank} failed: {summary}")


@dataclass
class Failure:
    rank: int
    summary: str
    traceback: str = ""

    @property
    def of_the_run(self) -> bool:
        return self.summary.startswith(RUN_FAULTS)

    @property
    def peer_loss(self) -> bool:
        return bool(PEER_LOSS.search(self.summary))


class Results(list):
    """Each rank's result, by rank; `stop_signal`: the signal that stopped the run, if any."""

    stop_signal: int = 0


# Whether the ranks of a launch have something to save when asked to stop (training: a
# checkpoint at the next log step). A command with nothing to save (`ndtrain bench`) sets it
# False: its first SIGINT/SIGTERM ends the ranks at once.
STOP_SAVES = True


@dataclass
class _Signals:
    stop: int = 0  # the first SIGINT/SIGTERM received
    kill: bool = False  # a second SIGINT (or the first, with nothing to save): end now
    log: object = print
    saves: bool = True

    def handle(self, signum, frame) -> None:
        if not self.stop:
            self.stop = signum
            if not self.saves:
                self.kill = True
                self.log(f"{signal.Signals(signum).name}: stopping now (nothing to save)")
                return
            self.log(f"{signal.Signals(signum).name}: stopping; every rank saves a checkpoint at the next log step "
                     "(Ctrl-C again to quit at once)")
        elif signum == signal.SIGINT:
            self.kill = True


@dataclass
class _Attempt:
    procs: list
    beats: object
    steps: object
    results: object
    out: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    silent_since: dict = field(default_factory=dict)  # rank → when its exit without a report was seen

    def step(self) -> int:
        return max(self.steps[:])


def launch(nproc: int, fn, args: tuple, *, max_restarts: int = 0, heartbeat_s: float = 0.0,
           preload: tuple[str, ...] = (), log=print) -> Results:
    """Run `fn(*args)` on `nproc` watched local ranks; returns their results by rank.
    Raises RankFailure (the root cause) once `max_restarts` restarts are spent, at once for
    a fault of the run itself; KeyboardInterrupt after a second SIGINT."""
    ctx = mp.get_context("forkserver")
    # The fork server imports these once (the first start in this process decides).
    ctx.set_forkserver_preload([*BASE_PRELOAD, *preload])
    signals = _Signals(log=log, saves=STOP_SAVES)
    installed = {}
    if threading.current_thread() is threading.main_thread():
        installed = {s: signal.signal(s, signals.handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for attempt in range(max_restarts + 1):
            outcome = _run_attempt(ctx, nproc, fn, args, attempt, heartbeat_s, signals)
            if isinstance(outcome, Results):
                outcome.stop_signal = signals.stop
                return outcome
            failure, step = outcome
            if failure.of_the_run or signals.stop or attempt == max_restarts:
                raise RankFailure(failure.rank, failure.summary, failure.traceback)
            log(f"rank {failure.rank} failed ({failure.summary}) at step {step}; restarting all {nproc} ranks "
                f"from the last good checkpoint (restart {attempt + 1} of {max_restarts})")
        raise AssertionError("unreachable")
    finally:
        for s, h in installed.items():
            signal.signal(s, h)


def _run_attempt(ctx, nproc, fn, args, attempt, heartbeat_s, signals: _Signals):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, nproc + 1, is_master=True, wait_for_workers=False)
    beats, steps = ctx.Array("d", nproc, lock=False), ctx.Array("q", nproc, lock=False)
    for r in range(nproc):
        beats[r] = time.monotonic()
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(fn, args, r, nproc, store.port, attempt, os.getpid(), results, beats, steps))
             for r in range(nproc)]
    for p in procs:
        p.start()
    run = _Attempt(procs, beats, steps, results)
    stop_sent, first_failure = False, None
    try:
        while len(run.out) < nproc:
            if signals.kill:  # the signal that ended it: the command exits 128 + it
                raise KeyboardInterrupt(signals.stop or signal.SIGINT)
            if signals.stop and not stop_sent:
                for p in procs:
                    if p.is_alive():
                        p.terminate()  # SIGTERM: the rank stops at its next step boundary
                stop_sent = True
            _collect(run)
            _check(run, heartbeat_s)
            if run.failures:
                first_failure = first_failure or time.monotonic()
                settled = len(run.out) + len({f.rank for f in run.failures}) == nproc
                if settled or time.monotonic() - first_failure >= GRACE_S:
                    return _root_cause(run.failures), run.step()
        return Results(run.out[r] for r in range(nproc))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        del store


def _collect(run: _Attempt) -> None:
    """Every report that has arrived (waiting up to POLL_S for the first)."""
    wait = POLL_S
    while True:
        try:
            rank, ok, payload = run.results.get(timeout=wait)
        except queue.Empty:
            return
        wait = 0.001
        if ok:
            run.out[rank] = pickle.loads(payload)
        else:
            run.failures.append(Failure(rank, *payload))


def _check(run: _Attempt, heartbeat_s: float) -> None:
    """Ranks that exited without a report (after a moment for their report to arrive), and
    ranks whose heartbeat stopped."""
    now = time.monotonic()
    reported = set(run.out) | {f.rank for f in run.failures}
    for r, p in enumerate(run.procs):
        if r in reported:
            continue
        if p.exitcode is not None:
            since = run.silent_since.setdefault(r, now)
            if now - since >= POLL_S * 3:
                run.failures.append(Failure(r, _exit_reason(p.exitcode)))
        elif heartbeat_s and now - run.beats[r] > heartbeat_s:
            run.failures.append(Failure(r, f"sent no heartbeat for {heartbeat_s:g} s (run.heartbeat_s): hung"))


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code} without a report"


def _root_cause(failures: list[Failure]) -> Failure:
    return next((f for f in failures if not f.peer_loss), failures[0])
