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
