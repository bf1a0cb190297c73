"""This machine's compute model (plan/compute.Measured) and `ndtrain bench plan`'s plumbing
(never its timings): how a calibration prices a matmul and an attention kernel, that the
planner uses it for the number of local processes it was measured with, the input the bench
refuses, and (slow) the whole bench on a tiny model."""

import math
import re

import pytest

from ndtrain.cli import main
from ndtrain.plan.calibration import LinkFit
from ndtrain.plan.cluster import Cluster
from ndtrain.plan.compute import Measured, load, save
from ndtrain.plan.work import Attention, Matmul, Work

PROFILES = {"m": ((16, 0.25), (1024, 1.0), (4096, 1.0)), "k": ((16, 0.5), (1024, 1.0), (4096, 0.8)),
            "n": ((16, 1.0), (4096, 1.0))}
ATTENTION = ((64, 32, 1e9, 0.5e9), (64, 128, 4e9, 2e9), (1024, 32, 4e9, 2e9), (1024, 128, 16e9, 8e9))
MODEL = Measured(rate=100e9, profiles=PROFILES, bandwidth=10e9, attention=ATTENTION, forward_op_s=2e-6,
                 backward_op_s=3e-6, optimizer_s=1e-9, split_s=1e-3, expert_s=(1e-4, 2e-4), ranks=2, threads=1)


def test_a_matmul_runs_at_the_rate_of_its_sizes():
    """rate(m, k, n) = R · e_m(m) · e_k(k) · e_n(n), each e interpolated in log size: m = 128 is
    halfway (in log) from 16 to 1024, so e_m = √(0.25 · 1) = 0.5; k = 2048 is halfway from 1024
    to 4096, e_k = √0.8; beyond the measured sizes the ends hold."""
    mm = Matmul(128, 2048, 8000)
    expected = mm.flops / (100e9 * 0.5 * math.sqrt(0.8) * 1.0)
    assert MODEL.matmul_seconds(mm) == pytest.approx(expected)
    assert MODEL.efficiency("m", 4) == 0.25 and MODEL.efficiency("k", 10**6) == 0.8


def test_attention_ops_elementwise_and_splits_add_up():
    """The attention kernel at its measured rate (bilinear in log sequence and log head size:
    s = 256, d = 64 sits halfway in both, so the geometric mean of the four corners), bytes
    at the bandwidth, operations at their cost (backward's in B and W), zero bubble's splits
    and an MoE block's expert visits at theirs."""
    a = Attention(2, 256, 256, 64)
    rate = math.exp((math.log(1e9) + math.log(4e9) + math.log(4e9) + math.log(16e9)) / 4)
    assert MODEL.attention_seconds(a) == pytest.approx(a.flops / rate)
    work = Work([], 5e9, 1000, [], 4, 8)
    assert MODEL.seconds(work) == pytest.approx(0.5 + 1000 * 2e-6 + 4e-3 + 8e-4)
    assert MODEL.seconds(work, backward=True) == pytest.approx(0.5 + 1000 * 3e-6 + 4e-3 + 16e-4)
    assert MODEL.optimizer_seconds(1e6) == pytest.approx(1e-3)


def test_the_planner_uses_the_calibration_of_its_process_count(tmp_path):
    save(tmp_path, MODEL)
    assert load(tmp_path, 2) == MODEL and load(tmp_path, 4) is None
    link = LinkFit(1e-4, 1e9)
    node = Cluster("this-machine", {"fp32": 200e9}, 16e9, 2, link, link, shared_node=True, measured={2: MODEL})
    assert node.per_device(2).compute == MODEL and node.per_device(2).peak["fp32"] == 100e9
    assert node.per_device(4).compute is None  # measured with 2 processes: not valid for 4


@pytest.mark.parametrize("argv, fragment", [
    (["--nproc", "1"], "--nproc = 1: every layout needs at least 2 ranks"),
    (["parallel.tp=2"], "parallel.tp = '2': bench plan sets the layouts itself"),
    (["--only", "xx"], "--only = 'xx': matches no layout; names: dp2, zero3 dp2"),
])
def test_bench_plan_refuses(argv, fragment, capsys):
    assert main(["bench", "plan", *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_bench_plan_runs_every_layout(tmp_path, capsys):
    """One round of one step on a tiny model: every layout is built, stepped and planned, the
    calibration saved, and the last line is the worst ratio."""
    code = main(["bench", "plan", "--rounds", "1", "--steps", "1", "model.dim=64", "model.n_layers=4",
                 "model.ffn_dim=128", "model.moe_ffn_dim=64", "model.vocab_size=512", "train.seq_len=32",
                 f"data.cache_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0
    for name in ("dp2", "zero3 dp2", "tp2", "pp2 afab", "pp2 1f1b", "pp2 zb", "pp2 interleaved", "pp2 zbv",
                 "pp2 dualpipev", "cp2", "ep2"):
        assert re.search(rf"\n{re.escape(name)}\b.* \d+\.\d\d +\d", out), name
    assert re.search(r"\nndtrain plan worst predicted/measured step time ratio: \d+\.\d\d\n$", out)
    assert load(tmp_path, 2) is not None
