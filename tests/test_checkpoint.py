"""Resume that cannot go wrong: corrupt checkpoints are refused by name and the previous one
is used, non-finite weights are never saved, old checkpoints are pruned (never the newest),
a resume may change the layout, ZeRO stage and precision but not the model or the data.

One launch of 2 ranks (ZeRO-1: each rank writes its own file) runs every scenario; the tests
read its results.
"""

import shutil
from pathlib import Path

import pytest
import torch

from ckpt_helpers import copy_checkpoint, train
from ndtrain.testing import run_ranks

BASE = ["parallel.zero=1", "train.steps=8", "train.save_every=2"]
CORRUPTIONS = ("truncate", "flip", "delete", "meta")


def _corrupt(run: Path, step: int, how: str) -> str:
    """Damage one file of checkpoint `step`; returns the file's name."""
    from ndtrain.checkpoint.store import step_dir
    folder = step_dir(run, step)
    victim = folder / ("meta.json" if how == "meta" else "rank-00001.safetensors")
    data = bytearray(victim.read_bytes())
    if how == "truncate":
        victim.write_bytes(data[:len(data) // 2])
    elif how == "flip":  # one byte in the middle of the tensor data: same size, other content
        data[len(data) // 2] ^= 0x40
        victim.write_bytes(bytes(data))
    elif how == "delete":
        victim.unlink()
    else:
        victim.write_text('{"format": "ndtrain-checkpoint", "vers')
    return victim.name


def _poison_after(step: int):
    """After `step` has run, one weight becomes NaN on every rank (the loss stays finite)."""
    def install(trainer):
        run_step = trainer.train_step

        def train_step(s):
            record = run_step(s)
            if s == step:
                with torch.no_grad():
                    trainer.par.states.optim_params()[0].view(-1)[0] = float("nan")
            return record
        trainer.train_step = train_step
    return install


def _scenarios(data_dir, root):
    import torch.distributed as dist

    from ndtrain.train.trainer import TrainingError
    root = Path(root)
    out = {"straight": train(BASE, data_dir, str(root / "straight"))[:2]}
    for how in CORRUPTIONS:
        run = root / how
        for step in (2, 4, 6):
            copy_checkpoint(str(root / "straight"), step, str(run))
        if dist.get_rank() == 0:
            out[f"{how}-file"] = _corrupt(run, 6, how)
            (run / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n{"step": 5, "lo')  # torn by a crash
        dist.barrier()
        losses, state, trainer = train(BASE, data_dir, str(run))
        out[how] = (losses, state, trainer.refused)
    out["keep"] = sorted(p.name for p in (root / "straight" / "checkpoints").iterdir())
    train(BASE + ["train.keep_checkpoints=2"], data_dir, str(root / "keep"))
    out["kept"] = sorted(p.name for p in (root / "keep" / "checkpoints").iterdir())
    copy_checkpoint(str(root / "straight"), 4, str(root / "bf16"))
    out["bf16"] = train(["parallel.zero=3", "train.precision=bf16", "train.steps=8"], data_dir, str(root / "bf16"))[0]
    try:
        train(BASE, data_dir, str(root / "nan"), before_fit=_poison_after(3))
        out["nan"] = "no error"
    except TrainingError as e:
        out["nan"] = str(e)
    out["nan-kept"] = sorted(p.name for p in (root / "nan" / "checkpoints").iterdir())
    return out


@pytest.fixture(scope="module")
def scenarios(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return root, run_ranks(_scenarios, 2, tiny_data, str(root), timeout=600)[0]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_a_corrupt_checkpoint_is_named_and_the_previous_one_resumed(scenarios, how):
    root, out = scenarios
    straight_losses, straight_state = out["straight"]
    losses, state, refused = out[how]
    assert len(refused) == 1 and refused[0].startswith("checkpoint step_0000006 refused")
    assert out[f"{how}-file"] in refused[0], refused[0]
    assert losses == straight_losses[4:]  # resumed at step 4, bit for bit
    for k in straight_state:
        assert torch.equal(state[k], straight_state[k]), k
    from ndtrain.observe.metrics import read_metrics
    assert [r["step"] for r in read_metrics(root / how / "metrics.jsonl")] == [0, 4, 5, 6, 7]
    assert sorted(p.name for p in (root / how / "checkpoints").iterdir())[-1] == "step_0000008"


def test_keep_checkpoints_prunes_all_but_the_newest(scenarios):
    _, out = scenarios
    assert out["keep"] == ["latest", "step_0000002", "step_0000004", "step_0000006", "step_0000008"]
    assert out["kept"] == ["latest", "step_0000006", "step_0000008"]


def test_non_finite_weights_are_never_saved(scenarios):
    _, out = scenarios
    assert out["nan"].startswith("step 4: the weights or optimizer moments hold NaN or inf; not saving them"), out["nan"]
    assert "last good checkpoint: " in out["nan"] and out["nan"].split("last good checkpoint: ")[1].startswith(
        str(scenarios[0] / "nan" / "checkpoints" / "step_0000002"))
    assert out["nan-kept"] == ["latest", "step_0000002"]


def test_resume_may_change_zero_stage_and_precision(scenarios):
    """ZeRO-1 fp32 → ZeRO-3 bf16 at step 4: the fp32 masters and moments continue; the losses
    follow fp32 within the bf16 tracking tolerance of tests/test_precision.py."""
    _, out = scenarios
    straight, bf16 = out["straight"][0][4:], out["bf16"]
    assert len(bf16) == 4 and bf16 != straight
    for a, b in zip(bf16, straight):
        assert abs(a - b) <= 2e-3 * abs(b), (bf16, straight)


# --------------------------------------------------------------------------- the command line

@pytest.mark.parametrize("change, key", [
    ("model.dim=128", "model.dim"),
    ("model.n_layers=2", "model.n_layers"),
    ("train.seq_len=16", "train.seq_len"),
    ("train.global_batch=16", "train.global_batch"),
    ("train.seed=1", "train.seed"),
    ("data.path=OTHER", "data.path"),
])
def test_resume_refuses_another_model_or_other_data_and_writes_nothing(cli_run, change, key, capsys):
    from helpers import TINY
    from ndtrain.cli import main
    run, data = cli_run
    if change == "data.path=OTHER":
        other = run.parent / "other"
        other.mkdir(exist_ok=True)
        (other / "a.py").write_text("x = 1\n" * 100)
        change = f"data.path={other}"
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["train", "--nproc", "1", *TINY, f"data.path={data}", f"run.dir={run}", change]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ndtrain: error: {key} = ") and "differs from the" in err and "Traceback" not in err, err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@pytest.fixture(scope="module")
def cli_run(tiny_data, tmp_path_factory):
    """A run directory as the command line leaves it (2 steps on one process)."""
    run = tmp_path_factory.mktemp("cli_resume") / "run"
    train([f"data.path={tiny_data}", "train.steps=2"], tiny_data, str(run))
    return run, tiny_data


@pytest.mark.parametrize("overrides, fragment", [
    (["model.init_from=nowhere"], "model.init_from = 'nowhere': expected run:DIR"),
    (["model.init_from=run:/no/such/run"], "model.init_from = 'run:/no/such/run': no such directory"),
    (["model.init_from=hf:EMPTY"], "Hugging Face model EMPTY = '*.safetensors': none there"),
    (["model.init_from=run:EMPTY"], "EMPTY holds no usable checkpoint"),
    (["model.head_dim=15"], "model.head_dim = 15: head dim 15 must be even for RoPE"),
    (["model.qkv_bias=true", "model.qk_norm=true"], "model.qk_norm = True: with model.qkv_bias as well"),
    (["train.keep_checkpoints=-1"], "train.keep_checkpoints = -1: must be >= 0"),
    (["run.max_restarts=-1"], "run.max_restarts = -1: must be >= 0"),
    (["run.heartbeat_s=-5"], "run.heartbeat_s = -5.0: must be >= 0"),
    (["run.collective_timeout_s=0"], "run.collective_timeout_s = 0.0: must be > 0"),
])
def test_bad_checkpoint_keys_are_one_line_and_write_nothing(overrides, fragment, tmp_path, capsys, monkeypatch):
    from ndtrain.cli import main
    empty = tmp_path / "empty"
    empty.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    overrides = [o.replace("EMPTY", str(empty)) for o in overrides]
    assert main(["train", "run.device=cpu", f"run.dir={work / 'run'}"] + overrides) == 2
    err = capsys.readouterr().err
    assert fragment.replace("EMPTY", str(empty)) in err and err.count("\n") == 1, err
    assert list(work.iterdir()) == [] and list(empty.iterdir()) == []


def test_inspect_names_steps_layout_tensors_and_bytes_per_rank(scenarios, tmp_path, capsys):
    from ndtrain.cli import main
    run = tmp_path / "run"
    shutil.copytree(scenarios[0] / "straight", run)
    _corrupt(run, 8, "flip")
    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(run), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "step_0000008  REFUSED: " in out and "rank-00001.safetensors does not match its SHA-256" in out
    assert "step_0000006  ok" in out and "step_0000002  ok" in out
    assert "layout    dp_shard=2, zero=1, fp32" in out and "step      8 (2,048 tokens)" in out
    assert "weight/layers.0.attention.wq.weight" in out and "exp_avg_sq/norm.weight" in out
    assert "rank-00000.safetensors" in out and "rank-00001.safetensors" in out
    assert main(["checkpoint", "inspect", str(tmp_path / "nothing")]) == 2


# --------------------------------------------------------------------------- durability

KEEP_ONE = ["train.steps=8", "train.save_every=2", "train.keep_checkpoints=1"]


class Crash(BaseException):
    """The process dies here (nothing after this point of the save runs)."""


def _crash_at(monkeypatch_target, attr, when):
    """Replace `monkeypatch_target.attr` by a wrapper that raises Crash when `when(*args)`."""
    original = getattr(monkeypatch_target, attr)

    def wrapper(*args, **kwargs):
        if when(*args):
            raise Crash(attr)
        return original(*args, **kwargs)
    setattr(monkeypatch_target, attr, wrapper)
    return lambda: setattr(monkeypatch_target, attr, original)


def _crash_and_resume(data_dir, root, extra):
    """One process, a checkpoint every 2 of 8 steps and only the newest kept. The save of
    step 6 dies (a) between writing and the rename, (b) right after the rename, before the
    read-back and the pruning, with the new files then truncated (what a machine crash does to
    bytes not yet on the disk). Each run is resumed by a fresh trainer, as the command line
    does. `extra`: run.async_save=true dies in the background thread, and the crash reaches
    the training loop when it next looks at the save."""
    import os

    from ndtrain.checkpoint import store
    root = Path(root)
    keep_one = KEEP_ONE + extra
    out = {"straight": train(keep_one, data_dir, str(root / "straight"))[:2]}
    crashes = {"before-rename": (os, "replace", lambda src, dst: Path(src).name == "step_0000006.tmp"),
               "after-rename": (store, "problem", lambda path: Path(path).name == "step_0000006")}
    for name, (target, attr, when) in crashes.items():
        run = root / name
        restore = _crash_at(target, attr, when)
        try:
            train(keep_one, data_dir, str(run))
            raise AssertionError(f"{name}: the save of step 6 did not crash")
        except Crash:
            pass
        finally:
            restore()
        left = sorted(p.name for p in (run / "checkpoints").iterdir())
        if name == "after-rename":
            victim = store.step_dir(run, 6) / "rank-00000.safetensors"
            victim.write_bytes(victim.read_bytes()[:100])
        losses, state, trainer = train(keep_one, data_dir, str(run))
        out[name] = {"left": left, "losses": losses, "state": state, "refused": trainer.refused}
    return out


@pytest.mark.parametrize("extra", [[], ["run.async_save=true"]], ids=["sync", "async"])
def test_a_crash_while_saving_resumes_from_the_previous_good_checkpoint(tiny_data, tmp_path, extra):
    """Issue 19: the previous checkpoint is pruned only once the new one is durable and reads
    back. Whether the save dies before or after its rename, the newest good checkpoint (step
    4) is still there, and the resumed run ends with the losses and weights of a run that
    never crashed, bit for bit; the same when the save is written behind training (issue 20)."""
    out = run_ranks(_crash_and_resume, 1, tiny_data, str(tmp_path), extra, timeout=300)[0]
    straight_losses, straight_state = out["straight"]
    assert out["before-rename"]["left"] == ["latest", "step_0000004", "step_0000006.tmp"]
    assert out["after-rename"]["left"] == ["latest", "step_0000004", "step_0000006"]
    assert out["before-rename"]["refused"] == []
    assert out["after-rename"]["refused"][0].startswith("checkpoint step_0000006 refused"), out["after-rename"]
    for name in ("before-rename", "after-rename"):
        assert out[name]["losses"] == straight_losses[4:], name  # resumed at step 4
        for k in straight_state:
            assert torch.equal(out[name]["state"][k], straight_state[k]), (name, k)


def test_a_save_fsyncs_every_file_and_folder_before_it_renames_or_points_at_them(tmp_path, monkeypatch):
    """The order of a save on the disk: every file written and fsynced, then its folder, then
    the rename and the fsync of `checkpoints/`, then `latest` (fsynced, renamed, its folder
    fsynced), and only then the pruning."""
    import os

    from ndtrain.checkpoint import files, store
    from ndtrain.checkpoint.slices import Piece
    events = []
    fsync, replace, rmtree = os.fsync, os.replace, store.shutil.rmtree

    def record_fsync(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")).name))
        fsync(fd)

    def record_replace(src, dst):
        events.append(("rename", Path(src).name, Path(dst).name))
        replace(src, dst)

    def record_rmtree(path, *a, **k):
        events.append(("remove", Path(path).name))
        rmtree(path, *a, **k)
    monkeypatch.setattr(files.os, "fsync", record_fsync)
    monkeypatch.setattr(store.os, "replace", record_replace)
    monkeypatch.setattr(store.shutil, "rmtree", record_rmtree)
    data = torch.arange(6.0)
    entries = [("weight/w", Piece.whole((6,)), data)]
    store.save(tmp_path, 1, entries, {})
    events.clear()
    store.save(tmp_path, 2, entries, {}, keep=1)
    assert events == [("fsync", "rank-00000.safetensors"), ("fsync", "meta.json"), ("fsync", "step_0000002.tmp"),
                      ("rename", "step_0000002.tmp", "step_0000002"), ("fsync", "checkpoints"),
                      ("fsync", "latest.partial"), ("rename", "latest.partial", "latest"), ("fsync", "checkpoints"),
                      ("remove", "step_0000001")], events


def test_a_checkpoint_that_does_not_read_back_keeps_the_previous_ones(tmp_path, monkeypatch):
    """A new checkpoint whose bytes on the disk are not what was written is refused by the
    save itself: an error, `latest` unchanged, the previous checkpoint still good."""
    from ndtrain.checkpoint import store
    from ndtrain.checkpoint.slices import Piece
    entries = [("weight/w", Piece.whole((6,)), torch.arange(6.0))]
    store.save(tmp_path, 1, entries, {}, keep=1)
    monkeypatch.setattr(store, "sha256_of", lambda path: "0" * 64)  # the disk returns other bytes
    with pytest.raises(store.CheckpointError, match=r"step 2: the checkpoint just written does not read back .*"
                                                    r"does not match its SHA-256.*; the previous checkpoints are kept"):
        store.save(tmp_path, 2, entries, {}, keep=1)
    monkeypatch.undo()
    assert store.latest(tmp_path).name == "step_0000001"
    assert store.problem(store.step_dir(tmp_path, 1)) is None
