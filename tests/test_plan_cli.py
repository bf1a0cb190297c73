"""`ndtrain plan` end to end: the table, the JSON keys scripts rely on, --search, the bad
input it refuses, and `train`'s refusal of a model that cannot fit."""

import json

import pytest

from ndtrain.cli import main
from ndtrain.config import ConfigError, load_config, validate
from ndtrain.plan.cluster import PRESETS, resolve
from ndtrain.plan.search import candidates, search, with_layout

EIGHT_B = ["model.preset=8B", "train.precision=bf16", "train.seq_len=4096", "train.global_batch=64",
           "train.micro_batch=1"]


def _plan(capsys, *argv):
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plan_json_has_the_keys_scripts_use(capsys):
    code, out, _ = _plan(capsys, "--cluster", "H100-SXM", "--gpus", "64", "--json", "--tokens", "15T", *EIGHT_B,
                         "parallel.tp=8", "parallel.pp=4", "parallel.zero=1", "train.recompute=selective")
    assert code == 0
    plan = json.loads(out)
    memory = plan["memory_per_rank"]
    assert set(memory) == {"params", "grads", "optimizer", "activations", "total"}
    assert all(isinstance(v, int) and v > 0 for v in memory.values())
    assert memory["total"] == memory["params"] + memory["grads"] + memory["optimizer"] + memory["activations"]
    for key in ("step_time_s", "tokens_per_s", "tflops_per_gpu", "hfu_tflops_per_gpu", "mfu", "hfu", "days"):
        assert isinstance(plan[key], float) and plan[key] > 0, key
    # selective recomputation reruns the attention scores: hardware FLOPs a little above the model's
    ratio = plan["hardware_flops_per_step"] / plan["model_flops_per_step"]
    assert 1 < plan["hfu"] / plan["mfu"] == pytest.approx(ratio)
    assert plan["hfu"] / plan["mfu"] < 1.05
    assert plan["tokens_per_s"] == pytest.approx(64 * 4096 / plan["step_time_s"])
    assert plan["days"] == pytest.approx(15e12 / plan["tokens_per_s"] / 86400)
    assert plan["layout"]["dp"] == 2 and len(plan["memory_per_stage"]) == 4
    # 1F1B over 4 stages and 32 micro-batches per rank, simulated: uneven stages (the head is
    # heavy), so the busiest stage waits less than the (p − 1)/m of equal ones
    assert 0.5 * 3 / 32 < plan["bubble_fraction"] < 3 / 32
    assert set(plan["step_time_model_s"]) >= {"compute", "pp_bubble", "dp", "optimizer", "total"}
    assert plan["mfu"] == pytest.approx(plan["tflops_per_gpu"] / 989)


def test_plan_table_and_given_rate(capsys):
    code, out, _ = _plan(capsys, "--cluster", "h100", "--tflops", "400", "--tokens", "1e12", *EIGHT_B, "parallel.tp=8")
    assert code == 0
    for text in ("memory per rank", "activations at the peak", "total (peak)", "step time", "pipeline bubble",
                 "data parallel / ZeRO", "throughput", "days to train"):
        assert text in out, text
    assert out.startswith("ndtrain plan: 8B model (8.03 B parameters")
    assert "MFU 40.4% · 400.0 TFLOP/s per GPU of model FLOPs" in out
    assert "HFU 40.4% · 400.0 TFLOP/s per GPU of hardware FLOPs (recompute=none)" in out  # nothing recomputed
    assert "without --json" not in out


def test_a_hardware_rate_counts_the_recomputed_forward(capsys):
    """Megatron's rates count the recomputed forward (--hfu-tflops): under full recomputation
    400 hardware TFLOP/s is less model work than 400 model TFLOP/s, so more days; the two
    utilizations are printed side by side, each in its convention."""
    days = {}
    for flag in ("--tflops", "--hfu-tflops"):
        code, out, _ = _plan(capsys, "--cluster", "h100", flag, "400", "--tokens", "1e12", "--json", *EIGHT_B,
                             "parallel.tp=8", "train.recompute=full")
        plan = json.loads(out)
        days[flag] = plan["days"]
        ratio = plan["hardware_flops_per_step"] / plan["model_flops_per_step"]
        assert 1.3 < ratio < 1.34  # one more forward: about 8/6
        assert plan["hfu"] == pytest.approx(plan["mfu"] * ratio)
        given = plan["hfu_tflops_per_gpu"] if flag == "--hfu-tflops" else plan["tflops_per_gpu"]
        assert given == pytest.approx(400)
    assert days["--hfu-tflops"] / days["--tflops"] == pytest.approx(ratio)
    code, out, _ = _plan(capsys, "--cluster", "h100", "--hfu", "0.5", *EIGHT_B, "parallel.tp=8", "train.recompute=full")
    assert "HFU 50.0% · 494.5 TFLOP/s per GPU of hardware FLOPs (recompute=full)" in out


def test_the_header_names_a_preset_only_with_its_shape(capsys):
    code, out, _ = _plan(capsys, "--cluster", "h100", "--gpus", "8", *EIGHT_B, "model.dim=16384", "parallel.tp=8")
    assert code == 0 and out.startswith("ndtrain plan: custom model (48.23 B parameters: 32 layers, dim 16384")
    code, out, _ = _plan(capsys, "--cluster", "h100", "--gpus", "8", *EIGHT_B, "model.dim=4096", "parallel.tp=8")
    assert out.startswith("ndtrain plan: 8B model (8.03 B parameters")  # a key that changes nothing


@pytest.mark.parametrize("argv, key, rule", [
    (["--cluster", "H900"], "--cluster = 'H900'", "unknown cluster"),
    (["--cluster", "H100", "--gpus", "16", "parallel.dp=2", "parallel.tp=4"], "parallel = 'pp×dp×cp×tp = 1×2×1×4 = 8'",
     "must equal the GPU count, 16"),
    (["--cluster", "H100", "--gpus", "12", "parallel.tp=8"], "--gpus = 12", "multiple of pp×cp×tp"),
    (["--cluster", "H100", "--mfu", "1.5"], "--mfu = 1.5", "must be in (0, 1]"),
    (["--cluster", "H100", "--mfu", "0.4", "--tflops", "300"], "--tflops = 300.0", "not both --mfu and --tflops"),
    (["--cluster", "H100", "--hfu", "0"], "--hfu = 0.0", "must be in (0, 1]"),
    (["--cluster", "H100", "--hfu-tflops", "-3"], "--hfu-tflops = -3.0", "must be > 0"),
    (["--cluster", "H100", "--tflops", "300", "--hfu-tflops", "400"], "--hfu-tflops = 400.0", "give one achieved rate"),
    (["--cluster", "H100", "--tokens", "lots"], "--tokens = 'lots'", "number of tokens"),
    (["--cluster", "H100", "parallel.tp=3"], "model.n_heads = 32", "divisible by parallel.tp = 3"),
])
def test_plan_bad_input(capsys, argv, key, rule):
    code, out, err = _plan(capsys, *argv, *EIGHT_B[:1])
    assert code == 2 and out == ""
    line = err.strip()
    assert "\n" not in line and key in line and rule in line, line


def test_a_model_that_fits_nowhere(capsys):
    code, _, err = _plan(capsys, "--cluster", "A100-40GB", "--gpus", "4", "--search", "model.preset=8B",
                         "model.n_layers=96", "model.dim=16384", "model.n_heads=128", "model.ffn_dim=53248",
                         "train.global_batch=8", "train.precision=bf16")
    assert code == 2
    assert "model.dim = 16384: does not fit on any layout of 4 × A100-40GB" in err
    assert "the smallest memory per rank found is" in err and "GiB (parallel.tp=" in err and "the device has 33.5 GiB (less 10% headroom)" in err


@pytest.mark.slow
def test_search_proposes_only_layouts_train_accepts(capsys):
    cfg = load_config(None, ["model.preset=125M", "train.precision=bf16", "train.seq_len=1024",
                             "train.global_batch=4"])
    cluster = PRESETS["A100-40GB"]
    found, _, _ = search(cfg, cfg.model_args(), cluster, 4, top=1000)
    assert len(found) > 20
    times = [f.plan.step_time_s for f in found]
    assert times == sorted(times)
    layouts = set()
    for f in found:
        again = f.plan.cfg.copy()
        validate(again, world=4, check_paths=False)  # raises if train would refuse it
        assert f.plan.fits and f.plan.worst.total <= 0.9 * cluster.memory
        p = again.parallel
        layouts.add((p.tp, p.cp, p.pp, p.zero))
    assert all(len({layout[i] for layout in layouts}) > 1 for i in range(4))  # tp, cp, pp and zero all vary
    # the candidates validate() refuses (there are some) are never among those proposed
    refused = []
    for overrides in candidates(cfg, cfg.model_args(), 4, cluster.gpus_per_node):
        try:
            validate(with_layout(cfg, overrides), world=4, check_paths=False)
        except ConfigError:
            refused.append(sorted(overrides))
    assert refused and not [f for f in found if sorted(f.overrides) in refused]
    code, out, _ = _plan(capsys, "--cluster", "A100-40GB", "--gpus", "2", "--search", "--top", "3",
                         "model.preset=125M", "train.precision=bf16", "train.seq_len=1024", "train.global_batch=4")
    assert code == 0 and len(out.strip().splitlines()) == 2 + 3


def test_cluster_file(tmp_path, capsys):
    good = tmp_path / "mine.toml"
    good.write_text('name = "mine"\ngpus_per_node = 4\nmemory_gb = 24\n[peak_tflops]\nbf16 = 100\n'
                    '[links]\nintra_gbps = 50\ninter_gbps = 10\n')
    cluster = resolve(str(good), str(tmp_path))
    assert cluster.name == "mine" and cluster.memory == 24e9 and cluster.peak_flops("fp32") == 100e12
    code, out, _ = _plan(capsys, "--cluster", str(good), "--json", "model.preset=125M", "train.precision=bf16")
    assert code == 0 and json.loads(out)["gpus"] == 4
    bad = tmp_path / "bad.toml"
    bad.write_text('gpus_per_node = 4\nmemory_gb = 24\nbandwidth = 3\n[peak_tflops]\nbf16 = 100\n')
    code, _, err = _plan(capsys, "--cluster", str(bad))
    assert code == 2 and "bandwidth = 3: unknown key" in err
    code, _, err = _plan(capsys, "--cluster", str(tmp_path / "missing.toml"))
    assert code == 2 and "file does not exist" in err


def test_this_machine_needs_its_calibration(tmp_path, capsys):
    code, _, err = _plan(capsys, "--cluster", "this-machine", f"data.cache_dir={tmp_path}")
    assert code == 2 and "bench matmul" in err


@pytest.mark.parametrize("extra, model", [([], ["model.dim=10000000"]), (["--dry-run"], ["model.dim=10000000"]),
                                          ([], ["model.preset=tiny-moe", "model.moe_ffn_dim=10000000",
                                                "parallel.ep=2"])])
def test_train_refuses_a_model_whose_states_cannot_fit(tmp_path, capsys, monkeypatch, extra, model):
    """Mixtures of experts too: the expert states split over ep count as the planner counts them."""
    monkeypatch.chdir(tmp_path)
    code = main(["train", *extra, "--nproc", "2", *model, f"data.cache_dir={tmp_path / 'cache'}", "run.device=cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    key = model[0] if len(model) == 1 else "model.moe_ffn_dim=10000000"
    assert err.startswith(f"ndtrain: error: {key.replace('=', ' = ')}: the model states alone")
    assert "GiB per rank × 2 local processes" in err and "of physical RAM" in err
    assert list(tmp_path.iterdir()) == []  # nothing written, no process started
