"""Bad input and faults that still broke the promise (issue 33): one line, the right exit
status, no traceback, nothing written (bad input) or nothing lost (a fault)."""

import errno
import json

import pytest

from helpers import TINY, refused

CHEAP = ["--nproc", "1", "model.preset=tiny", "run.device=cpu", "train.steps=1"]  # were a case not refused


class FullDisk:
    """A file of `real` that takes the first `room` writes and then fills the disk: the write
    that fails puts half its bytes down first, as a write that runs out of space does. A
    buffered file keeps the rest and fails again on flush and close; an unbuffered one
    (buffering=0) holds nothing back."""

    def __init__(self, real, room: int, buffered: bool):
        self.real, self.room, self.buffered, self.pending = real, room, buffered, b""

    def write(self, data):
        if self.room > 0:
            self.room -= 1
            return self.real.write(data)
        half = len(data) // 2
        self.real.write(data[:half])
        self.real.flush()
        if self.buffered:
            self.pending = data[half:]
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        if self.pending:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real.flush()

    def close(self):
        try:
            self.flush()
        finally:
            self.real.close()

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_full_disk_while_writing_metrics(tmp_path, capsys, monkeypatch, tiny_data):
    """The disk fills while metrics.jsonl is written (train.save_every=0): one line naming the
    file and the step, exit status 1, and every line of metrics.jsonl whole JSON."""
    from ndtrain.cli import main
    from ndtrain.observe import metrics

    def full_after_one_line(path, mode="r", buffering=-1, *args, **kwargs):
        real = open(path, mode, buffering, *args, **kwargs)
        return FullDisk(real, room=1, buffered=buffering != 0) if "a" in mode else real
    monkeypatch.setattr(metrics, "open", full_after_one_line, raising=False)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    code = main(["train", "--nproc", "1", *TINY, f"data.path={tiny_data}", "train.steps=3", "train.log_every=1",
                 "train.save_every=0", f"run.dir={run}"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("ndtrain: error: step 1: writing ") and "metrics.jsonl failed (No space left on device)" \
        in err, err
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert [json.loads(line)["step"] for line in lines] == [0] and lines[-1].endswith("\n"), lines


def test_full_disk_during_a_save_says_what_was_free_when_it_failed(tmp_path, capsys, monkeypatch, tiny_data):
    """The disk fills halfway through the second checkpoint: the line gives the bytes the
    rank's file needs and the bytes written and free when the write failed (0 here), not the
    bytes free after the partial file was removed ("needs 4,021,248 bytes, 4,521,984 are
    free")."""
    import re
    from collections import namedtuple
    from pathlib import Path

    from ndtrain.checkpoint import store
    from ndtrain.cli import main
    run = tmp_path / "run"
    real_write, real_usage = store.write_safetensors, store.shutil.disk_usage
    disk = {}

    def used() -> int:
        return sum(p.stat().st_size for p in run.rglob("*") if p.is_file())

    def fills_at_step_4(path, entries, metadata=None):
        if "step_0000004" not in str(path):
            return real_write(path, entries, metadata)
        Path(path).write_bytes(bytes(1000))
        disk["capacity"] = used()  # full now
        raise OSError(errno.ENOSPC, "No space left on device")

    def usage(path):
        if "capacity" in disk and str(path).startswith(str(run)):
            return namedtuple("usage", "total used free")(disk["capacity"], used(), disk["capacity"] - used())
        return real_usage(path)
    monkeypatch.setattr(store, "write_safetensors", fills_at_step_4)
    monkeypatch.setattr(store.shutil, "disk_usage", usage)
    code = main(["train", "--nproc", "1", *TINY, "train.steps=4", "train.save_every=2", f"data.path={tiny_data}",
                 f"run.dir={run}"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    found = re.search(r"needs ([\d,]+) bytes; when the write failed ([\d,]+) written, ([\d,]+) were free", err)
    assert found, err
    need, written, free = (int(g.replace(",", "")) for g in found.groups())
    first = next(run.glob("checkpoints/step_0000002/rank-00000.safetensors")).stat().st_size
    assert (need, written, free) == (first, 1000, 0), err
    assert store.latest(run).name == "step_0000002"


def _broken_dashboards(tmp_path):
    """Fake packages named tensorboard and wandb that fail to import (installed but broken)."""
    broken = tmp_path / "broken"
    for name in ("tensorboard", "wandb"):
        (broken / name).mkdir(parents=True)
        (broken / name / "__init__.py").write_text("raise ImportError('built against another protobuf')\n")
    return broken


def test_dashboards_online_without_credentials_or_broken(tmp_path, capsys, monkeypatch):
    """run.wandb=online with no credentials, and a dashboard package that is installed but
    fails to import: one line each before anything is written (they used to make the run
    folder, then die in a 34-line traceback)."""
    import sys
    monkeypatch.chdir(tmp_path)
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    train = ["train", "--nproc", "1", "model.preset=tiny", "run.device=cpu", "train.steps=1",
             f"run.dir={tmp_path / 'run'}"]
    refused(train + ["run.wandb=online"], tmp_path, capsys,
            "run.wandb = 'online': needs W&B credentials and none were found")
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    from ndtrain.config.sections import _check_dashboards
    from ndtrain.config.schema import RunConfig
    _check_dashboards(RunConfig(wandb="online"))  # a `wandb login` entry: accepted

    broken = _broken_dashboards(tmp_path)
    monkeypatch.syspath_prepend(str(broken))
    for name in [m for m in sys.modules if m.split(".")[0] in ("wandb", "tensorboard")
                 or m.startswith("torch.utils.tensorboard")]:
        monkeypatch.delitem(sys.modules, name)
    for key, value in (("run.tensorboard", "true"), ("run.wandb", "offline")):
        extra = key.split(".")[1]
        refused(train + [f"{key}={value}"], tmp_path, capsys,
                f"the {extra} package is installed but fails to import (ImportError: built against another "
                "protobuf)")


def test_an_empty_list_of_sources_is_refused(tmp_path, capsys, monkeypatch):
    """`[data] sources = []` (or data.sources=[]) used to train on the embedded corpus; a
    run's own config.toml, which writes `sources = []` beside its data.path, still loads."""
    from ndtrain.config import load_config, to_toml, validate
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mix.toml").write_text("[data]\nsources = []\n")
    rule = "data.sources = []: lists no source; give at least one [[data.sources]] table"
    refused(["train", "--config", str(tmp_path / "mix.toml"), *CHEAP], tmp_path, capsys, rule)
    refused(["train", "data.sources=[]", *CHEAP], tmp_path, capsys, rule)
    (tmp_path / "config.toml").write_text(to_toml(load_config(None, ["run.device=cpu"])))
    assert "sources = []" in (tmp_path / "config.toml").read_text()
    validate(load_config(tmp_path / "config.toml"))


def test_dpo_pairs_whose_chosen_equals_rejected_are_left_out_and_counted(tmp_path, capsys, monkeypatch, tiny_data):
    """Such a pair trains at loss log 2 forever (its gradient is zero): left out and counted
    in one line; a file of nothing else is refused before anything starts."""
    from ndtrain.data.preference import prepare_preferences
    from ndtrain.data.template import BuiltinTemplate
    from ndtrain.data.tokenizer import TextTokenizer
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()  # all different
    records = [{"prompt": f"{words[i % 12]} {i}", "chosen": f" {words[(i + 1) % 12]}",
                "rejected": f" {words[(i + 1) % 12] if i % 4 == 0 else words[(i + 5) % 12]}"} for i in range(40)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    template = BuiltinTemplate(TextTokenizer.from_file(f"{tiny_data}/tokenizer.json"))
    data = prepare_preferences(str(path), template, 96, 0.2)
    assert len(data.train) + len(data.val) == 30 and len(data.identical) == 10
    assert all(c.tokens.tolist() != r.tokens.tolist() for c, r in data.train + data.val)
    assert data.describe().splitlines()[-1] == ("left out 10 pairs whose chosen answer equals the rejected one "
                                                "(nothing to prefer: loss log 2 whatever the model), first: "
                                                "pairs.jsonl:1")

    same = tmp_path / "same" / "same.jsonl"
    same.parent.mkdir()
    same.write_text("".join(json.dumps({**r, "rejected": r["chosen"]}) + "\n" for r in records))
    monkeypatch.chdir(tmp_path / "same")
    refused(["dpo", *CHEAP, "model.init_from=scratch", f"data.path={same}", f"data.tokenizer={tiny_data}/tokenizer.json",
             f"data.cache_dir={tmp_path / 'cache'}", "train.seq_len=64"], tmp_path / "same", capsys,
            f"{same}: the chosen answer of every one of its 40 pairs equals the rejected one (first: same.jsonl:1)")


def test_lora_targets_that_select_nothing_are_refused(tmp_path, capsys, monkeypatch):
    """`lora.targets=w1` on a mixture of experts (whose experts keep plain weights) used to die
    in the ranks with "optimizer got an empty parameter list"; so would a pipeline stage of
    expert layers only. Refused before anything starts; a dense layer anywhere in each
    stage, or an attention target, is accepted."""
    from ndtrain.config import load_config, validate
    from ndtrain.plan.fit import check_lora_stages
    monkeypatch.chdir(tmp_path)
    refused(["train", *CHEAP, "model.preset=tiny-moe", "lora.rank=4", "lora.targets=w1"], tmp_path, capsys,
            "lora.targets = 'w1': selects no layer of model.preset = 'tiny-moe', whose MLPs are all mixtures of "
            "experts (their experts keep plain weights)")
    moe_every_2 = ["model.preset=tiny-moe", "model.moe_every=2", "lora.rank=4", "run.device=cpu"]
    refused(["train", *CHEAP, *moe_every_2, "lora.targets=w1,w2", "--nproc", "4", "parallel.pp=4"], tmp_path, capsys,
            "lora.targets = 'w1,w2': selects no layer of pipeline rank 1 (its block 1: only mixtures of experts")
    for ok in (["lora.targets=w1,w2", "parallel.pp=2", "run.nproc=2"], ["lora.targets=w1,wq", "parallel.pp=4",
                                                                        "run.nproc=4"]):
        check_lora_stages(validate(load_config(None, moe_every_2 + ok)))


RL = ["rl", "--nproc", "1", "model.init_from=scratch", "model.preset=tiny", "run.device=cpu", "train.global_batch=4",
      "rl.group_size=2", "train.steps=1", "rl.eval_prompts=0", "rl.max_new_tokens=3"]


def test_rl_generate_tp_below_zero_is_refused(tmp_path, capsys, monkeypatch):
    """rl.generate_tp=-1 used to pass (it "divides" any world) and crash a rank."""
    monkeypatch.chdir(tmp_path)
    refused(RL + [f"data.cache_dir={tmp_path / 'cache'}", "rl.generate_tp=-1"], tmp_path, capsys,
            "rl.generate_tp = -1: must be >= 0")


def test_plan_keeps_trains_rules_and_the_peak(tmp_path, capsys, monkeypatch):
    """`plan` used to give a whole plan for an fp8 MoE layout with tp that `train` refuses (it
    validated the layout as bf16), and "MFU 597%" for a rate above the peak."""
    monkeypatch.chdir(tmp_path)
    plan = ["plan", "--cluster", "H100-SXM", "--gpus", "8"]
    refused(plan + ["model.preset=tiny-moe", "train.precision=fp8", "parallel.tp=2"], tmp_path, capsys,
            "parallel.tp = 2: fp8 with MoE blocks runs with tp = cp = 1")
    for flag in ("--hfu-tflops", "--tflops"):
        refused(plan + ["model.preset=1B", "train.precision=bf16", flag, "5000"], tmp_path, capsys,
                f"{flag} = 5000.0: is above the bf16 peak of H100-SXM, 989 TFLOP/s per GPU")
    from ndtrain.cli import main
    assert main(plan + ["model.preset=1B", "train.precision=fp8", "--hfu-tflops", "1500"]) == 0  # under fp8's peak
    assert "HFU" in capsys.readouterr().out


def test_on_bad_record_is_idle_only_where_no_record_is_read(tmp_path, tiny_data):
    """`train data.on_bad_record=skip` used to warn "has no effect" while its prepare skipped
    the bad records; and so did `rl` with rl.data, which reads its records with it."""
    from ndtrain.config import load_config, validate
    from ndtrain.idle_keys import idle_keys
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text('{"text": "fine"}\nnot json\n')
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')

    def warned(command, *overrides):
        cfg = validate(load_config(None, ["run.device=cpu", "data.on_bad_record=skip", *overrides]),
                       check_paths=False)
        return [line for line in idle_keys(cfg, None, command) if line.startswith("data.on_bad_record")]
    assert warned("train", f"data.path={corpus}") == []
    assert warned("train", f'data.sources=[{{"path": "{corpus}"}}]') == []
    assert warned("rl", f"rl.data={tmp_path / 'prompts.jsonl'}") == []
    assert warned("sft") == [] and warned("dpo") == []
    for where in ([], [f"data.path={tiny_data}"]):  # the embedded corpus, a prepared folder: nothing to skip
        assert warned("train", *where) == ["data.on_bad_record = 'skip' has no effect here: data.path is a prepared "
                                           "folder or the embedded corpus: no record is read that it could skip (it "
                                           "applies where train prepares data.path or data.sources, and to sft, dpo "
                                           "and rl.data)"]
    assert warned("rl")[0].endswith("ndtrain rl draws its prompts from rl.task (rl.data is not set)")


@pytest.mark.parametrize("argv", [["bench", "pp"], ["bench", "comm"], ["bench", "checkpoint"],
                                  ["trace", "parallel.pp=2"]])
def test_every_out_keeps_one_rule(argv, tmp_path, capsys, monkeypatch):
    """`bench pp --out` used to write its pictures into a folder of the user's files, where
    `trace --out` refused: every --out is a new or empty folder or an ndtrain run, unless
    --overwrite."""
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    refused([*argv, "--out", str(mine), "run.device=cpu"], tmp_path, capsys,
            f"--out = {str(mine)!r}: is a folder that is neither empty nor an ndtrain run (it holds notes.txt); "
            "choose a new or empty folder, or add --overwrite to write beside (and over) its files")
    from ndtrain.config import check_out_folder
    check_out_folder("--out", str(mine), overwrite=True)
    check_out_folder("--out", str(tmp_path / "new"))


def exits(prompt, completion, answer):
    raise SystemExit(3)


def interrupts(prompt, completion, answer):
    raise KeyboardInterrupt


def exits_unless_right(prompt, completion, answer):
    if completion.strip() == answer:
        return 1.0
    raise SystemExit(3)


def test_a_reward_that_raises_systemexit_or_keyboardinterrupt_is_named(tmp_path, capsys, monkeypatch):
    """A reward that raised SystemExit ended the run silently, one that raised
    KeyboardInterrupt was reported as the user's Ctrl-C: both are the reward's failures,
    named (probed before the start: exit 2; on every completion of a rollout: exit 1)."""
    from ndtrain.checkpoint import store
    from ndtrain.cli import main
    monkeypatch.chdir(tmp_path)
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    for name, raised in (("exits", "SystemExit: 3"), ("interrupts", "KeyboardInterrupt")):
        refused(RL + [cache, f"rl.reward=test_bad_input_more:{name}"], tmp_path, capsys,
                f"rl.reward = 'test_bad_input_more:{name}': raised {raised} on ")
    code = main(RL + [cache, "rl.reward=test_bad_input_more:exits_unless_right", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.splitlines()
    assert code == 1 and "Traceback" not in "\n".join(err), err
    assert err[-1] == ("ndtrain: error: rl.reward = 'test_bad_input_more:exits_unless_right' failed on all 4 "
                       "completions of rollout 0 (it raised SystemExit: 3): stopping rather than training on rewards "
                       "of 0"), err
    assert not store.steps_of(tmp_path / "run")


def test_a_real_ctrl_c_inside_a_scorer_is_still_a_ctrl_c():
    """...while the scorer's own KeyboardInterrupt is its failure."""
    import os
    import signal
    import time

    from ndtrain.train.tasks import call_scorer

    def ctrl_c(*args):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)  # the handler runs here, at once
        return 1.0
    # A shell's background job starts with SIGINT ignored; Python's own handler is the premise.
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            call_scorer(ctrl_c, "p", "c", "a")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert call_scorer(interrupts, "p", "c", "a") == (None, "raised KeyboardInterrupt")
    finally:
        signal.signal(signal.SIGINT, outer)


def test_rl_max_new_tokens_beyond_the_models_context_is_refused(tmp_path, capsys, monkeypatch):
    """rl.max_new_tokens=100000 used to be accepted (the rows grew the model's context with
    it) and the first rollout was silent for minutes."""
    monkeypatch.chdir(tmp_path)
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    refused(RL + [cache, "rl.max_new_tokens=100000"], tmp_path, capsys,
            "rl.max_new_tokens = 100000: with the longest prompt (6 tokens) a completion needs 100,008 positions, "
            "more than the model's context of 256 (the max_seq_len of model.preset = 'tiny'): use at most 250 (or "
            "set a larger model.max_seq_len)")


def test_invalid_utf8_in_dpo_and_rl_data_is_a_bad_record(tmp_path, capsys, monkeypatch, tiny_data):
    """Undecodable bytes in a DPO pair or an rl.data record used to be replaced by U+FFFD and
    trained on: they are a bad record, FILE:LINE, refused under data.on_bad_record=error and
    left out and counted under skip (SFT's records too: one reader)."""
    from ndtrain.cli import main
    from ndtrain.data.preference import prepare_preferences
    from ndtrain.data.prompts import read_prompts
    from ndtrain.data.template import BuiltinTemplate
    from ndtrain.data.tokenizer import TextTokenizer
    monkeypatch.chdir(tmp_path)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    pairs = [json.dumps({"prompt": f"{words[i % 12]} {i}", "chosen": f" {words[(i + 1) % 12]}",
                         "rejected": f" {words[(i + 5) % 12]}"}).encode() for i in range(20)]
    pairs[2] = b'{"prompt": "caf\xe9", "chosen": " a", "rejected": " b"}'  # Latin-1, not UTF-8
    (tmp_path / "pairs.jsonl").write_bytes(b"\n".join(pairs) + b"\n")
    why = "pairs.jsonl:3: not UTF-8 text (byte 0xe9 at byte 16 of the line)"
    refused(["dpo", *CHEAP, "model.init_from=scratch", f"data.path={tmp_path / 'pairs.jsonl'}",
             f"data.tokenizer={tiny_data}/tokenizer.json", f"data.cache_dir={tmp_path / 'cache'}",
             "train.seq_len=64"], tmp_path, capsys, why + " (data.on_bad_record=skip leaves such records out)")
    template = BuiltinTemplate(TextTokenizer.from_file(f"{tiny_data}/tokenizer.json"))
    data = prepare_preferences(str(tmp_path / "pairs.jsonl"), template, 96, 0.2, "skip")
    assert len(data.train) + len(data.val) == 19 and [s.endswith(why) for s in data.skipped] == [True]
    assert "skipped 1 bad records" in data.describe()

    prompts = [json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}).encode() for i in range(10)]
    prompts[4] = b'{"prompt": "\xff\xfe+1=", "answer": "2"}'
    (tmp_path / "qa.jsonl").write_bytes(b"\n".join(prompts) + b"\n")
    qa = f"rl.data={tmp_path / 'qa.jsonl'}"
    refused(RL + [qa], tmp_path, capsys, "qa.jsonl:5: not UTF-8 text (byte 0xff at byte 13 of the line)")
    conversations, skipped = read_prompts(str(tmp_path / "qa.jsonl"), "skip")
    assert len(conversations) == 9 and len(skipped) == 1 and "qa.jsonl:5: not UTF-8 text" in skipped[0]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(RL[:3] + ["model.preset=tiny", "run.device=cpu", qa, "data.on_bad_record=skip"]) == 2
    err = capsys.readouterr().err.splitlines()  # (no warm-up for rl.data: refused after the count)
    assert err[0].startswith("ndtrain: warning: rl.data: skipped 1 bad records (data.on_bad_record=skip), first: ")
    assert err[0].endswith("qa.jsonl:5: not UTF-8 text (byte 0xff at byte 13 of the line)") and len(err) == 2, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("bad, line", [
    ("train.optimizer=sgd", "train.optimizer = 'sgd': choose one of adamw, muon"),
    ("train.muon_momentum=1.0", "train.muon_momentum = 1.0: must be in [0, 1)"),
    ("train.muon_ns_steps=0", "train.muon_ns_steps = 0: must be in [1, 100)"),
    ("train.muon_ns_coefficients=3.4,-4.7", "train.muon_ns_coefficients = '3.4,-4.7': expected three comma-separated"),
    ("train.muon_adjust_lr=none", "train.muon_adjust_lr = 'none': choose one of match_rms_adamw, original"),
    ("train.muon_ns_dtype=fp16", "train.muon_ns_dtype = 'fp16': choose one of auto, bf16, fp32, fp64"),
    ("train.muon_lr=-1", "train.muon_lr = -1"),
    ("lora.rank=4", "train.optimizer = 'muon': Muon orthogonalises whole weight matrices; a LoRA adapter's"),
])
def test_bad_muon_keys_are_refused(tmp_path, capsys, monkeypatch, bad, line):
    monkeypatch.chdir(tmp_path)
    refused(["train", *CHEAP, "train.optimizer=muon", bad], tmp_path, capsys, line)


FAULT_TOLERANCE_CASES = [
    (["run.fault_tolerance=survive"], "run.fault_tolerance = 'survive': choose restart or replicas"),
    (["run.fault_tolerance=replicas"], "run.fault_tolerance = 'replicas': replicas needs parallel.dp_replicate ≥ 2 "
                                       "replica groups (it is 1)"),
    (["run.fault_tolerance=replicas", "parallel.dp_replicate=2", "run.heartbeat_s=0", "--nproc", "2"],
     "run.heartbeat_s = 0.0: must be positive under run.fault_tolerance = \"replicas\""),
    (["run.fault_tolerance=replicas", "parallel.dp_replicate=2", "train.precision=fp16", "--nproc", "2"],
     "run.fault_tolerance = 'replicas': replicas does not carry fp16's loss scale"),
    (["train.diloco_inner_steps=8"], "train.diloco_inner_steps = 8: DiLoCo runs over replica groups: set "
                                     "run.fault_tolerance = \"replicas\""),
    (["train.diloco_inner_steps=-1"], "train.diloco_inner_steps = -1: must be >= 0"),
    (["train.diloco_outer_lr=0"], "train.diloco_outer_lr = 0.0: must be > 0"),
    (["train.diloco_outer_momentum=1"], "train.diloco_outer_momentum = 1.0: must be in [0, 1)"),
    (["run.lost_rows=retry"], "run.lost_rows = 'retry': choose skip or requeue"),
    (["run.lost_rows=requeue"], "run.lost_rows = 'requeue': rows are re-queued between replica groups: set "
                                "run.fault_tolerance = \"replicas\""),
    (["run.fault_tolerance=replicas", "parallel.dp_replicate=2", "run.lost_rows=requeue", "train.diloco_inner_steps=4",
      "--nproc", "2"], "run.lost_rows = 'requeue': DiLoCo's rounds do not re-queue rows: a lost group misses its "
                       "outer round (use skip)"),
    (["run.fault_tolerance=replicas", "parallel.dp_replicate=2", "run.lost_rows=requeue", "parallel.pp=2",
      "parallel.pp_schedule=afab", "--nproc", "4"],
     "run.lost_rows = 'requeue': with parallel.pp_schedule = afab a step that trains a re-queued part holds twice"),
]


def test_fault_tolerance_keys_are_checked(tmp_path, capsys, monkeypatch):
    """run.fault_tolerance and DiLoCo's keys (docs/faults.md): one line naming the key, the
    value and the rule."""
    monkeypatch.chdir(tmp_path)
    for extra, line in FAULT_TOLERANCE_CASES:
        argv = [a for a in CHEAP if a not in ("--nproc", "1")] if "--nproc" in extra else CHEAP
        refused(["train", *argv, *extra], tmp_path, capsys, line)


@pytest.mark.parametrize("command", ["sft", pytest.param("rl", marks=pytest.mark.slow),
                                     pytest.param("dpo", marks=pytest.mark.slow)])
def test_replicas_outside_pretraining_is_refused_before_anything_runs(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused([command, "--nproc", "2", "model.preset=tiny", "run.device=cpu", "train.steps=1",
             "run.fault_tolerance=replicas", "parallel.dp_replicate=2"], tmp_path, capsys,
            f"run.fault_tolerance = 'replicas': is for pretraining (ndtrain train) only so far, not ndtrain {command}")


@pytest.mark.parametrize("extra, fragment", [
    (["model.attention=mqa"], "model.attention = 'mqa': choose one of gqa, mla"),
    (["model.moe_groups=3"], "model.moe_groups = 3: must divide moe_experts = 8"),
    (["model.moe_topk_groups=5"], "model.moe_topk_groups = 5: must be at most moe_groups = 4"),
    (["model.first_k_dense=4"], "model.first_k_dense = 4: must be in 0..3 (some block must have experts)"),
    (["model.v_head_dim=32"], "model.v_head_dim = 32: must be at most qk_nope_head_dim + qk_rope_head_dim = 24"),
    (["train.mtp_weight=0"], "train.mtp_weight = 0.0: must be > 0 with model.mtp_depth > 0"),
])
def test_deepseek_keys_are_refused_in_one_line(extra, fragment, tmp_path, capsys, monkeypatch):
    """DeepSeek-V3's keys (config/deepseek.py): each rule names its key and value."""
    monkeypatch.chdir(tmp_path)
    refused(["train", *CHEAP, "model.preset=deepseek-v3-tiny", *extra], tmp_path, capsys, fragment)


def test_latent_attention_lora_targets_need_attention_mla(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused(["train", *CHEAP, "lora.rank=4", "lora.targets=wkv_a"], tmp_path, capsys,
            "lora.targets = 'wkv_a': wkv_a names no layer of this model's attention: its projections are wq, wk, wv, wo")


def test_latent_attention_keys_need_attention_mla(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused(["train", *CHEAP, "model.kv_lora_rank=16"], tmp_path, capsys,
            "model.kv_lora_rank = 16: is a key of latent attention: needs model.attention = 'mla'")


def test_rl_refuses_multi_token_prediction(tmp_path, capsys, monkeypatch):
    """MTP's losses are token losses: RL's (and DPO's) objective has none to join."""
    monkeypatch.chdir(tmp_path)
    refused(RL + [f"data.cache_dir={tmp_path / 'cache'}", "model.preset=deepseek-v3-tiny"], tmp_path, capsys,
            "model.mtp_depth = 1: multi-token prediction trains on the token loss of pretraining and SFT, not "
            "ndtrain rl's objective; use 0")


@pytest.mark.parametrize("overrides, fragment", [
    (["train.precision=fp8", "train.fp8_recipe=mxfp8", "parallel.tp=2", "--nproc", "2"],
     "parallel.tp = 2: mxfp8 needs every tensor-parallel shard to be whole 32-element blocks: KV heads × head_dim = 32 "
     "gives 16 per rank"),
    (["train.precision=nvfp4", "parallel.cp=2", "--nproc", "2"],
     "parallel.cp = 2: nvfp4's Hadamard transform mixes runs of 16 tokens"),
    (["train.precision=nvfp4", "train.compile=true"], "train.compile = True: nvfp4's stochastic rounding"),
    (["train.nvfp4_hadamard=false"], "train.nvfp4_hadamard = False: applies only with train.precision=nvfp4"),
    (["train.precision=fp8", "train.nvfp4_base_blocks=2"], "train.nvfp4_base_blocks = 2: applies only with"),
    (["train.precision=nvfp4", "train.nvfp4_base_blocks=-2"], "train.nvfp4_base_blocks = -2: must be >= 0, or -1"),
    (["train.precision=nvfp4", "train.fp8_recipe=mxfp8"], "train.fp8_recipe = 'mxfp8': applies only with train.precision=fp8"),
    (["train.fp8_base=fp32"], "train.fp8_base = 'fp32': applies only with train.precision=fp8 or nvfp4"),
])
def test_micro_scaled_formats_refuse_what_they_cannot_do(overrides, fragment, tmp_path, capsys, monkeypatch):
    """MXFP8 and NVFP4 (issue 38): a shard that cuts a block, Hadamard runs cut by context
    parallelism, what NVFP4 has no keyed rounding for, and their keys without their format."""
    monkeypatch.chdir(tmp_path)
    refused(["train", "model.preset=tiny", "run.device=cpu", "train.steps=1", "train.seq_len=32",
             f"data.cache_dir={tmp_path / 'cache'}"] + overrides, tmp_path, capsys, fragment)


@pytest.mark.parametrize("extra, fragment", [
    (["rl.partial_rollout=restart"], "rl.partial_rollout = 'restart': choose finish or continue"),
    (["rl.partial_rollout=continue"], "rl.partial_rollout = 'continue': needs rl.generate_ranks >= 1"),
    (["rl.partial_tokens=0"], "rl.partial_tokens = 0: must be > 0"),
])
def test_rl_partial_rollout_keys_are_refused_when_wrong(extra, fragment, tmp_path, capsys, monkeypatch):
    """Partial rollouts (issue 36): an unknown mode, continuing without generator processes
    (generation on the training ranks is never interrupted), segments of no tokens."""
    monkeypatch.chdir(tmp_path)
    refused(RL + [f"data.cache_dir={tmp_path / 'cache'}"] + extra, tmp_path, capsys, fragment)
