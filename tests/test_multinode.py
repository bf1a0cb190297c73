"""Multi-node, on one host: examples/slurm.sbatch run as SLURM would run it on two nodes.

`srun` (a stand-in on PATH) starts the script's command once per "node", at the same time,
with SLURM's variables; `scontrol show hostnames` names 127.0.0.1 as the first node. So two
torchrun agents (--nnodes 2 --nproc-per-node 1) meet through c10d rendezvous on 127.0.0.1,
and their two ranks train one run into one run.dir. Both agents must exit 0, and the run's
losses must equal, bit for bit, a local 2-process run of the same configuration (the same
layout, dp 2, does the same arithmetic).
"""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from helpers import make_tiny_corpus

ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "examples" / "slurm.sbatch"

SRUN = """#!/bin/bash
# srun on SLURM_NNODES nodes, one task each: the command, that many times at once
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" > "$SHIM_LOGS/node$node.out" 2> "$SHIM_LOGS/node$node.err" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
SCONTROL = """#!/bin/bash
# scontrol show hostnames LIST: every node is this host (many lines, as a large job has: a
# reader that stops after the first would make this one die of SIGPIPE)
for ((node = 0; node < 20000; node++)); do echo 127.0.0.1; done
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_torchrun_agents_from_the_sbatch_example_train_like_two_local_processes(tmp_path):
    from ndtrain.cli import main

    corpus = make_tiny_corpus(tmp_path)
    keys = ["model.preset=tiny", "train.steps=4", "train.global_batch=4", "train.seq_len=32", "train.eval_batches=1",
            f"data.path={corpus}", "data.vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}", "run.device=cpu",
            "run.plot=false", "run.progress=false", "run.threads=1", "run.collective_timeout_s=90"]
    shims, logs = tmp_path / "shims", tmp_path / "logs"
    shims.mkdir()
    logs.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    run = tmp_path / "multinode"
    env = {**os.environ, "PATH": f"{shims}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NAME": "ndtrain", "NPROC_PER_NODE": "1", "RDZV_PORT": str(_free_port()), "MAX_RESTARTS": "0",
           "RUN_DIR": str(run), "SHIM_LOGS": str(logs),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # its own session, so that a hang ends with every agent and rank killed and their logs shown
    proc = subprocess.Popen(["bash", str(SBATCH), *keys], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
    errors = {p.name: p.read_text()[-3000:] for p in sorted(logs.iterdir())}
    assert proc.returncode == 0, (proc.returncode, stderr[-2000:], errors)
    assert "validation loss" in (logs / "node0.out").read_text() + (logs / "node1.out").read_text(), errors
    assert (run / "checkpoints" / "latest").is_file() and "dp = 2" in (run / "config.toml").read_text()

    local = tmp_path / "local"
    assert main(["train", "--nproc", "2", *keys, f"run.dir={local}"]) == 0
    assert len(_losses(run)) == 4 and _losses(run) == _losses(local)
