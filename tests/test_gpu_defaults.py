"""Issue 32, part 3: what a first GPU run gets by default, checked without a GPU: bf16 where
the device is CUDA (fp32 on the CPU), TF32 for what stays fp32 and MFU quoted against the
peak that then runs, the allocator's expandable segments, run.deterministic, and data
preparation outside the process group (no collective timeout on a cold cache)."""

import os

import pytest
import torch

from ndtrain.config import load_config, to_toml, validate
from ndtrain.config import sections


def _validated(overrides, cuda: bool, monkeypatch):
    monkeypatch.setattr(sections, "uses_cuda", lambda device: cuda and device != "cpu")
    return validate(load_config(None, overrides), world=1, check_paths=False)


@pytest.mark.parametrize("cuda, given, runs", [(False, [], "fp32"), (True, [], "bf16"),
                                               (True, ["train.precision=fp32"], "fp32"),
                                               (True, ["run.device=cpu"], "fp32"),
                                               (False, ["train.precision=bf16"], "bf16")])
def test_precision_auto_is_bf16_on_cuda_and_fp32_on_the_cpu(cuda, given, runs, monkeypatch):
    cfg = _validated(given, cuda, monkeypatch)
    assert cfg.train.precision == runs
    assert f'precision = "{runs}"' in to_toml(cfg)  # config.toml records what ran


def test_the_banner_names_the_precision_that_runs(monkeypatch):
    from ndtrain.cli import run as cli_run

    cfg = _validated(["parallel.dp=1"], False, monkeypatch)
    assert cli_run.layout_words(cfg) == "1 process (pp=1 dp=1 cp=1 tp=1), fp32"
    cfg = _validated(["train.precision=fp32", "run.device=auto"], True, monkeypatch)
    monkeypatch.setattr(cli_run, "uses_cuda", lambda device: device != "cpu")
    assert cli_run.layout_words(cfg).endswith("fp32 (matmuls on TF32)")
    cfg = _validated(["train.precision=fp8", "train.fp8_recipe=rowwise"], False, monkeypatch)
    assert cli_run.layout_words(cfg).endswith("fp8 rowwise (the rest bf16)")


def test_the_planner_plans_gpus_in_bf16_unless_told():
    from ndtrain.plan.cluster import resolve
    from ndtrain.plan.planner import plan_config

    cluster = resolve("H100-SXM", "~/.cache/ndtrain")
    for given, planned in (([], "bf16"), (["train.precision=fp32"], "fp32")):
        cfg, _ = plan_config(load_config(None, ["model.preset=1B", *given]), cluster, 8)
        assert cfg.train.precision == planned


@pytest.fixture
def numerics():
    """Restore the process-wide settings a test changes."""
    kept = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
            torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    yield
    torch.set_float32_matmul_precision(kept[0])
    torch.backends.cudnn.allow_tf32 = kept[1]
    torch.use_deterministic_algorithms(kept[2], warn_only=kept[3])
    if kept[4] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = kept[4]


def test_tf32_on_cuda_only_and_deterministic_everywhere(numerics, monkeypatch):
    from ndtrain.launch import configure_numerics

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.set_float32_matmul_precision("highest")
    configure_numerics(torch.device("cpu"), tf32=True, deterministic=False)
    assert torch.get_float32_matmul_precision() == "highest"  # the CPU proofs keep full fp32
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    configure_numerics(torch.device("cuda", 0), tf32=True, deterministic=False)  # flags only: no GPU touched
    assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
    configure_numerics(torch.device("cuda", 0), tf32=False, deterministic=True)
    assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
    assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_mfu_of_an_fp32_run_on_tf32_is_quoted_against_the_tf32_peak():
    from ndtrain.observe.mfu import gpu_peak

    name = "NVIDIA H100 80GB HBM3"
    assert gpu_peak(name, "fp32", tf32=True)[0] == 494.7e12 and "TF32" in gpu_peak(name, "fp32", True)[1]
    assert gpu_peak(name, "fp32", tf32=False)[0] == 67e12
    assert gpu_peak(name, "bf16", tf32=True)[0] == gpu_peak(name, "fp8", tf32=False)[0] == 989e12
    assert gpu_peak("Some Future GPU", "bf16", True)[0] is None


def test_expandable_segments_unless_the_user_configured_the_allocator(monkeypatch):
    from ndtrain.launch import ALLOC_CONF, allocator_defaults

    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(key, raising=False)
    allocator_defaults()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ALLOC_CONF
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:128")
    allocator_defaults()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_torchrun_prepares_the_data_before_the_process_group_exists(monkeypatch):
    """Under torchrun (no data folder from a parent) each rank prepares before
    init_process, so no collective (and no NCCL timeout) waits on a cold cache; local rank
    0 shows the progress, the others wait on the build's file lock (data/prepare.py)."""
    from ndtrain.train import worker

    calls = []

    class Stop(Exception):
        pass

    class Data:
        def verify(self):
            calls.append("verify")

    def fake_prepare(cfg, progress):
        calls.append(("prepare", progress))
        return Data()

    def fake_init(*args, **kwargs):
        calls.append("init_process")
        raise Stop

    monkeypatch.setattr(worker, "prepare", fake_prepare)
    monkeypatch.setattr(worker, "init_process", fake_init)
    for rank, expected in (("0", [("prepare", True), "verify", "init_process"]),
                           ("1", [("prepare", False), "init_process"])):
        calls.clear()
        monkeypatch.setenv("LOCAL_RANK", rank)
        with pytest.raises(Stop):
            worker._train(load_config(None, []), "runs/x", None, None, None)
        assert calls == expected
