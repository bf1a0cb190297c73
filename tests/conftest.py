import os
import sys

# Ranks started by the harness import test modules by name.
sys.path.insert(0, os.path.dirname(__file__))

# NDTRAIN_TEST_THREADS=N: N torch threads in every process of the suite (this one, the CLI runs
# it makes and the processes they start: run.threads=0 takes OMP_NUM_THREADS). Unset, torch
# chooses. On a loaded 2-core machine N=1 helps a lot: a second thread per tiny matmul costs
# more in contention than it gains (a 40x64 @ 64x128 matmul: 20 us on one thread, 0.6-1.8 ms
# on two at load 12; an SFT subset 14 s against 86 s). On an idle one it does not (the
# layout and TP files: 43 s against 38 s), so it is not the default.
if os.environ.get("NDTRAIN_TEST_THREADS"):
    os.environ["OMP_NUM_THREADS"] = os.environ["NDTRAIN_TEST_THREADS"]
    import torch
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

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
