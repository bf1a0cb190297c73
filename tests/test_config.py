"""Configuration: parsing, types, validation errors (one line, exit 2, nothing written)."""

from pathlib import Path

import pytest

from helpers import unwritable_dir
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
    (["train.precision=fp4"], "train.precision = 'fp4': choose auto or one of fp32, bf16, fp16, fp64, fp8"),
    (["train.recompute=every:x"], "choose none, full, selective or every:K"),
    (["parallel.pp_schedule=gpipe"], "parallel.pp_schedule = 'gpipe': unknown schedule"),
    (["run.resume=maybe"], "run.resume = 'maybe': choose auto, true or false"),
    (["data.val_fraction=0.9"], "data.val_fraction = 0.9: must be in (0, 0.5]"),
    (["nokey"], "expected KEY=VALUE"),
    (["parallel.zero=3", "run.nproc=1"], "parallel.zero = 3: ZeRO shards over dp_shard × cp = (dp / dp_replicate) × cp = (1 / 1) × 1 = 1"),
    (["parallel.zero=3", "run.nproc=2", "parallel.dp_replicate=2"], "(dp / dp_replicate) × cp = (2 / 2) × 1 = 1: nothing to shard"),
    (["parallel.zero=4"], "parallel.zero = 4: choose a ZeRO stage: 0, 1, 2 or 3"),
    (["train.precision=fp16", "train.loss_scaler=false"], "train.loss_scaler = False: fp16 without loss scaling"),
    (["train.recompute=every:0"], "train.recompute = 'every:0': every:K needs K >= 1"),
    (["train.recompute=every:-2"], "every:K needs K >= 1"),
    (["train.loss_scale_init=1000"], "train.loss_scale_init = 1000.0: must be a power of two"),
    (["train.loss_scale_init=2", "train.loss_scale_min=4"], "must be at least train.loss_scale_min = 4.0"),
    # mixture of experts
    (["model.preset=tiny-moe", "parallel.ep=3", "run.nproc=3", "train.global_batch=12"],
     "parallel.ep = 3: must divide model.moe_experts = 8"),
    (["model.preset=tiny-moe", "parallel.ep=4", "run.nproc=2"],
     "parallel.ep = 4: must divide dp_shard × cp = 2 × 1 = 2: expert parallelism splits the experts over those ranks"),
    (["model.preset=tiny-moe", "model.moe_top_k=9"], "model.moe_top_k = 9: must be at most model.moe_experts = 8"),
    (["model.preset=tiny", "model.moe_top_k=2"],
     "model.moe_top_k = 2: model.preset = 'tiny' is a dense model (no experts); choose an MoE preset (tiny-moe"),
    (["model.preset=tiny", "parallel.ep=2"], "parallel.ep = 2: model.preset = 'tiny' has no experts to split"),
    (["model.preset=tiny-moe", "model.moe_router=argmax"], "model.moe_router = 'argmax': choose one of softmax_topk"),
    (["model.preset=tiny-moe", "model.moe_capacity=1.25", "parallel.tp=2", "run.nproc=2"],
     "model.moe_capacity = 1.25: dropping tokens would depend on how tp and cp split the sequence"),
    (["model.preset=tiny-moe", "train.moe_aux_loss=-1"], "train.moe_aux_loss = -1.0: must be >= 0"),
    (["model.preset=tiny-moe", "model.moe_every=0"], "model.moe_every = 0: must be > 0"),
    (["train.schedule=step"], "train.schedule = 'step': choose one of cosine, wsd, linear, constant"),
    (["train.decay_fraction=0"], "train.decay_fraction = 0.0: must be in (0, 1]"),
    (["train.schedule=wsd", "train.steps=100", "train.warmup=30", "train.decay_fraction=0.8"],
     "train.decay_fraction = 0.8: wsd: train.warmup (30) plus the decay (80 of 100 steps) must fit in train.steps"),
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
    # experts over the 2 ranks of dp_shard in each of 2 replicas; bias balancing
    cfg = validate(load_config(None, ["run.device=cpu", "run.nproc=4", "model.preset=tiny-moe", "parallel.ep=2",
                                      "parallel.dp_replicate=2", "parallel.zero=2", "train.moe_bias_rate=1e-3"]))
    assert cfg.model_args().moe_experts == 8


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
    ["train", "--nproc", "4", "model.preset=tiny-moe", "parallel.ep=3"],
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


# --------------------------------------------------------------------------- bad input (issue 9)

@pytest.mark.parametrize("overrides, fragment", [
    (["train.seed=-1"], "train.seed = -1: must be in [0, 2**32)"),
    (["train.eps=-1"], "train.eps = -1.0: must be > 0"),
    (["train.eps=0"], "train.eps = 0.0: must be > 0"),
    (["run.threads=100000"], "run.threads = 100000: must be at most this machine's"),
    (["model.max_seq_len=64", "train.seq_len=128"], "model.max_seq_len = 64: must be at least train.seq_len = 128"),
])
def test_bad_values_that_used_to_reach_a_rank(overrides, fragment):
    msg = error_of(overrides + ["run.device=cpu"])
    assert fragment in msg and "\n" not in msg


@pytest.mark.parametrize("device, chosen, resolved", [
    ("cpu", "auto", "mask"), ("cuda", "auto", "flex"), ("cpu", "flex", "flex"), ("cuda", "mask", "mask")])
def test_doc_attention_reaches_the_model(device, chosen, resolved):
    """model.doc_attention: auto is flex (no s × s mask) where the ranks run on CUDA and the
    boolean mask (the CPU proofs' form) elsewhere; a value set is kept."""
    cfg = load_config(None, [f"run.device={device}", f"model.doc_attention={chosen}"])
    assert cfg.model_args().doc_attention == resolved


@pytest.mark.parametrize("value, fragment", [
    ("varlen", "model.doc_attention = 'varlen': choose one of auto, mask, flex"),
    ("flex", "model.doc_attention = 'flex': needs CUDA: torch's flex_attention has no backward on the CPU; use mask "
             "(or auto) there")])
def test_bad_doc_attention(value, fragment):
    msg = error_of(["run.device=cpu", f"model.doc_attention={value}"])
    assert msg == fragment, msg


@pytest.mark.parametrize("key", ["train.lr", "parallel.bucket_mb", "train.grad_clip", "train.weight_decay"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_in_a_file_are_refused(key, value, tmp_path):
    section, name = key.split(".")
    f = tmp_path / "c.toml"
    f.write_text(f"[{section}]\n{name} = {value}\n")
    with pytest.raises(ConfigError, match=f"{key} = .*: expected a finite number"):
        load_config(f)


def test_binary_config_file_is_refused(tmp_path):
    f = tmp_path / "c.toml"
    f.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match="--config = .*: is not a UTF-8 text file"):
        load_config(f)


@pytest.mark.parametrize("key", ["run.dir", "data.cache_dir"])
def test_output_dirs_must_be_writable_directories(key, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert "exists and is not a directory" in error_of([f"{key}={a_file}", "run.device=cpu"])
    assert f"cannot be created: {a_file} is a file" in error_of([f"{key}={a_file / 'sub'}", "run.device=cpu"])
    assert "cannot be written" in error_of([f"{key}={unwritable_dir(tmp_path) / 'run'}", "run.device=cpu"])
    assert {p.name for p in tmp_path.iterdir()} == {"a-file", "read-only"}  # the probe left nothing


def test_pyproject_asks_for_the_python_that_has_tomllib():
    import tomllib  # new in Python 3.11; config/load.py reads TOML with it
    text = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert tomllib.loads(text)["project"]["requires-python"] == ">=3.11"


# --------------------------------------------------------------------------- keys that do nothing

def idle(overrides, file_text=None, tmp_path=None, world=None):
    from ndtrain.idle_keys import idle_keys
    path = None
    if file_text is not None:
        path = tmp_path / "c.toml"
        path.write_text(file_text)
    cfg = validate(load_config(path, overrides + ["run.device=cpu"]), world=world)
    return idle_keys(cfg, world)


@pytest.mark.parametrize("overrides, key", [
    (["parallel.reshard_after_forward=false"], "parallel.reshard_after_forward"),
    (["parallel.reshard_after_forward=false", "parallel.zero=2"], "parallel.reshard_after_forward"),
    (["parallel.sp=true"], "parallel.sp"),
    (["parallel.pp_schedule=zb"], "parallel.pp_schedule"),
    (["parallel.cp_impl=ulysses"], "parallel.cp_impl"),
    (["parallel.bucket_mb=4", "parallel.zero=1"], "parallel.bucket_mb"),
    (["parallel.bucket_mb=4", "run.nproc=1"], "parallel.bucket_mb"),
    (["parallel.dp_replicate=2", "run.nproc=4"], "parallel.dp_replicate"),
    (["train.loss_scale_init=1024"], "train.loss_scale_init"),
    (["train.loss_scale_window=10", "train.precision=bf16"], "train.loss_scale_window"),
    (["train.loss_scaler=false"], "train.loss_scaler"),
    (["train.allow_unscaled_fp16=true", "train.precision=fp16"], "train.allow_unscaled_fp16"),
    (["train.reduce_fp32=false"], "train.reduce_fp32"),
    (["train.reduce_fp32=false", "train.precision=fp64"], "train.reduce_fp32"),
    (["train.eval_every=5", "train.eval_batches=0"], "train.eval_every"),
    (["train.decay_fraction=0.1"], "train.decay_fraction"),
    (["train.schedule=constant", "train.min_lr_ratio=0.5"], "train.min_lr_ratio"),
    (["data.vocab_size=1000", "data.tokenizer=" + __file__], "data.vocab_size"),
    (["train.diloco_outer_lr=0.5"], "train.diloco_outer_lr"),
    (["train.diloco_outer_momentum=0.5"], "train.diloco_outer_momentum"),
])
def test_an_idle_key_gets_one_line_naming_it(overrides, key):
    lines = idle(overrides)
    assert len(lines) == 1 and lines[0].startswith(f"{key} = ") and "has no effect" in lines[0], lines


def test_dp_replicate_is_not_idle_under_replicas():
    assert idle(["parallel.dp_replicate=2", "run.nproc=4", "run.fault_tolerance=replicas"]) == []


def test_an_idle_key_in_a_file_is_named_too(tmp_path):
    lines = idle([], "[parallel]\nsp = false\n[train]\nloss_scale_min = 2.0\n", tmp_path)
    assert [line.split(" = ")[0] for line in lines] == ["parallel.sp", "train.loss_scale_min"]


def test_run_nproc_is_idle_under_a_launcher(tmp_path):
    """The value named is the one given (4), not the launcher's count validation put in its
    place; and `nproc = 0` in a file (its default) stays silent although validation
    resolves it to 2 (issue 27)."""
    assert idle(["run.nproc=4"], world=2)[0].startswith("run.nproc = 4 has no effect here: the launcher")
    assert idle([], "[run]\nnproc = 0\n", tmp_path, world=2) == []


@pytest.mark.parametrize("overrides", [
    [],  # defaults
    ["parallel.reshard_after_forward=false", "parallel.zero=3"],
    ["parallel.sp=false", "parallel.tp=2"],
    ["parallel.bucket_mb=4"],
    ["parallel.dp_replicate=2", "run.nproc=4", "parallel.zero=1"],
    ["train.loss_scale_init=1024", "train.precision=fp16"],
    ["train.reduce_fp32=false", "train.precision=bf16"],
    ["train.reduce_fp32=true", "parallel.pp_schedule=1f1b"],  # explicit, but the default value
])
def test_keys_that_act_or_keep_their_default_stay_silent(overrides):
    assert idle(overrides) == []


def test_default_toml_warns_about_nothing():
    path = Path(__file__).parent.parent / "configs" / "default.toml"
    from ndtrain.idle_keys import idle_keys
    cfg = validate(load_config(path, ["run.device=cpu"]))
    assert len(cfg.explicit) > 40 and idle_keys(cfg) == []
