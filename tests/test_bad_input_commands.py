"""Bad input on the newer commands (issue 27): each case gets one line naming the key, the
value and the rule, exit status 2, no traceback, and nothing written under the folder it
runs in. One test per command family, its cases in a table; each runs in this process
(`ndtrain.cli.main`), refused before any rank starts. (convert and model.init_from:
tests/test_import_checks.py.)"""

import json
import os

import pytest

from helpers import refused, unwritable_dir

CLUSTER = "gpus_per_node = 8\nmemory_gb = {memory}\n[peak_tflops]\nbf16 = {bf16}\n[links]\nintra_gbps = {intra}\n" \
          "inter_gbps = 50\n"
PLAN = ["plan", "--cluster", "H100-SXM", "--gpus", "8", "model.preset=1B", "train.precision=bf16"]


def test_plan(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    files = {"nan.toml": CLUSTER.format(memory="nan", bf16=900, intra=400),
             "inf.toml": CLUSTER.format(memory=80, bf16="inf", intra=400),
             "neg.toml": CLUSTER.format(memory=80, bf16=900, intra=-1),
             "links.toml": "gpus_per_node = 8\nmemory_gb = 80\nlinks = 3\n[peak_tflops]\nbf16 = 900\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "latin1.toml").write_bytes('name = "Zürich"\n'.encode("latin-1"))
    (tmp_path / "binary.toml").write_bytes(bytes(range(256)))
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "cpu_matmul_peak.json").write_text('{"flops": NaN}')
    cases = [
        (PLAN + ["--tflops", "nan"], "--tflops = nan: must be a finite number"),
        (PLAN + ["--hfu-tflops", "inf"], "--hfu-tflops = inf: must be a finite number"),
        (PLAN + ["--mfu", "nan"], "--mfu = nan: must be a finite number"),
        (PLAN + ["--tokens", "1e400"], "--tokens = '1e400': expected a positive, finite number"),
        (PLAN + ["--tokens", "nan"], "--tokens = 'nan': expected a positive, finite number"),
        (PLAN + ["model.preset=tiny-moe", "--moe-imbalance", "inf"], "--moe-imbalance = inf: must be ≥ 1"),
        (PLAN + ["--search", "--top", "0"], "--top = 0: must be > 0"),
        (PLAN + ["--search", "--top", "-2"], "--top = -2: must be > 0"),
        (["plan", "--cluster", "nan.toml"], "memory_gb = nan: expected a positive finite number"),
        (["plan", "--cluster", "inf.toml"], "peak_tflops.bf16 = inf: expected a positive finite number"),
        (["plan", "--cluster", "neg.toml"], "links.intra_gbps = -1: expected a positive finite number"),
        (["plan", "--cluster", "links.toml"], "links = 3: expected a table"),
        (["plan", "--cluster", "latin1.toml"], "is not a UTF-8 text file"),
        (["plan", "--cluster", "binary.toml"], "is not a UTF-8 text file"),
        (["plan", "--cluster", "this-machine", f"data.cache_dir={cache}"],
         "holds a peak of nan FLOP/s: run `ndtrain bench matmul` again"),
    ]
    for argv, fragment in cases:
        refused(argv, tmp_path, capsys, fragment)


def nan_reward(prompt, completion, answer):
    return float("nan")


def inf_reward(prompt, completion, answer):
    return float("inf")


def nan_unless_right(prompt, completion, answer):
    return 1.0 if completion.strip() == answer else float("nan")


RL = ["rl", "--nproc", "1", "model.init_from=scratch", "model.preset=tiny", "run.device=cpu", "train.global_batch=4",
      "rl.group_size=2"]


def test_rl(tmp_path, capsys, monkeypatch):
    """The reward is probed on a sample's own answer before anything starts (NaN, inf), and a
    sequence whose logits, rotary tables and rollout cache cannot fit is refused."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    cases = [
        (["rl.reward=test_bad_input_commands:nan_reward"], "returned nan, not a finite number on a sample"),
        (["rl.reward=test_bad_input_commands:inf_reward"], "returned inf, not a finite number on a sample"),
        (["rl.max_new_tokens=100000000", "model.max_seq_len=100000008"],
         "rl.max_new_tokens = 100000000: a sequence of 100,000,008 positions needs"),
        (["train.seq_len=100000000"], "train.seq_len = 100000000: a sequence of 100,000,000 positions needs"),
    ]
    for extra, fragment in cases:  # (the task's character tokenizer is cached: a cache, not an output)
        refused(RL + [f"data.cache_dir={tmp_path / 'cache'}"] + extra, work, capsys, fragment)


def test_rl_reward_failing_on_every_completion_stops_the_run(tmp_path, capsys, monkeypatch):
    """A reward that passes the probe but fails on every completion of a rollout stops the
    run on one line (exit 1), not a "successful" run trained on rewards of 0."""
    from ndtrain.checkpoint import store
    from ndtrain.cli import main
    monkeypatch.chdir(tmp_path)
    code = main(RL + [f"data.cache_dir={tmp_path / 'cache'}", "rl.reward=test_bad_input_commands:nan_unless_right",
                      "train.steps=1", "rl.eval_prompts=0", "rl.max_new_tokens=3", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.splitlines()
    assert code == 1 and "Traceback" not in "\n".join(err), err
    assert err[-1] == ("ndtrain: error: rl.reward = 'test_bad_input_commands:nan_unless_right' failed on all 4 "
                       "completions of rollout 0 (it returned nan, not a finite number): stopping rather than "
                       "training on rewards of 0"), err
    assert all("; scored 0" in line for line in err[:-1]) and len(err) <= 4, err  # the first failures, shown
    assert not store.steps_of(tmp_path / "run")


def raises(prompt, completion, reference):
    raise RuntimeError("boom")


def text(prompt, completion, reference):
    return "yes"


def test_sft(tmp_path, capsys, monkeypatch, tiny_data):
    monkeypatch.chdir(tmp_path)
    good = [json.dumps({"prompt": f"what is {i} + {i}?", "completion": f"{2 * i}"}) for i in range(30)]
    files = {"nested.jsonl": good[:3] + ["[" * 100000 + "]" * 100000],
             "surrogate.jsonl": good[:3] + ['{"prompt": "a\\ud800b", "completion": "x"}'],
             "good.jsonl": good}
    data = tmp_path / "data"
    data.mkdir()
    for name, lines in files.items():
        (data / name).write_text("\n".join(lines) + "\n")
    (data / "explodes_on_import.py").write_text("raise RuntimeError('at import')\n")
    monkeypatch.syspath_prepend(str(data))
    sft = ["sft", "--nproc", "1", "model.init_from=scratch", "model.preset=tiny", "run.device=cpu",
           f"data.tokenizer={os.path.join(tiny_data, 'tokenizer.json')}", f"data.cache_dir={tmp_path / 'cache'}",
           "train.seq_len=64"]
    (tmp_path / "cache").mkdir()
    cases = [
        ([f"data.path={data / 'nested.jsonl'}"], "nested.jsonl:4: JSON nested too deeply to read"),
        ([f"data.path={data / 'surrogate.jsonl'}"], "surrogate.jsonl:4: a user turn holds a lone surrogate escape "
                                                    "(\\ud800)"),
        ([f"data.path={data / 'good.jsonl'}", "sft.score=test_bad_input_commands:raises"],
         "sft.score = 'test_bad_input_commands:raises': raised RuntimeError: boom on held-out example"),
        ([f"data.path={data / 'good.jsonl'}", "sft.score=test_bad_input_commands:text"],
         "returned 'yes' (str), not a number on held-out example"),
        ([f"data.path={data / 'good.jsonl'}", "sft.score=explodes_on_import:f"],
         "sft.score = 'explodes_on_import:f': cannot import it (RuntimeError: at import)"),
    ]
    for extra, fragment in cases:  # (the prepared-data cache is written: a cache, not an output)
        refused(sft + extra, tmp_path / "data", capsys, fragment)
        assert not (tmp_path / "runs").exists()


def test_train_moe_and_sequence_keys(tmp_path, capsys, monkeypatch, tiny_data):
    monkeypatch.chdir(tmp_path)
    meta = json.loads((__import__("pathlib").Path(tiny_data) / "meta.json").read_text())
    too_long = meta["val_tokens"] + 10
    train = ["train", "--nproc", "1", "run.device=cpu"]
    cases = [
        (["model.preset=tiny-moe", "model.moe_experts=0"], "model.moe_experts = 0: must be > 0: model.preset = "
                                                           "'tiny-moe' is a mixture of experts"),
        (["model.preset=tiny-moe", "model.moe_every=5"], "model.moe_every = 5: must be at most model.n_layers = 4"),
        (["model.preset=tiny-moe", "model.moe_top_k=9"], "model.moe_top_k = 9: must be at most model.moe_experts"),
        ([f"data.path={tiny_data}", "model.preset=tiny", f"train.seq_len={too_long}"],
         f"train.seq_len = {too_long}: is longer than the corpus' val split"),
    ]
    for extra, fragment in cases:
        refused(train + extra, tmp_path, capsys, fragment)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "deep.jsonl").write_text('{"text": "fine"}\n' + "[" * 100000 + "]" * 100000 + "\n")
    refused(["prepare", f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}"], corpus, capsys,
            "deep.jsonl:2: JSON nested too deeply to read")


def test_checkpoint_meta_of_the_wrong_types(tmp_path, capsys, monkeypatch):
    """`checkpoint inspect` and `convert --to-hf` of a checkpoint whose meta.json has entries
    of the wrong type: one line each; inspecting its run lists it as refused."""
    from hf_helpers import make_hf
    from ndtrain.checkpoint import convert, store
    monkeypatch.chdir(tmp_path)
    checkpoint = convert.from_hf(make_hf(tmp_path / "hf"), tmp_path / "run")
    good = json.loads((checkpoint / "meta.json").read_text())
    damages = {
        "step": ("step", "eight"),
        "model_args": ("model_args", [1, 2]),
        "n_heads": ("model_args", {**good["model_args"], "n_heads": 0}),
        "files": ("files", ["rank-00000.safetensors"]),
        "tensors": ("tensors", {"weight/norm.weight": {"shape": "32", "dtype": "F32", "pieces": []}}),
        "saved_at": ("saved_at", "yesterday"),
    }
    for name, (key, value) in damages.items():
        (checkpoint / "meta.json").write_text(json.dumps({**good, key: value}))
        for target in (checkpoint, tmp_path / "run"):
            if target == checkpoint:
                refused(["checkpoint", "inspect", str(target)], tmp_path, capsys, "meta.json is damaged")
                refused(["convert", "--to-hf", str(target), "--out", str(tmp_path / "out")], tmp_path, capsys,
                        "meta.json is damaged")
            else:  # a run directory lists it as refused
                from ndtrain.cli import main
                assert main(["checkpoint", "inspect", str(target)]) == 0
                assert "REFUSED: " in capsys.readouterr().out and store.steps_of(target)


@pytest.mark.parametrize("what", ["matmul", "comm", "plan"])
def test_bench_calibrations_need_a_writable_cache_dir(what, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused(["bench", what, f"data.cache_dir={unwritable_dir(tmp_path) / 'cache'}"], tmp_path, capsys,
            "data.cache_dir = ")


def test_generate(tmp_path, capsys, monkeypatch):
    from hf_helpers import make_hf
    from ndtrain.checkpoint import convert
    monkeypatch.chdir(tmp_path)
    convert.from_hf(make_hf(tmp_path / "hf"), tmp_path / "run")
    (tmp_path / "run" / "tokenizer.json").write_text('{"x": 1')
    cases = [(["--prompt", "a\udcffb"], "--prompt = 'a\\udcffb': is not UTF-8 text"),
             (["--prompt", "def "], "tokenizer.json: cannot load")]
    for extra, fragment in cases:
        refused(["generate", "--run", str(tmp_path / "run"), *extra], tmp_path, capsys, fragment)
