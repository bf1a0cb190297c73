"""`python -m ndtrain.cli ...` (what torchrun and SLURM start on every node) is `ndtrain ...`."""

import sys

from ndtrain.cli import main

if __name__ == "__main__":  # not again in the processes that multiprocessing spawns from this one
    sys.exit(main())
