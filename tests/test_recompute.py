"""Activation recomputation gives the same gradients bit for bit, lowers the activation peak,
and leaks nothing; the CPU memory meter it is measured with counts bytes exactly."""

import torch

from ndtrain.model.args import PRESETS
from ndtrain.model.llama import Transformer
from ndtrain.observe.memory import CpuPeak
from ndtrain.parallel.recompute import apply_recompute
from ndtrain.model.loss import token_loss_sum

MODES = ["none", "selective", "every:2", "full"]


def _model(mode: str, dropout: float = 0.0) -> Transformer:
    model = Transformer(PRESETS["tiny"].with_(dropout=dropout))
    model.init_weights(0)
    apply_recompute(model, mode)
    return model


def _batch(seq: int = 64, rows: int = 2):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (rows, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _step(model, x, y, meter=None):
    torch.manual_seed(7)  # dropout draws
    with meter if meter is not None else torch.enable_grad():
        token_loss_sum(model(x), y).backward()
    return {k: p.grad for k, p in model.named_parameters()}


def test_recompute_modes_give_bitwise_equal_gradients():
    """With dropout on, so the second run must replay the random state too."""
    x, y = _batch()
    reference = _step(_model("none", dropout=0.1), x, y)
    for mode in MODES[1:]:
        grads = _step(_model(mode, dropout=0.1), x, y)
        for k in reference:
            assert torch.equal(grads[k], reference[k]), (mode, k)


def test_recompute_wraps_the_regions_it_names():
    assert apply_recompute(_model("none"), "full") == [f"layers.{i}" for i in range(4)]
    assert apply_recompute(_model("none"), "every:1") == [f"layers.{i}" for i in range(4)]
    assert apply_recompute(_model("none"), "every:3") == ["layers.0", "layers.3"]
    assert apply_recompute(_model("none"), "selective") == [f"layers.{i}.attention.core" for i in range(4)]


def test_recompute_lowers_the_activation_peak_and_leaks_nothing():
    """Peak bytes allocated by forward + backward (4 blocks, 2×256 tokens): full keeps one
    hidden state per block, every:2 half the blocks' activations, selective drops the
    attention cores' saved tensors. After backward only the parameter gradients remain."""
    x, y = _batch(seq=256)
    peaks = {}
    for mode in MODES:
        model = _model(mode)
        meter = CpuPeak()
        grads = _step(model, x, y, meter)
        peaks[mode] = meter.peak
        assert meter.live == sum(g.numel() * g.element_size() for g in grads.values()), mode
    assert peaks["full"] < peaks["every:2"] < peaks["none"]
    assert peaks["selective"] < peaks["none"]
    assert peaks["full"] < 0.5 * peaks["none"]


def test_cpu_peak_counts_storage_bytes_exactly():
    keep = torch.zeros(10)  # allocated before: not counted
    grown = torch.empty(0)  # made before, grown while the meter runs: counted
    meter = CpuPeak()
    with meter:
        a = torch.empty(1000)  # 4000 bytes
        view = a[10:20].view(2, 5)  # no new memory
        a.add_(1)  # in place: no new memory
        b = torch.ones(500, dtype=torch.float64)  # + 4000
        del a, view
        c = keep + 1  # + 40
        grown.untyped_storage().resize_(8000)  # + 8000, outside any operation (ZeRO-3's regather)
        d = c * 2  # + 40
        m = torch.empty(10**6, device="meta")  # meta tensors take no memory
        grown.untyped_storage().resize_(0)  # freed again: - 8000
    assert meter.peak == 4000 + 40 + 8000 + 40
    assert meter.live == 4000 + 40 + 40
    del b, c, d, m
    assert meter.live == 0
