import os
import sys

# Ranks started by the harness import test modules by name.
sys.path.insert(0, os.path.dirname(__file__))

# One torch thread in every process of the suite (this one, the CLI runs it makes and the
# processes they start: run.threads=0 takes OMP_NUM_THREADS); NDTRAIN_TEST_THREADS=N sets N,
# 0 leaves torch's choice. The suite's models are tiny, and on a 2-core machine a second
# thread per tiny matmul costs more in contention with a test's other processes than it
# gains: the whole default tier took 322 s on one thread against 364 s on torch's two (idle,
# 2026-11-28); under load a 40x64 @ 64x128 matmul took 20 us on one thread, 0.6-1.8 ms on two.
THREADS = os.environ.get("NDTRAIN_TEST_THREADS", "1")
if THREADS != "0":
    os.environ["OMP_NUM_THREADS"] = THREADS
    import torch
    torch.set_num_threads(int(THREADS))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A prepared tiny corpus (real Python source, 512-token BPE), shared by the session."""
    from helpers import tiny_data_dir
    return str(tiny_data_dir(tmp_path_factory.mktemp("tiny_data")))


@pytest.fixture
def one_thread():
    """One torch thread in this process while a test runs: on a shared 2-core machine two
    threads per tiny fp64 matmul cost more in contention than they gain (a tiny model's
    forward and backward: 0.4 s on one thread, 3-7 s on two, under load)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# References shared by a feature's own file and tests/test_frontier_compositions.py, computed
# once per session (a single-process fp64 run and its twin each), only when a test asks.
@pytest.fixture(scope="session")
def muon_refs(tiny_data):
    from ndtrain.testing import run_ranks
    from test_muon import _references
    return run_ranks(_references, 1, tiny_data, True, timeout=600)[0]


@pytest.fixture(scope="session")
def deepseek_reference(tiny_data):
    from ndtrain.testing import run_ranks
    from test_deepseek_layouts import _reference
    return run_ranks(_reference, 1, tiny_data)[0]
