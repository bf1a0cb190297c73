"""Issue 33: the recipes a GPU user starts from (configs/1b-8gpu.toml, configs/1b-lora-sft.toml)
load, agree with their own comments and plan on 8 GPUs; a preset that names a vocabulary is
not silently shrunk by a small tokenizer; data.text_key (old name data.jsonl_key) names the
field or column of the text."""

from pathlib import Path

import pytest

from ndtrain.cli import main
from ndtrain.config import ConfigError, load_config, validate

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.toml")))
def test_every_shipped_config_loads(name):
    load_config(CONFIGS / name)


def test_the_1b_recipe_spends_its_token_budget_and_fits_8_gpus(capsys):
    cfg = validate(load_config(CONFIGS / "1b-8gpu.toml"), world=8, check_paths=False)
    t, p = cfg.train, cfg.parallel
    assert t.global_batch * t.seq_len == 524_288 and t.steps * 524_288 == pytest.approx(20e9, rel=1e-4)
    assert t.global_batch // (p.dp * t.micro_batch) == 8  # the accumulation its comment states
    assert (t.lr, t.warmup, t.precision, cfg.run.async_save, t.keep_checkpoints) == (3e-4, 2000, "bf16", True, 3)
    assert main(["plan", "--config", str(CONFIGS / "1b-8gpu.toml"), "--cluster", "H100-SXM", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "1.24 B parameters" in out and "pp=1 dp=8" in out and "zero=1" in out and "fits in" in out


def test_the_1b_recipe_names_its_missing_data_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", str(CONFIGS / "1b-8gpu.toml"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.path = 'data/my-corpus'" in err[0]
    assert list(tmp_path.iterdir()) == []


def test_the_lora_recipe_is_a_valid_8_gpu_layout():
    cfg = validate(load_config(CONFIGS / "1b-lora-sft.toml"), world=8, check_paths=False)
    assert cfg.lora.rank == 16 and cfg.parallel.dp == 8 and cfg.train.global_batch // 8 == cfg.train.micro_batch


def test_a_preset_that_names_a_vocabulary_needs_its_tokenizer(tmp_path, monkeypatch, capsys):
    """The 1B preset with the default fresh 4,096-token BPE would be a 0.98 B model labelled
    1B: refused in one line that says so and names the three ways out; each way out passes."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--dry-run", "model.preset=1B"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.preset = '1B'" in err[0] and "0.98 B-parameter" in err[0]
    assert all(k in err[0] for k in ("data.tokenizer", "data.vocab_size=128256", "model.vocab_size=4096"))
    for way_out in (["model.vocab_size=4096"], ["data.vocab_size=128256"]):
        validate(load_config(None, ["model.preset=1B", *way_out]))
    validate(load_config(None, ["model.preset=small"]))  # its 4,096 tokens are the default BPE's


def test_data_text_key_and_its_old_name(capsys):
    import ndtrain.config.schema as schema

    schema._renamed_said.discard("data.jsonl_key")
    assert load_config(None, ["data.text_key=content"]).data.text_key == "content"
    assert capsys.readouterr().err == ""
    for _ in range(2):
        assert load_config(None, ["data.jsonl_key=body"]).data.text_key == "body"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ndtrain: data.jsonl_key is now data.text_key (it names a parquet column too); "
                   "the old name still works"]  # once, not per config read
    with pytest.raises(ConfigError, match="data.text_key = '': must name the JSONL field"):
        validate(load_config(None, ["data.text_key="]))


def test_sft_on_your_data_without_init_from_says_which_base_it_uses(tmp_path, monkeypatch, capsys):
    """`ndtrain sft data.path=mine.jsonl` with no model.init_from fine-tunes the default
    demo model: one warning line says so before anything is trained. The embedded default
    job (no data.path) says nothing."""
    from ndtrain.cli import posttrain

    def stop(cfg, world):
        raise ConfigError("model.init_from", "", "stopped here by the test")

    monkeypatch.setattr(posttrain, "default_pretraining_run", stop)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    assert main(["sft", "data.path=mine.jsonl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("ndtrain: warning: model.init_from is not set, so mine.jsonl")
    assert main(["sft"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_the_banner_names_a_preset_only_for_its_shape():
    """A model whose shape is not its preset's (model.init_from's tiny model under the
    default preset `small`, or keys set) is named by its shape, with its real size."""
    from ndtrain.cli.run import model_words

    assert model_words(load_config(None, [])) == "small model (1.3 M parameters)"
    words = model_words(load_config(None, ["model.dim=64", "model.n_layers=2", "model.ffn_dim=128"]))
    assert words.startswith("model of dim 64 × 2 layers (") and "small" not in words
    assert model_words(load_config(None, ["model.preset=1B"])) == "1B model (1.24 B parameters)"
