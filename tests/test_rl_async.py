"""Asynchronous RL (rl.generate_ranks, rl.max_staleness; train/rl/asynchronous.py): what a
run with generator processes equals, and that nothing hangs.

- K = 0: generator processes change nothing: the same losses, gradient norms and final
  weights as the synchronous job, bit for bit in fp64.
- K = 2: the run equals a reference built directly: one process, synchronous, that keeps a
  copy of the weights before every rollout and samples rollout t with the copy of rollout
  t − 2 (`DelayedRL`), training with the same off-policy correction; fp64, the tolerance
  rule (the first update at exact precision, later ones within the twin's gaps).
- Partial rollouts (rl.partial_rollout = continue) at K = 2 equal `PartialRL`, one process
  sampling each segment with a copy of its version's weights (fp64, the tolerance rule).
- A generator killed while the trainer sends it weights ends every training rank with the
  same one line naming its rank and the update, well before any limit; one stopped (SIGSTOP)
  there, or mid-run under the CLI, within one limit and a margin."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from ndtrain.testing import run_ranks

from test_rl import RL_PROOF

STALE = 2
PARTIAL = 2  # rl.partial_tokens of the partial-rollout proof: 3 segments of the 6 new tokens
# grpo on every update (the staleness proof needs no cycle of losses), a rollout per update
# (ppo_epochs 1: the ratio against π_old is 1, the importance weight carries staleness).
ASYNC_PROOF = [o for o in RL_PROOF if not o.startswith("rl.ppo_epochs")] + ["rl.ppo_epochs=1", "train.steps=5",
                                                                            "rl.exchange_timeout_s=40"]
TASKS: list = []  # the tasks made in this process, closed after each run (their generators)
USED: dict = {}  # rollout -> the version of each segment, as the last asynchronous run in this process recorded them


def _make(kind: str):
    def make(cfg):
        from ndtrain.data.template import BuiltinTemplate
        from ndtrain.data.verifiable import char_tokenizer
        from ndtrain.parallel.generation import frozen_copy
        from ndtrain.train.rl.task import RL, Environment

        class DelayedRL(RL):
            """The reference of rl.max_staleness = STALE, built directly: synchronous, one
            process, rollout t sampled with a copy of the weights taken before rollout
            t − STALE (the first weights before that)."""

            snapshots: dict = {}

            def rollout(self, index, trainer):
                layout = self._generator(trainer).layout
                self.snapshots[index] = frozen_copy(trainer.par, self.cfg, trainer.args, layout)
                version = max(0, index - STALE)
                model, reference = self.snapshots[version], self._reference(trainer)
                rounds, kept = self.sample_rounds(index, lambda rows, prompts, seeds: self._generate(
                    trainer, model, rows, prompts, seeds, self.sampling, reference))
                return self.assemble(rounds, kept, index, version, trainer)

        class PartialRL(DelayedRL):
            """The reference of rl.partial_rollout = continue at K = STALE, built directly: rollout
            t sampled PARTIAL tokens at a time, segment j with the copy of the weights taken
            before rollout min(t − STALE + j, t) (the first weights before the run's first), each
            token keeping its version and that version's log-probability."""

            def rollout(self, index, trainer):
                from ndtrain.train.rl.rollout import generate_in_segments
                layout = self._generator(trainer).layout
                self.snapshots[index] = frozen_copy(trainer.par, self.cfg, trainer.args, layout)
                version, reference, t = max(0, index - STALE), self._reference(trainer), self.cfg.train
                versions = lambda j: (self.snapshots[min(version + j, index)], min(version + j, index))  # noqa: E731
                rounds, kept = self.sample_rounds(index, lambda rows, prompts, seeds: generate_in_segments(
                    versions, PARTIAL, prompts, seeds, self.sampling, self.env.template.stop_ids,
                    self.env.template.pad_id, lambda i, ids: self.env.score(rows[i], ids)[:4], reference,
                    t.micro_batch, t.loss_chunk))
                return self.assemble(rounds, kept, index, version, trainer)

        class UsedVersionsRL(DelayedRL):
            """The reference of a run whose weights are the race's (rl.async_weights = newest,
            partial rollouts continued), built directly: rollout t sampled PARTIAL tokens at a
            time, segment j with the copy of the weights taken before the rollout the run
            recorded for it (USED), each token keeping its version."""

            def rollout(self, index, trainer):
                from ndtrain.train.rl.rollout import generate_in_segments
                layout = self._generator(trainer).layout
                self.snapshots[index] = frozen_copy(trainer.par, self.cfg, trainer.args, layout)
                used, reference, t = USED[index], self._reference(trainer), self.cfg.train
                versions = lambda j: (self.snapshots[used[j]], used[j])  # noqa: E731
                rounds, kept = self.sample_rounds(index, lambda rows, prompts, seeds: generate_in_segments(
                    versions, PARTIAL, prompts, seeds, self.sampling, self.env.template.stop_ids,
                    self.env.template.pad_id, lambda i, ids: self.env.score(rows[i], ids)[:4], reference,
                    t.micro_batch, t.loss_chunk))
                return self.assemble(rounds, kept, index, used[0], trainer)

        class KilledGenerator(RL):
            """Kills its generator just before the trainer sends it the weights of rollout 1
            ("killed"), or stops it there (SIGSTOP, "hung": alive and silent). The time of the
            signal is kept (`stopped_at`, rank 0's clock)."""

            stopped_at = None

            def before_update(self, step, trainer):
                if step == 1 and self.rollouts is not None and self.rollouts.procs:
                    proc = self.rollouts.procs[0]
                    os.kill(proc.pid, signal.SIGKILL if kind == "killed" else signal.SIGSTOP)
                    KilledGenerator.stopped_at = time.monotonic()
                    if kind == "killed":  # (a stopped process never ends: no wait for it)
                        proc.wait()
                super().before_update(step, trainer)

        cls = {"delayed": DelayedRL, "partial": PartialRL, "used": UsedVersionsRL, "killed": KilledGenerator,
               "hung": KilledGenerator}.get(kind, RL)
        task = cls(cfg, Environment(cfg, BuiltinTemplate(char_tokenizer())))
        TASKS.append(task)
        return task
    return make


def _rows(rows):
    """Each row: (name, overrides, kind): "async" (a proof run, with or without generators),
    "reference" (the synchronous job and its twin), "delayed" (DelayedRL and its twin),
    "killed" (the message every rank ends with)."""
    from helpers import proof_in_rank, reference_in_rank, train_in_rank
    from ndtrain.launch import set_collective_timeout
    from ndtrain.train.trainer import TrainingError
    # The job's collective limit (run.collective_timeout_s, 600 s), as `ndtrain rl` sets it, not
    # run_ranks' 120 s: the other ranks wait in a broadcast while rank 0 waits for a generator
    # to start (up to 120 s on a loaded machine) or for a rollout.
    set_collective_timeout(600.0)
    out = {}
    for name, overrides, kind in rows:
        try:
            if kind in ("killed", "hung"):
                try:
                    train_in_rank(ASYNC_PROOF + overrides, "", make_task=_make(kind))
                    out[name] = "no error"
                except TrainingError as e:
                    out[name] = str(e)
                rollouts = next((t.rollouts for t in TASKS if t.rollouts is not None), None)
                out[f"{name}-failures"] = [f[1] for f in rollouts.failures] if rollouts else None  # this rank's own
                stopped = next((t.stopped_at for t in TASKS if getattr(t, "stopped_at", None)), None)
                out[f"{name}-s"] = None if stopped is None else time.monotonic() - stopped  # rank 0's
                continue
            run = (reference_in_rank if kind in ("delayed", "partial", "used", "reference") else proof_in_rank)(
                ASYNC_PROOF + overrides, "", make_task=_make(kind))
            rollouts = next((t.rollouts for t in TASKS if t.rollouts is not None), None)
            if rollouts is not None:  # what this rank sent over the weight bridge, the versions each rollout used
                run["sent"] = sorted(rollouts.sent_names)
                USED.clear()
                USED.update(rollouts.segments_used)
                run["used"] = dict(USED)
            history = run.pop("history")
            run["metrics"] = [{k: r.get(k) for k in ("reward_mean", "staleness", "behaviour_weight",
                                                      "generator_idle", "token_staleness", "refills")}
                              for r in history]
            out[name] = run
        finally:
            while TASKS:
                TASKS.pop().close()
    return out


ASYNC = ["rl.generate_ranks=1"]
# The layout families whose synchronous job samples without tensor parallelism (the training
# model itself, or a one-process copy), as a generator process does: there K = 0 is the
# synchronous job bit for bit. Under tp2 the synchronous job samples tensor-parallel (other
# rounding of the behaviour and reference log-probabilities): the tolerance rule.
FAMILIES = [("dp2", ["parallel.dp=2", "train.micro_batch=2"]), ("zero3", ["parallel.zero=3", "train.micro_batch=2"]),
            ("pp2", ["parallel.pp=2", "train.micro_batch=2"]), ("cp2", ["parallel.cp=2", "train.micro_batch=4"])]


def _same(a: dict, b: dict) -> bool:
    import torch
    return (a["losses"] == b["losses"] and a["norms"] == b["norms"] and a["state"].keys() == b["state"].keys()
            and all(torch.equal(a["state"][k], v) for k, v in b["state"].items()))


def test_a_generator_process_at_k0_changes_nothing():
    """The default tier's row: one process and its generator at K = 0, two updates, equal
    to the synchronous job bit for bit in fp64 (the slow tier proves every family and K = 2)."""
    short = ["train.steps=2"]
    runs = run_ranks(_rows, 1, [("sync", short, "async"), ("k0", ASYNC + short, "async")], timeout=300)[0]
    assert _same(runs["k0"], runs["sync"]) and len(runs["sync"]["losses"]) == 2


@pytest.mark.slow
def test_async_rl_k0_equals_sync_bit_for_bit_and_k2_equals_the_delayed_reference():
    """One launch of 1 process (plus its generator), one of 2 (plus one generator): K = 0
    against the synchronous job, bit for bit where both sample without tensor parallelism
    (one process, dp2, ZeRO-3, pp2, cp2), under the tolerance rule under tp2; K = 2 against
    DelayedRL under the tolerance rule (one process, dp2); with the newest weights a
    generator holds, never staler than K; under pp2 each stage's sender sends exactly its
    stage's parameters; a generator killed before its weights of rollout 1 ends both training
    ranks with the same line (dp2, and pp2, where rank 1, stage 1's sender, finds the dead
    generator on its own bridge group)."""
    from helpers import assert_proof
    one = run_ranks(_rows, 1, [("sync", [], "reference"), ("k0", ASYNC, "async"), ("delayed", [], "delayed"),
                               ("k2", ASYNC + [f"rl.max_staleness={STALE}"], "async"),
                               ("newest", ASYNC + [f"rl.max_staleness={STALE}", "rl.async_weights=newest"], "async")],
                    timeout=600)[0]
    sync, ref = one["sync"], one["delayed"]
    assert _same(one["k0"], sync)
    assert [m["staleness"] for m in one["k0"]["metrics"]] == [0] * 5
    assert [m["staleness"] for m in ref["metrics"]] == [0, 1, 2, 2, 2]
    assert all(m["behaviour_weight"] != 1.0 for m in ref["metrics"][1:])  # the correction is at work
    assert ref["losses"] != sync["losses"]
    assert [m["reward_mean"] for m in one["k2"]["metrics"]] == [m["reward_mean"] for m in ref["metrics"]]
    assert_proof(one["k2"], ref)
    assert [m["staleness"] for m in one["k2"]["metrics"]] == [0, 1, 2, 2, 2]
    # the newest weights a generator holds: never older than K (which weights is the race's)
    assert all(0 <= m["staleness"] <= STALE for m in one["newest"]["metrics"]), one["newest"]["metrics"]
    rows = [row for name, o in FAMILIES for row in ((f"{name}-sync", o, "async"), (f"{name}-k0", ASYNC + o, "async"))]
    two = run_ranks(_rows, 2, rows + [
        ("tp2-k0", ASYNC + ["parallel.tp=2"], "async"),
        ("dp2-k2", ASYNC + [f"rl.max_staleness={STALE}", "parallel.dp=2", "train.micro_batch=2"], "async"),
        ("killed", ASYNC + ["parallel.dp=2"], "killed"),
        ("killed-pp2", ASYNC + ["parallel.pp=2", "train.micro_batch=2"], "killed")], timeout=900)
    runs = two[0]
    for name, _ in FAMILIES:
        assert _same(runs[f"{name}-k0"], runs[f"{name}-sync"]), name
        assert_proof(runs[f"{name}-sync"], sync)  # and both equal one process
    assert_proof(runs["tp2-k0"], sync)
    # the weight bridge: each stage's sender sends the parameters its stage holds (pp2: rank 1
    # the last layers, the final norm and the head), none other, and together all of them
    stage = [set(two[r]["pp2-k0"]["sent"]) for r in (0, 1)]
    assert {"output.weight", "norm.weight", "layers.3.attention.wq.weight"} <= stage[1], stage
    assert {"tok_embeddings.weight", "layers.0.attention.wq.weight"} <= stage[0], stage
    assert not stage[0] & stage[1] and stage[0] | stage[1] == set(runs["pp2-k0"]["state"]), stage
    assert two[1]["dp2-k0"]["sent"] == [] and set(runs["dp2-k0"]["sent"]) == set(runs["dp2-k0"]["state"])
    assert_proof(runs["dp2-k2"], ref)
    line = (r"ndtrain rl: generator rank 2 exited with status -9 (before sending rollout 1|while sent the weights of "
            r"rollout 1) \(update 1\)")
    assert re.fullmatch(line, runs["killed"]) and two[1]["killed"] == runs["killed"], two
    # pp2: stage 1's sender (rank 1) finds the dead generator on its own bridge group, and every
    # rank ends with the same line
    assert re.fullmatch(line, runs["killed-pp2"]) and two[1]["killed-pp2"] == runs["killed-pp2"], two
    assert two[1]["killed-pp2-failures"] == ["while sent the weights of rollout 1"], two


@pytest.mark.slow
def test_partial_rollouts_continue_on_new_weights_equal_the_mixed_version_reference():
    """rl.partial_rollout = continue at K = 2, segments of 2 of the 6 new tokens, one process
    and its generator: rollout t's segments sampled by the weights of t − 2, t − 1 and t,
    each token's importance weight from its own version; against PartialRL (one process,
    the mixed-version sequences built directly from copies of the weights), fp64, the
    tolerance rule. The same rewards, the staleness of the oldest token 2 and of the mean
    token between 0 and 2; and the reference differs from K = 2 without continuing (the
    segments matter). Under dapo too, whose refill rounds start again on each rollout's own
    weights (the generator had moved on to a later segment's)."""
    from helpers import assert_proof
    partial = ASYNC + [f"rl.max_staleness={STALE}", "rl.partial_rollout=continue", f"rl.partial_tokens={PARTIAL}"]
    # dynamic sampling, on a one-bit reward that leaves some groups all equal: refill rounds,
    # each starting again on the rollout's own weights
    dapo = ["rl.loss=dapo", "rl.reward=test_rl_async:parity_reward", "rl.overlong_buffer=0"]
    runs = run_ranks(_rows, 1, [("ref", [], "partial"), ("run", partial, "async"), ("delayed", [], "delayed"),
                                ("ref-dapo", dapo, "partial"), ("run-dapo", partial + dapo, "async")], timeout=600)[0]
    ref, run = runs["ref"], runs["run"]
    assert [m["reward_mean"] for m in run["metrics"]] == [m["reward_mean"] for m in ref["metrics"]]
    assert [m["staleness"] for m in run["metrics"]] == [0, 1, 2, 2, 2] == [m["staleness"] for m in ref["metrics"]]
    assert all(0 < m["token_staleness"] < 2 for m in ref["metrics"][2:]), ref["metrics"]
    assert ref["losses"] != runs["delayed"]["losses"]
    assert_proof(run, ref)
    assert any(m["refills"] for m in runs["ref-dapo"]["metrics"][2:]), runs["ref-dapo"]["metrics"]
    assert [m["reward_mean"] for m in runs["run-dapo"]["metrics"]] == [m["reward_mean"] for m in
                                                                        runs["ref-dapo"]["metrics"]]
    assert_proof(runs["run-dapo"], runs["ref-dapo"])


@pytest.mark.slow
def test_continued_rollouts_on_the_newest_weights_equal_the_reference_of_the_versions_they_used():
    """rl.async_weights = newest with rl.partial_rollout = continue (K = 2, segments of 2 of
    24 new tokens, so that a generation tends to outlast an update and new weights come in
    mid-rollout), one process and its generator: which weights sample each segment is the
    race's, so the reference follows the versions the run recorded (UsedVersionsRL, built
    directly from copies of the weights): fp64, the tolerance rule, the same rewards and token
    staleness; no segment staler than K, none newer than its rollout, and a segment never older
    than the one before it. (Measured idle: rollouts 1 to 4 each switched weights mid-way.)"""
    from helpers import assert_proof
    longer = ["train.seq_len=40", "rl.max_new_tokens=24"]  # 12 segments: a generation outlasts an update
    newest = ASYNC + longer + [f"rl.max_staleness={STALE}", "rl.partial_rollout=continue",
                               f"rl.partial_tokens={PARTIAL}", "rl.async_weights=newest"]
    runs = run_ranks(_rows, 1, [("run", newest, "async"), ("ref", longer, "used")], timeout=600)[0]
    run, ref, used = runs["run"], runs["ref"], runs["run"]["used"]
    print("segment versions by rollout:", used)
    assert sorted(used) == list(range(5)), used
    assert all(t - STALE <= u[0] and u == sorted(u) and u[-1] <= t for t, u in used.items()), used
    assert [m["staleness"] for m in run["metrics"]] == [t - used[t][0] for t in range(5)]
    assert [m["reward_mean"] for m in run["metrics"]] == [m["reward_mean"] for m in ref["metrics"]]
    assert [m["token_staleness"] for m in run["metrics"]] == [m["token_staleness"] for m in ref["metrics"]]
    assert_proof(run, ref)


def parity_reward(prompt: str, completion: str, answer: str) -> float:
    """One bit: whether the completion's first character has an odd code (a group of 4 is
    all equal one time in 8)."""
    return float(ord(completion[0]) % 2) if completion else 0.0


HUNG_LIMIT = 5.0  # rl.exchange_timeout_s of the stopped-generator rows
# A stopped generator lets one limit pass (the weights' send, or the rollout's wait: the send
# ends the wait at once when it fails), then rank 0 kills it; the margin is a loaded machine's.
HUNG_BOUND = 2 * HUNG_LIMIT + 30.0
HUNG_LINE = (r"ndtrain rl: generator rank 2 (sent no rollout 1 within 5 s \(rl.exchange_timeout_s; update 1\)|did not "
             r"take it within 5 s \(rl.exchange_timeout_s\) while sent the weights of rollout 1 \(update 1\))")


@pytest.mark.slow
def test_a_stopped_generator_ends_every_training_rank_within_the_limit():
    """dp2 and one generator, stopped (SIGSTOP: alive, silent) just before the trainer sends
    it the weights of rollout 1: both training ranks end with the same one line naming the
    generator's rank and the update, within the limit and a margin (the code before hung here:
    the test waited on the stopped process)."""
    runs = run_ranks(_rows, 2, [("hung", ASYNC + ["parallel.dp=2", f"rl.exchange_timeout_s={HUNG_LIMIT:g}"], "hung")],
                     timeout=600)
    print(f"{runs[0]['hung']} ({runs[0]['hung-s']:.1f} s after the stop)")
    assert re.fullmatch(HUNG_LINE, runs[0]["hung"]) and runs[1]["hung"] == runs[0]["hung"], runs
    assert runs[0]["hung-s"] < HUNG_BOUND, runs


@pytest.mark.slow
def test_the_cli_ends_a_run_whose_generator_stops_in_one_line(tmp_path):
    """`ndtrain rl --nproc 2` with a generator, stopped (SIGSTOP) mid-run after its second
    rollout: the run exits with status 1 within the limit and a margin, its last stderr line
    names the generator's rank and the update, and no traceback is printed."""
    import subprocess
    import sys
    metrics = tmp_path / "run" / "metrics.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ndtrain.cli", "rl", "--nproc", "2", "model.init_from=scratch", "model.preset=tiny",
         "run.device=cpu", f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={tmp_path / 'run'}", "train.global_batch=8",
         "rl.group_size=4", "train.steps=200", "rl.max_new_tokens=8", "rl.eval_prompts=0", "train.eval_every=0",
         "run.progress=false", "run.plot=false", "run.threads=1", "rl.generate_ranks=1", "rl.max_staleness=1",
         f"rl.exchange_timeout_s={HUNG_LIMIT:g}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        generator = None
        while proc.poll() is None and (generator is None or not metrics.exists()
                                       or len(metrics.read_text().splitlines()) < 2):
            generator = generator or next((p for p in _descendants(proc.pid)
                                           if b"ndtrain.train.rl.generator" in _cmdline(p)), None)
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()
        os.kill(generator, signal.SIGSTOP)
        stopped = time.monotonic()
        code = proc.wait(600)
        elapsed = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    last = err.strip().splitlines()[-1]
    assert code == 1 and "Traceback" not in err, err
    assert re.fullmatch(r"ndtrain: error: rank [01] failed: TrainingError: ndtrain rl: generator rank 2 (sent no "
                        r"rollout \d+ within 5 s \(rl.exchange_timeout_s; update \d+\)|did not take it within 5 s "
                        r"\(rl.exchange_timeout_s\) while sent the weights of rollout \d+ \(update \d+\))", last), err
    assert elapsed < HUNG_BOUND, (elapsed, err)


def _descendants(pid: int) -> list[int]:
    """Every process under `pid` (Linux /proc), so the signal reaches this test's generator only."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out + [d for c in out for d in _descendants(c)]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@pytest.mark.slow
def test_a_generator_the_trainer_never_answers_exits_with_one_line(tmp_path):
    """The generator's side of the limit: it connects, takes its setup, and no weights come:
    after rl.exchange_timeout_s it exits with status 1 and one line naming its rank and the
    rollout it waited for; and when the trainer's connection closes instead, it exits 0."""
    import pickle
    import subprocess
    import sys
    from multiprocessing.connection import Listener

    from ndtrain.config import load_config, validate
    from ndtrain.data.template import BuiltinTemplate
    from ndtrain.data.verifiable import char_tokenizer
    from ndtrain.parallel import weight_bridge
    from ndtrain.train.rl.asynchronous import KEY_ENV
    cfg = validate(load_config(None, ["model.preset=tiny", "run.device=cpu", "train.global_batch=8",
                                      "rl.group_size=4", "train.seq_len=16"]), world=1)
    for close in (False, True):
        key = os.urandom(16)
        store, address = weight_bridge.open_store(60.0)
        with Listener(("127.0.0.1", 0), authkey=key) as listener:
            env = dict(os.environ, **{KEY_ENV: key.hex(), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
            proc = subprocess.Popen([sys.executable, "-m", "ndtrain.train.rl.generator", *map(str, listener.address)],
                                    env=env, stderr=subprocess.PIPE, text=True)
            conn = listener.accept()
            conn.send_bytes(pickle.dumps({"cfg": cfg.to_dict(), "args": cfg.model_args(), "generator": 0, "world": 2,
                                          "template": BuiltinTemplate(char_tokenizer()), "start": 0, "total": 3,
                                          "staleness": 0, "generators": 1, "threads": 1, "timeout": 3.0,
                                          "device": "cpu", "bridge": address, "stages": 1, "join_limit": 60.0}))
            bridge = weight_bridge.join(address, [(0, 0)], 0, 3.0, 60.0)  # the trainer's side of it
            assert not isinstance(bridge[(0, 0)], str), bridge
            if close:
                conn.close()
            code, err = proc.wait(120), proc.stderr.read().strip()
        if close:
            assert code == 0 and err == "", err
        else:
            assert code == 1 and err == ("ndtrain rl: generator rank 2: no weights of rollout 0 (for rollout 0) from "
                                         "the trainer within 3 s (rl.exchange_timeout_s); exiting"), err


@pytest.mark.parametrize("extra, expect", [
    (["rl.max_staleness=2"], "rl.max_staleness = 2: needs rl.generate_ranks >= 1"),
    (["rl.off_policy=ppo"], "rl.off_policy = 'ppo': choose one of tis, decoupled"),
    (["rl.async_weights=latest"], "rl.async_weights = 'latest': choose fixed or newest"),
    (["rl.tis_cap=0.5"], "rl.tis_cap = 0.5: must be >= 1"),
    (["rl.generate_ranks=-1"], "rl.generate_ranks = -1: must be >= 0"),
    (["rl.exchange_timeout_s=0"], "rl.exchange_timeout_s = 0.0: must be > 0"),
    (["rl.generate_ranks=1", "rl.exchange_timeout_s=700"],
     "rl.exchange_timeout_s = 700.0: must be below run.collective_timeout_s = 600"),
])
def test_bad_async_input_is_one_line_exit_2_nothing_written(extra, expect, tmp_path, capsys, monkeypatch):
    from ndtrain.cli import main
    monkeypatch.chdir(tmp_path)
    code = main(["rl", "--nproc", "1", "model.init_from=scratch", "model.preset=tiny", "run.device=cpu",
                 f"data.cache_dir={tmp_path / 'cache'}", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expect in err, err
    assert list(tmp_path.iterdir()) == []


def test_behaviour_weights_by_hand():
    """w = π_old / π_behaviour per trained token, truncated at the cap under tis, 1 elsewhere."""
    import math

    import torch
    from ndtrain.train.rl.losses import behaviour_weights
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    behaviour = torch.tensor([[-1.5, -1.0, -3.0]], dtype=torch.float64)
    trained = torch.tensor([[True, True, False]])
    tis = behaviour_weights(old, behaviour, trained, "tis", 1.5)
    assert torch.allclose(tis, torch.tensor([[1.5, math.exp(-1.0), 1.0]], dtype=torch.float64), rtol=0, atol=1e-15)
    whole = behaviour_weights(old, behaviour, trained, "decoupled", 1.5)
    assert torch.allclose(whole, torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0]], dtype=torch.float64),
                          rtol=0, atol=1e-15)
