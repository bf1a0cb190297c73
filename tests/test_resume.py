"""Checkpoints: 10 steps straight equal 5 steps, a resume, and 5 more, bit for bit. (Other
layouts: tests/test_reshard.py; corrupt checkpoints: tests/test_checkpoint.py.)"""

import pytest
import torch

from helpers import train_in_rank
from ndtrain.testing import run_ranks

STEPS = ["train.steps=10", "train.eval_every=5", "train.micro_batch=2"]


def _straight_vs_resumed(data_dir, root, extra, first_part=5):
    import torch.distributed as dist
    steps = STEPS + extra
    straight, s_state, _ = train_in_rank(steps, data_dir, run_dir=f"{root}/straight")
    first, _, _ = train_in_rank(steps, data_dir, stop_after=first_part, run_dir=f"{root}/resumed")
    dist.barrier()
    second, r_state, trainer = train_in_rank(steps, data_dir, run_dir=f"{root}/resumed", resume=True)
    return straight, first + second, s_state, r_state, trainer.step


# ZeRO-3 in bf16: sharded parameters, fp32 master slices; ZeRO-1 in fp16: replicated
# parameters, sharded masters and moments, the loss scaler's state.
@pytest.mark.parametrize("world, extra", [(1, []),
                                          pytest.param(2, [], marks=pytest.mark.slow),  # zero3-bf16 and tp2 resume on 2 ranks
                                          (2, ["parallel.zero=3", "train.precision=bf16"]),
                                          pytest.param(2, ["parallel.zero=1", "train.precision=fp16",
                                                           "train.loss_scale_window=3"], marks=pytest.mark.slow),
                                          # TP: local shards, the dropout stream a tp group shares
                                          (2, ["parallel.tp=2", "model.dropout=0.1", "train.micro_batch=4"])],
                         ids=["single", "dp2", "zero3-bf16", "zero1-fp16", "tp2-sp-dropout"])
def test_resume_is_bit_exact(world, extra, tiny_data, tmp_path):
    results = run_ranks(_straight_vs_resumed, world, tiny_data, str(tmp_path), extra)
    straight, resumed, s_state, r_state, step = results[0]
    assert step == 10
    assert straight == resumed  # exact float equality, every step
    for k in s_state:
        assert torch.equal(s_state[k], r_state[k]), k
    # the resumed run's metrics file reads like the straight one
    from ndtrain.observe.metrics import read_metrics
    a = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    b = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(10))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r.get("val_loss") for r in a] == [r.get("val_loss") for r in b]
