"""Checkpoints written behind training (`run.async_save = true`, checkpoint/background.py):
the same bytes as a synchronous save, training goes on while one is written, at most one in
flight, a failure in the background stops the run with one line on every rank, and a crash
in the middle of one resumes from the previous good checkpoint with the losses of a run
that never crashed.

One launch of 2 ranks (ZeRO-1: each rank writes its own file, and the ranks coordinate the
save over their gloo group) runs every scenario; the tests read its results.
"""

import errno
import threading
from pathlib import Path

import pytest
import torch

from ckpt_helpers import train
from ndtrain.testing import run_ranks

BASE = ["parallel.zero=1", "train.steps=6", "train.save_every=2"]
ASYNC = BASE + ["run.async_save=true"]
PATIENCE_S = 60.0  # how long a held write waits to be released before it gives up (the test then fails)


def _hold_first_write(log: list):
    """Install in the ranks' process: the write of the first checkpoint (step 2) is held
    until the training loop starts waiting for it (the save of step 4), so training runs on
    while it is in flight; every write is logged (start, end, the steps trained by then)."""
    from ndtrain.checkpoint import store
    original, active, lock = store.write_safetensors, [0], threading.Lock()
    released = threading.Event()
    trainer_box = []

    def write(path, *args, **kwargs):
        step = int(Path(path).parent.name.removesuffix(".tmp").removeprefix("step_"))
        with lock:
            active[0] += 1
            log.append(("start", step, active[0]))
        if step == 2:
            log.append(("released", step, released.wait(PATIENCE_S), trainer_box[0].step))
        try:
            return original(path, *args, **kwargs)
        finally:
            with lock:
                active[0] -= 1
                log.append(("end", step, active[0]))

    def before_fit(trainer):
        trainer_box.append(trainer)
        wait = trainer.saver.wait

        def waiting():
            if trainer.saver.pending:  # (`start` also calls it when nothing is in flight)
                released.set()
            return wait()
        trainer.saver.wait = waiting
    store.write_safetensors = write
    return before_fit, lambda: setattr(store, "write_safetensors", original)


def _fail_write_on_rank_1(step: int):
    """Install: rank 1's write of checkpoint `step` fails as a full disk does."""
    import torch.distributed as dist

    from ndtrain.checkpoint import store
    original = store.write_safetensors

    def write(path, *args, **kwargs):
        if dist.get_rank() == 1 and Path(path).parent.name == f"step_{step:07d}.tmp":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return original(path, *args, **kwargs)
    store.write_safetensors = write
    return lambda: setattr(store, "write_safetensors", original)


def _fault_while_saving(log: list):
    """Install: the write of checkpoint 2 is held until step 3, which raises."""
    from ndtrain.checkpoint import store
    original, gate = store.write_safetensors, threading.Event()

    def write(path, *args, **kwargs):
        if Path(path).parent.name == "step_0000002.tmp":
            gate.wait(PATIENCE_S)
        return original(path, *args, **kwargs)

    def before_fit(trainer):
        run_step = trainer.train_step

        def train_step(step):
            if step == 3:
                log.append(("in flight at the fault", trainer.saver.pending))
                gate.set()
                raise RuntimeError("a fault of step 3")
            return run_step(step)
        trainer.train_step = train_step
    store.write_safetensors = write
    return before_fit, lambda: setattr(store, "write_safetensors", original)


def _files(run: Path) -> dict:
    """Every checkpoint's files: the bytes of each safetensors file, and meta.json without
    the moment it was saved and the config (which holds run.async_save)."""
    import json
    out = {}
    for folder in sorted((run / "checkpoints").glob("step_*")):
        for f in sorted(folder.iterdir()):
            if f.name == "meta.json":
                meta = json.loads(f.read_text())
                meta.pop("saved_at"), meta.pop("config")
                out[f"{folder.name}/{f.name}"] = meta
            else:
                out[f"{folder.name}/{f.name}"] = f.read_bytes()
    return out


def _scenarios(data_dir, root):
    import torch.distributed as dist

    from ndtrain.checkpoint import store
    from ndtrain.train.trainer import TrainingError
    root = Path(root)
    out = {"sync": train(BASE, data_dir, str(root / "sync"))[:2]}
    log = []
    before_fit, restore = _hold_first_write(log)
    try:
        losses, state, trainer = train(ASYNC, data_dir, str(root / "async"), before_fit=before_fit)
    finally:
        restore()
    out["async"] = (losses, state)
    out["log"] = log
    out["files"] = (_files(root / "sync"), _files(root / "async"))

    restore = _fail_write_on_rank_1(4)
    try:
        train(ASYNC, data_dir, str(root / "full"))
        out["full"] = "no error"
    except TrainingError as e:
        out["full"] = str(e)
    finally:
        restore()
    dist.barrier()
    fault = []
    before_fit, restore = _fault_while_saving(fault)
    try:
        train(ASYNC, data_dir, str(root / "fault"), before_fit=before_fit)
        fault.append("no error")
    except RuntimeError as e:
        fault += [str(e), str(store.latest(root / "fault"))]
    finally:
        restore()
    out["fault"] = fault
    out["full-left"] = sorted(p.name for p in (root / "full" / "checkpoints").iterdir())
    out["full-latest"] = store.latest(root / "full").name
    out["full-resumed"] = train(ASYNC, data_dir, str(root / "full"))[:2]
    return out


@pytest.fixture(scope="module")
def scenarios(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    return root, run_ranks(_scenarios, 2, tiny_data, str(root), timeout=600)


def _same(a, b):
    (la, sa), (lb, sb) = a, b
    assert la == lb
    if sa is not None:
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


def test_async_saves_write_the_bytes_of_sync_saves(scenarios):
    """Same losses and weights, the same files byte for byte (meta.json equal but for the
    time and the config). (A run resumed from an async checkpoint ends as the uninterrupted
    one: the failed-write test below.)"""
    _, results = scenarios
    out = results[0]
    _same(out["async"], out["sync"])
    sync_files, async_files = out["files"]
    assert sorted(async_files) == sorted(sync_files)
    assert {n.split("/")[0] for n in sync_files} == {"step_0000002", "step_0000004", "step_0000006"}
    for name in sync_files:
        assert async_files[name] == sync_files[name], name


def test_training_runs_on_while_a_save_is_written_and_one_at_a_time(scenarios):
    """The write of checkpoint 2 is held until the loop waits for it; it is released only
    when the save of step 4 begins, so steps 2 and 3 were trained while it was in flight
    (a save that blocked the step would never be released and fail). No two writes overlap:
    each starts after the previous one ended."""
    _, results = scenarios
    for rank, out in enumerate(results):
        log = out["log"]
        released = [e for e in log if e[0] == "released"]
        assert released == [("released", 2, True, 4)], (rank, log)
        bounds = [e for e in log if e[0] in ("start", "end")]
        assert bounds == [(kind, step, 1 if kind == "start" else 0)
                          for step in (2, 4, 6) for kind in ("start", "end")], (rank, log)


def test_a_failed_background_write_stops_every_rank_with_one_line_and_resumes(scenarios):
    """Rank 1's disk fills while checkpoint 4 is written behind training: every rank stops
    with the same line naming the file and the last good checkpoint; nothing of step 4 is
    called good (`latest` names step 2, only a .tmp folder is left), and the next start
    resumes step 2 (a checkpoint written in the background) and ends with the uninterrupted
    run's losses and weights, bit for bit."""
    root, results = scenarios
    message = results[0]["full"]
    assert message.startswith("step 4: ") and "\n" not in message, message
    assert "no space left on" in message.lower(), message
    assert str(root / "full" / "checkpoints" / "step_0000004.tmp" / "rank-00001.safetensors") in message, message
    assert f"last good checkpoint: {root / 'full' / 'checkpoints' / 'step_0000002'}" in message, message
    assert results[1]["full"] == message
    out = results[0]
    assert out["full-left"] == ["latest", "step_0000002", "step_0000004.tmp"]
    assert out["full-latest"] == "step_0000002"
    _same(out["full-resumed"], (out["sync"][0][2:], out["sync"][1]))


def test_an_error_in_the_loop_waits_for_the_save_in_flight(scenarios):
    """Step 3 fails while checkpoint 2 is still being written (held until then): the error
    reaches the caller only after that checkpoint is complete and `latest` names it."""
    root, results = scenarios
    for out in results:
        assert out["fault"] == [("in flight at the fault", True), "a fault of step 3",
                                str(root / "fault" / "checkpoints" / "step_0000002")], out["fault"]


def _staging(device: torch.device):
    """Two saves' staging of the same share: each a copy (the training steps after it
    change the weights in place; the staged values must not move), into views of one host
    slab (allocated once, not one allocation per tensor), pinned where the data are on CUDA."""
    from ndtrain.checkpoint.background import BackgroundSave
    data = [torch.arange(6.0, device=device), torch.arange(4, device=device, dtype=torch.int64)]
    saver = BackgroundSave(device)
    first = saver.stage([("a", None, data[0]), ("b", None, data[1])])
    kept = [t.clone() for _, _, t in first]
    for t in data:
        t.add_(1)
    assert all(torch.equal(s, k) for (_, _, s), k in zip(first, kept))
    second = saver.stage([("a", None, data[0]), ("b", None, data[1])])
    assert len({s.untyped_storage().data_ptr() for _, _, s in second}) == 1  # one slab
    assert [s.data_ptr() for _, _, s in second] == [s.data_ptr() for _, _, s in first]
    assert all(s.device.type == "cpu" and torch.equal(s, d.cpu()) for (_, _, s), d in zip(second, data))
    return [s.is_pinned() for _, _, s in second]


def test_staging_copies_the_share_into_one_host_slab_reused_by_the_next_save():
    assert _staging(torch.device("cpu")) == [False, False]


@pytest.mark.cuda
def test_staging_copies_cuda_tensors_into_pinned_host_buffers():
    assert _staging(torch.device("cuda", 0)) == [True, True]


def test_a_second_interrupt_does_not_wait_for_the_save_and_says_so(tmp_path, monkeypatch):
    """A KeyboardInterrupt (the second Ctrl-C: exit at once) while a checkpoint is written
    behind training: the loop does not wait for it, and one line says that the next start
    checks it. (Any other error waits: test_an_error_in_the_loop_waits_for_the_save_in_flight.)"""
    from types import SimpleNamespace

    from ndtrain.checkpoint import store
    from ndtrain.checkpoint.background import BackgroundSave
    from ndtrain.checkpoint.slices import Piece
    from ndtrain.train.trainer import Trainer
    gate, write = threading.Event(), store.write_safetensors
    monkeypatch.setattr(store, "write_safetensors", lambda *a, **k: gate.wait(PATIENCE_S) and write(*a, **k))
    saver = BackgroundSave(torch.device("cpu"))
    saver.start(tmp_path, 6, [("weight/w", Piece.whole((6,)), torch.arange(6.0))], {})
    lines = []
    Trainer._abandon_save(SimpleNamespace(saver=saver, report=lines.append), KeyboardInterrupt())
    assert saver.pending and lines == ["interrupted while the checkpoint of step 6 was written in the background; "
                                       "the next start checks it and falls back to the previous one if it is "
                                       "incomplete"]
    gate.set()
    assert saver.wait() == store.step_dir(tmp_path, 6) and store.problem(store.step_dir(tmp_path, 6)) is None
