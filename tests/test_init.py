"""Initial weights from a counter-based generator (model/init.py): the generator is Philox,
the values are normal with each parameter's std, every layout's initial weights equal one
process's bit for bit, and each rank computes only the elements it keeps."""

import math

import pytest
import torch

from helpers import TINY
from ndtrain.model.args import PRESETS
from ndtrain.model.init import Region, initial_value, initial_values, normal_at, normal_range, philox2x32
from ndtrain.testing import run_ranks


def test_philox_matches_the_published_known_answers():
    """Random123's known-answer vectors for Philox2x32-10 (kat_vectors: counter, key → output)."""
    cases = [((0, 0), 0, (0xFF1DAE59, 0x6CD10DF2)),
             ((0xFFFFFFFF, 0xFFFFFFFF), 0xFFFFFFFF, (0x2C3F628B, 0xAB4FD7AD)),
             ((0x243F6A88, 0x85A308D3), 0x13198A2E, (0xDD7CE038, 0xF62A4C12))]
    for (c0, c1), key, expected in cases:
        w0, w1 = philox2x32(torch.tensor([c0]), torch.tensor([c1]), key)
        assert (int(w0), int(w1)) == expected


def test_any_element_is_computed_alone():
    """normal_at (any indices) equals normal_range (a run) element for element, at pair
    boundaries, beyond 2^32 and on a run that starts at an odd index."""
    run = normal_range(7, 2 ** 33 - 5, 11)
    index = torch.arange(2 ** 33 - 5, 2 ** 33 + 6)
    assert torch.equal(normal_at(7, index), run)
    assert torch.equal(normal_at(7, index[[3, 0, 10]]), run[[3, 0, 10]])
    assert torch.equal(normal_range(7, 2 ** 33 - 4, 4), run[1:5])


def test_initial_values_are_normal_with_the_parameter_std():
    """n = 2^18 draws: the sample mean within 5 standard errors (5/√n), the sample std within
    5 of its standard errors (≈ 1/√(2n)), the fraction beyond 1, 2 and 3 std within 5
    binomial standard errors of the normal's; wo is scaled by 1/√(2·layers)."""
    args = PRESETS["small"]
    n = 2 ** 18
    z = initial_value("tok_embeddings.weight", (n,), args, 0).double() / 0.02
    assert abs(float(z.mean())) < 5 / math.sqrt(n)
    assert abs(float(z.std()) - 1) < 5 / math.sqrt(2 * n)
    for k in (1, 2, 3):
        p = math.erfc(k / math.sqrt(2))
        assert abs(float((z.abs() > k).double().mean()) - p) < 5 * math.sqrt(p * (1 - p) / n)
    wo = initial_value("layers.0.attention.wo.weight", (n,), args, 0).double()
    assert abs(float(wo.std()) / (0.02 / math.sqrt(2 * args.n_layers)) - 1) < 5 / math.sqrt(2 * n)
    assert torch.equal(initial_value("layers.0.ffn_norm.weight", (8,), args, 0), torch.ones(8))
    assert not torch.equal(initial_value("layers.0.attention.wq.weight", (64,), args, 0),
                           initial_value("layers.0.attention.wq.weight", (64,), args, 1))


def test_regions_equal_slices_of_the_whole():
    """A chunk along any dimension (padded past the end), and any flat range of it, equals the
    same slice of the whole tensor's initial value."""
    args = PRESETS["tiny"]
    name = "layers.1.feed_forward.w1.weight"
    full = initial_value(name, (10, 6, 4), args, 3)
    for offset, shape in (((0, 2, 0), (10, 2, 4)), ((8, 0, 0), (3, 6, 4)), ((0, 4, 0), (10, 3, 4)), ((4, 0, 0), (2, 6, 4))):
        region = Region((10, 6, 4), offset, shape)
        got = initial_values(name, region, args, 3).view(shape)
        padded = torch.zeros(shape)
        inside = tuple(slice(0, min(s, f - o)) for s, f, o in zip(shape, (10, 6, 4), offset))
        padded[inside] = full[tuple(slice(o, o + i.stop) for o, i in zip(offset, inside))]
        assert torch.equal(got, padded), (offset, shape)
        for lo, hi in ((0, 1), (5, 37), (region.numel - 9, region.numel)):
            assert torch.equal(initial_values(name, region, args, 3, lo, hi), padded.flatten()[lo:hi])


def test_the_generator_works_in_a_fixed_space():
    """Beyond the values it returns, a draw of 2^17 elements (several passes) holds at most
    WORKSPACE_BYTES (the CPU memory meter), whether it runs through the full tensor or a
    strided chunk."""
    from ndtrain.model.init import WORKSPACE_BYTES
    from ndtrain.observe.memory import CpuPeak

    args, n = PRESETS["tiny"], 1 << 17
    for region in (Region.whole((n,)), Region((256, 1024), (0, 512), (256, 512))):
        meter = CpuPeak()
        with meter:
            values = initial_values("layers.0.attention.wq.weight", region, args, 0)
        assert meter.peak - values.numel() * 4 <= WORKSPACE_BYTES, (region, meter.peak)


LAYOUTS = {
    "dp2-zero3": ["parallel.zero=3"],
    "dp2-zero1": ["parallel.zero=1"],
    "tp2-sp": ["parallel.tp=2", "parallel.sp=true"],
    "tp2-vocab-padded": ["parallel.tp=2", "model.vocab_size=511", "model.tie_embeddings=true"],
    "pp2": ["parallel.pp=2", "train.micro_batch=2"],
    "ep2-moe": ["model.preset=tiny-moe", "parallel.ep=2", "parallel.zero=3"],
}


def _initial_weights(overrides_by_name):
    import torch.distributed as dist

    from ndtrain.config import load_config, validate
    from ndtrain.mesh import ParallelMesh
    from ndtrain.model.llama import Transformer
    from ndtrain.parallel.parallelize import build
    from ndtrain.train.worker import mesh_shape

    out = {}
    for name, overrides in overrides_by_name.items():
        cfg = validate(load_config(None, TINY + overrides), world=dist.get_world_size())
        args = cfg.model_args()
        par = build(args, ParallelMesh.build(mesh_shape(cfg)), cfg)
        state = par.full_model_state()
        if state is not None:
            one = Transformer(args)
            one.init_weights(cfg.train.seed)
            same = {k: torch.equal(v, state[k]) for k, v in one.state_dict().items() if k in state}
            assert set(state) <= set(one.state_dict())
        else:
            same = None
        out[name] = {"same": same, "generated": par.initialised, "kept": _kept(par),
                     "total": sum(p.numel() for p in Transformer(args, None).parameters()) if state else None}
    return out


def _kept(par) -> int:
    """The elements of initial values this rank keeps: its ZeRO slices (padding excluded), or
    its local parameters (tensor-parallel chunks with their padding, its stage, its experts)."""
    flats = getattr(par.states, "flats", None)
    if flats is not None:
        return sum(max(0, min(f.numel, (f.group.rank + 1) * f.shard_numel) - min(f.numel, f.group.rank * f.shard_numel))
                   if f.stage == 3 else f.numel for f in flats)
    return sum(p.numel() for p in {id(p): p for p in par.model.parameters()}.values())


def test_every_layout_starts_from_one_process_weights_computing_only_its_shard():
    """Issue 20 item 5. Bitwise: every parameter of the layout's gathered initial weights equals
    one process's `init_weights`. Work: each rank computed exactly the elements it keeps
    (`Parallelized.initialised`), so under ZeRO-3 the two ranks' counts add up to the model
    and each is about half of it."""
    results = run_ranks(_initial_weights, 2, LAYOUTS)
    for name in LAYOUTS:
        same = results[0][name]["same"]
        assert same and all(same.values()), (name, [k for k, v in same.items() if not v])
        for rank in (0, 1):
            r = results[rank][name]
            assert r["generated"] == r["kept"], (name, rank, r)
    zero3 = [results[rank]["dp2-zero3"]["generated"] for rank in (0, 1)]
    total = results[0]["dp2-zero3"]["total"]
    assert sum(zero3) == total and max(zero3) <= math.ceil(total / 2) + 64 * 20, zero3
