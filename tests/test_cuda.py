"""On a GPU (`python -m pytest -m cuda`; `ndtrain bench gpu` runs them first): bf16 training
steps eager and compiled, the host-to-device copy of a batch, and generation, against the
same work on the CPU or in fp32. The context-parallel kernels' CUDA test is in
tests/test_cp.py, the step's sync count in tests/test_syncs.py."""

import pytest
import torch

from helpers import train_in_rank

pytestmark = pytest.mark.cuda

CUDA = ["run.device=cuda", "train.steps=4", "train.log_every=2"]


def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def test_bf16_steps_eager_and_compiled_follow_fp32(tiny_data):
    """bf16 on the GPU, eager and with Inductor (train.compile): the losses of 4 steps within
    3e-2 of the fp32 GPU run's (bf16 keeps 8 bits: 2^-8 ≈ 4e-3 per rounding, a few roundings
    through 4 blocks and the loss), finite, and MFU reported."""
    _needs_cuda()
    fp32, _, _ = train_in_rank(CUDA + ["train.precision=fp32"], tiny_data)  # auto would be bf16 on CUDA
    for extra in ([], ["train.compile=true"]):
        losses, _, trainer = train_in_rank(CUDA + ["train.precision=bf16"] + extra, tiny_data)
        assert all(abs(a - b) <= 3e-2 * abs(b) for a, b in zip(losses, fp32)), (extra, losses, fp32)
        assert trainer.history[-1]["tokens_per_s"] > 0


def test_a_batch_reaches_the_gpu_without_a_sync():
    """A host batch goes through pinned memory with a non-blocking copy: torch's sync
    detector stays silent, and the values arrive."""
    _needs_cuda()
    from ndtrain.data.batch import MicroBatch

    host = MicroBatch(torch.arange(64).view(4, 16), torch.arange(64).view(4, 16) + 1)
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved = host.to(torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert moved.tokens.is_cuda and torch.equal(moved.targets.cpu(), host.targets)


def test_generation_on_the_gpu_equals_the_cpu():
    """Greedy generation with the KV cache (fp32, tiny model): the same tokens on the GPU as
    on the CPU, and the same as without the cache."""
    _needs_cuda()
    from ndtrain.generate.sampler import generate
    from ndtrain.model.args import PRESETS
    from ndtrain.parallel.parallelize import build_model

    args = PRESETS["tiny"]
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    out = {}
    for device, cache in (("cpu", True), ("cuda", True), ("cuda", False)):
        model = build_model(args, 0, torch.device(device))
        out[device, cache] = generate(model, prompts, 16, temperature=0.0, use_cache=cache).tokens
    assert out["cuda", True] == out["cpu", True] == out["cuda", False]
