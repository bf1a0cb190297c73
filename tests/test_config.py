"""Configuration: parsing, types, validation errors (one line, exit 2, nothing written)."""

import pytest

from ndtrain.cli import main
from ndtrain.config import Config, ConfigError, load_config, to_toml, validate


def error_of(overrides, **kw):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, overrides), **kw)
    return str(e.value)


def test_defaults_validate_and_resolve():
    cfg = validate(load_config(None, ["run.device=cpu"]))
    assert cfg.parallel.dp == 2 and cfg.run.nproc == 2
    assert cfg.train.micro_batch == cfg.train.global_batch // 2
    assert cfg.parallel.sp is False


def test_toml_file_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[train]\nsteps = 7\nlr = 0.5\n[model]\npreset = "tiny"\n')
    cfg = load_config(f, ["train.steps=9"])
    assert cfg.train.steps == 9 and cfg.train.lr == 0.5 and cfg.model.preset == "tiny"


def test_written_config_round_trips(tmp_path):
    cfg = validate(load_config(None, ["model.preset=tiny", "model.dim=96", "run.device=cpu"]))
    f = tmp_path / "config.toml"
    f.write_text(to_toml(cfg))
    again = load_config(f)
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize("overrides, fragment", [
    (["train.stpes=3"], "train.stpes = '3': unknown key; did you mean train.steps?"),
    (["steps=3"], "did you mean train.steps?"),
    (["train.steps=abc"], "train.steps = 'abc': expected an integer"),
    (["train.lr=fast"], "train.lr = 'fast': expected a number"),
    (["run.progress=maybe"], "expected true or false"),
    (["train.steps=0"], "train.steps = 0: must be > 0"),
    (["train.lr=-1"], "train.lr = -1.0: must be > 0"),
    (["train.seq_len=-5"], "train.seq_len = -5: must be > 0"),
    (["model.preset=huge"], "model.preset = 'huge': unknown preset"),
    (["data.path=/does/not/exist"], "data.path = '/does/not/exist': path does not exist"),
    (["data.tokenizer=/no/tokenizer.json"], "data.tokenizer = '/no/tokenizer.json': file does not exist"),
    (["run.nproc=3", "parallel.dp=2"], "must equal the process count, 3"),
    (["run.nproc=4", "parallel.dp=2"], "pp×dp×cp×tp = 1×2×1×1 = 2"),
    (["train.global_batch=15", "run.nproc=2"], "train.global_batch = 15: must be divisible by parallel.dp = 2"),
    (["train.global_batch=16", "train.micro_batch=3", "run.nproc=2"], "must be divisible by dp × micro_batch = 2 × 3 = 6"),
    (["model.n_heads=3"], "model.n_heads = 3: must divide model.dim = 128"),
    (["model.n_kv_heads=3"], "model.n_kv_heads = 3: must divide model.n_heads = 4"),
    (["model.n_heads=8", "model.dim=64"], "head dim 64/8 = 8"),  # passes: even head dim
    (["parallel.dp_replicate=3", "parallel.dp=4"], "parallel.dp_replicate = 3: must divide parallel.dp = 4"),
    (["train.precision=fp8"], "train.precision = 'fp8': choose one of fp32, bf16, fp16"),
    (["train.recompute=every:x"], "choose none, full, selective or every:K"),
    (["parallel.pp_schedule=gpipe"], "parallel.pp_schedule = 'gpipe': unknown schedule"),
    (["run.resume=maybe"], "run.resume = 'maybe': choose auto, true or false"),
    (["data.val_fraction=0.9"], "data.val_fraction = 0.9: must be in (0, 0.5]"),
    (["nokey"], "expected KEY=VALUE"),
    (["parallel.zero=3", "run.nproc=1"], "parallel.zero = 3: ZeRO shards over parallel.dp_shard = dp / dp_replicate = 1 / 1 = 1"),
    (["parallel.zero=3", "run.nproc=2", "parallel.dp_replicate=2"], "dp / dp_replicate = 2 / 2 = 1: nothing to shard"),
    (["parallel.zero=4"], "parallel.zero = 4: choose a ZeRO stage: 0, 1, 2 or 3"),
    (["train.precision=fp16", "train.loss_scaler=false"], "train.loss_scaler = False: fp16 without loss scaling"),
    (["train.recompute=every:0"], "train.recompute = 'every:0': every:K needs K >= 1"),
    (["train.recompute=every:-2"], "every:K needs K >= 1"),
    (["train.loss_scale_init=1000"], "train.loss_scale_init = 1000.0: must be a power of two"),
    (["train.loss_scale_init=2", "train.loss_scale_min=4"], "must be at least train.loss_scale_min = 4.0"),
])
def test_each_error_is_one_clear_line(overrides, fragment):
    if fragment.startswith("head dim"):
        validate(load_config(None, overrides + ["run.device=cpu"]))  # 8 is even: valid
        return
    msg = error_of(overrides + ["run.device=cpu"])
    assert fragment in msg
    assert "\n" not in msg


def test_implemented_options_validate():
    cfg = validate(load_config(None, ["run.device=cpu", "run.nproc=4", "parallel.zero=3", "parallel.dp_replicate=2",
                                      "train.precision=fp16", "train.recompute=every:2"]))
    assert cfg.parallel.dp_shard == 2
    validate(load_config(None, ["run.device=cpu", "train.precision=fp16", "train.loss_scaler=false",
                                "train.allow_unscaled_fp16=true"]))


def test_world_from_launcher_must_match():
    cfg = load_config(None, ["parallel.dp=2"])
    with pytest.raises(ConfigError, match="4 from the launcher's WORLD_SIZE"):
        validate(cfg, world=4)
    cfg = validate(load_config(None, []), world=4)
    assert cfg.parallel.dp == 4


def test_unknown_section_in_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[trian]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"\[trian\].*did you mean \[train\]"):
        load_config(f)


def test_wrong_type_in_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[train]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match="train.steps = 'ten': expected an integer"):
        load_config(f)


@pytest.mark.parametrize("argv", [
    ["train", "train.stpes=3"],
    ["train", "parallel.dp=4", "--nproc", "2"],
    ["train", "train.lr=0"],
    ["train", "model.preset=nope"],
    ["train", "data.path=/missing/corpus.txt"],
    ["train", "--config", "/missing.toml"],
    ["train", "--nproc", "1", "parallel.zero=3"],
    ["train", "--dry-run", "train.recompute=every:0"],
])
def test_cli_exit_2_one_line_nothing_written(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    code = main(argv + [f"run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("ndtrain: error: ")
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # no run dir, no runs/, nothing


def test_config_is_plain_data():
    assert Config().copy().to_dict() == Config().to_dict()


def test_default_toml_lists_every_key_with_its_default():
    """configs/default.toml documents every key; its values are the code's defaults."""
    import re
    from pathlib import Path

    from ndtrain.config import all_keys
    path = Path(__file__).parent.parent / "configs" / "default.toml"
    text = path.read_text()
    assert load_config(path).to_dict() == Config().to_dict()
    section = None
    documented = set()
    for line in text.splitlines():
        if m := re.match(r"^\[(\w+)\]", line):
            section = m.group(1)
        elif m := re.match(r"^#?\s*(\w+)\s*=", line):
            documented.add(f"{section}.{m.group(1)}")
    assert set(all_keys()) <= documented, set(all_keys()) - documented
