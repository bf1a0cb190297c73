import os
import sys

# Ranks started by the harness import test modules by name.
sys.path.insert(0, os.path.dirname(__file__))

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
