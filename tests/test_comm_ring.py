"""Our ring all-reduce (comm/ring.py) against the backend's, the nccl-tests bus-bandwidth
conventions, and `ndtrain bench comm`'s output."""

import math

import pytest
import torch

from ndtrain.plan.calibration import LinkFit, bus_bandwidth, fit
from ndtrain.testing import run_ranks

# Sizes that 2, 3 and 4 do not all divide, below the group size, and empty.
SIZES = [0, 1, 2, 3, 5, 7, 10, 1001]


def _ring_vs_backend(sizes):
    import torch.distributed as dist

    from ndtrain.comm import ops
    from ndtrain.comm.ring import ring_all_reduce
    from ndtrain.mesh import MeshShape, ParallelMesh

    n, rank = dist.get_world_size(), dist.get_rank()
    group = ParallelMesh.build(MeshShape(dp_shard=n)).group("dp_shard")
    out = []
    for size in sizes:
        g = torch.Generator().manual_seed(1000 * rank + size)
        x = torch.randn(size, dtype=torch.float64, generator=g)
        ours, theirs = x.clone(), x.clone()
        ring_all_reduce(ours, group)
        ops.all_reduce(theirs, group)
        out.append((ours, theirs))
    # a non-contiguous tensor is reduced in place too
    base = torch.arange(12, dtype=torch.float64).reshape(3, 4) * (rank + 1)
    view = base.t()
    ring_all_reduce(view, group)
    group.stats.reset()
    ring_all_reduce(torch.ones(12 * n, dtype=torch.float32), group)
    wire = (group.stats.wire(kind="send"), group.stats.wire(kind="recv"))
    return out, base, wire


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_all_reduce_equals_the_backend(n):
    results = run_ranks(_ring_vs_backend, n, SIZES)
    for rank, (pairs, base, wire) in enumerate(results):
        for size, (ours, theirs) in zip(SIZES, pairs):
            assert ours.shape == (size,)
            # summation order differs (ring vs gloo): fp64 round-off only
            torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
        expected = torch.arange(12, dtype=torch.float64).reshape(3, 4) * (n * (n + 1) / 2)
        torch.testing.assert_close(base, expected, rtol=0, atol=0)
        # 2(n−1) chunks of S/n sent: the all-reduce's 2(n−1)/n·S wire bytes; receives count nothing
        assert wire == (2 * (n - 1) * 12 * 4, 0.0)
    assert all(torch.equal(results[0][0][i][0], r[0][i][0]) for r in results for i in range(len(SIZES)))


def test_bus_bandwidth_by_hand():
    # 64 MiB in 10 ms on 8 ranks: algbw = 67,108,864 B / 0.01 s = 6.7108864 GB/s;
    # all-reduce busbw = algbw · 2·7/8 = 11.7440512 GB/s; reduce-scatter, all-gather,
    # all-to-all · 7/8 = 5.8720256 GB/s; broadcast, reduce, send/recv · 1.
    algbw, busbw = bus_bandwidth("all_reduce", 8, 64 * 2**20, 0.01)
    assert algbw == pytest.approx(6.7108864e9) and busbw == pytest.approx(11.7440512e9)
    for kind in ("reduce_scatter", "all_gather", "all_to_all"):
        assert bus_bandwidth(kind, 8, 64 * 2**20, 0.01)[1] == pytest.approx(5.8720256e9)
    for kind in ("broadcast", "reduce", "send_recv"):
        assert bus_bandwidth(kind, 8, 64 * 2**20, 0.01)[1] == pytest.approx(6.7108864e9)
    assert bus_bandwidth("ring_all_reduce", 8, 64 * 2**20, 0.01)[1] == pytest.approx(11.7440512e9)


def test_fit_recovers_latency_and_bandwidth():
    truth = LinkFit(latency_s=50e-6, busbw=2e9)
    points = [(s, truth.seconds("all_gather", 4, s)) for s in (2**10, 2**14, 2**20, 2**26)]
    got = fit("all_gather", 4, points)
    assert got.latency_s == pytest.approx(50e-6, rel=1e-6) and got.busbw == pytest.approx(2e9, rel=1e-6)
    assert truth.seconds("all_reduce", 1, 2**20) == 0.0  # one rank: nothing to send
    # with its points, a fit follows the measured curve: exactly at the points (bus bytes:
    # S·3/4 for an all-gather on 4 ranks), log-log between them, the last slope beyond
    for s, t in points:
        assert got.seconds("all_gather", 4, s) == pytest.approx(t)
    bent = LinkFit(1e-4, 1e9, ((1e3, 1e-4), (1e6, 1e-3), (1e8, 1.0)))
    assert bent.seconds("send_recv", 2, 10**4.5) == pytest.approx(10**-3.5)  # halfway in log-log
    assert bent.seconds("send_recv", 2, 2e8) == pytest.approx(1.0 + 1e8 * (1.0 - 1e-3) / (1e8 - 1e6))
    assert bent.seconds("send_recv", 2, 10) == pytest.approx(1e-4)  # below the first point: the latency


@pytest.mark.slow  # bench plumbing; the ring's proofs stay
def test_bench_comm_reports_every_collective(tmp_path, capsys, monkeypatch):
    """The command end to end on 2 ranks and two small sizes; the ring/backend line at 4 KB
    instead of 64 MB, to keep the test quick (its label is checked below)."""
    from ndtrain.bench import comm
    from ndtrain.cli import main

    def launch(nproc, fn, *args):  # the fork server instead of torch's elastic launcher: same worker, faster
        return dict(enumerate(run_ranks(fn, nproc, *args, timeout=300)))

    assert comm.label(comm.RATIO_SIZE) == "64 MB"
    monkeypatch.setattr("ndtrain.launch.launch_local", launch)
    monkeypatch.setattr(comm, "TARGET_S", 0.001)
    monkeypatch.setattr(comm, "RATIO_SIZE", 4096)
    code = main(["bench", "comm", "--nproc", "2", "--rounds", "1", "--sizes", "1K", "4KB", "--out", str(tmp_path / "out"),
                 f"data.cache_dir={tmp_path / 'cache'}", "run.device=cpu"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert (tmp_path / "out" / "comm-busbw.png").stat().st_size > 0
    assert (tmp_path / "cache" / "comm_calibration.json").is_file()
    header = next(line for line in out if line.strip().startswith("size")).split()
    assert header[1:] == list(comm.KINDS)
    assert [line.split()[0] for line in out if line.strip().startswith(("1 KB", "4 KB"))] == ["1", "4"]
    last = out[-1]
    assert last.startswith("ndtrain ring/backend all_reduce busbw ratio at 4 KB: ")
    assert math.isfinite(float(last.rsplit(": ", 1)[1])) and len(last.rsplit(": ", 1)[1].split(".")[1]) == 2


def test_bench_comm_bad_sizes(capsys):
    from ndtrain.cli import main
    assert main(["bench", "comm", "--sizes", "12Q"]) == 2
    assert "--sizes = '12Q'" in capsys.readouterr().err
