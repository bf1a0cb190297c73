"""gpt-oss's pieces (issue 35): attention sinks on one device and folded into context
parallelism's log-sum-exp merge, biased experts with the clamped SwiGLU, a biased router,
an output-projection bias; the preset under every layout family.

- Attention sinks: a softmax with one more logit per head and no value equals the explicit
  softmax over [scores, sink] (what transformers' GptOss eager attention computes), and
  under cp = 2 every back end (ring and all-gather fold the sink into the merged
  log-sum-exp; Ulysses gives each rank its heads' sinks) equals one device in fp64: output
  and dq, dk, dv, dsinks within 1e-10 of the reference's largest element, with a window
  and with packed documents.
- Layout proofs (tests/helpers.assert_proof, fp64, the tolerance rule) of the gpt-oss-tiny
  preset (sinks, q/k/v/o biases, alternating window, YaRN past its original context,
  biased router and experts, clamped SwiGLU): one row per layout family by default (dp2,
  ZeRO-3, tp2+sp, pp2 1F1B, cp2 ring, ep2); the other CP back ends, ZeRO-1/2, ZB,
  DualPipeV and 3-D compositions on 8 ranks in the slow tier.
"""

from __future__ import annotations

import math

import pytest
import torch

from ndtrain.testing import run_ranks

TOL = 1e-10
OSS = ["model.preset=gpt-oss-tiny", "train.steps=3"]


def _reference(q, k, v, sinks, window, docs):
    """Causal attention with sinks, fp64, written as transformers' GptOss eager attention:
    softmax over [scores, sink], the sink's column dropped. out [b, S, H·d]."""
    b, s, h, d = q.shape
    k, v = (t.repeat_interleave(h // k.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    pos = torch.arange(s)
    mask = (pos[:, None] >= pos[None, :]) & ((pos[:, None] - pos[None, :] < window) if window else True)
    mask = mask.expand(b, s, s)
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    logits = torch.cat([scores, sinks.view(1, h, 1, 1).expand(b, h, s, 1)], dim=-1)
    p = torch.softmax(logits, -1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v).flatten(2)


def test_plain_attention_with_sinks_is_the_softmax_with_an_extra_logit():
    from ndtrain.model.llama import plain_attention
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 10, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 10, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(4, generator=g, dtype=torch.float64) * 3
    got = plain_attention(*(t.transpose(1, 2) for t in (q, k, v)), None, 0.0, sinks).transpose(1, 2).flatten(2)
    torch.testing.assert_close(got, _reference(q, k, v, sinks, 0, None), rtol=0, atol=1e-14)
    # the sink takes weight away: without it the rows would differ
    assert not torch.allclose(got, _reference(q, k, v, sinks.new_full((4,), -1e9), 0, None))


def test_the_fused_sink_core_equals_the_plain_one_fp64():
    """parallel/context/sinks.py's core (the fused op, the sink folded into its log-sum-exp:
    what training runs without cp) equals the plain model's `plain_attention` (the
    reference, which materialises the scores) on gpt-oss-tiny in fp64: logits and every
    gradient, sinks' included, with packed documents and the alternating window."""
    from ndtrain.model.args import PRESETS
    from ndtrain.model.llama import Transformer
    from ndtrain.parallel.context import sinks
    args = PRESETS["gpt-oss-tiny"].with_(vocab_size=64, n_layers=2, window_layers=(0,))  # a windowed layer, a full one
    x = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    docs = (torch.arange(40) // 13)[None]
    runs = []
    for fused in (False, True):
        model = Transformer(args).double()
        model.init_weights(0)
        with torch.no_grad():
            for layer in model.layers.values():
                layer.attention.sinks.normal_(0, 1, generator=torch.Generator().manual_seed(1))
        if fused:
            assert sinks.apply(model) == args.n_layers
        logits = model(x, doc_ids=docs)
        (logits * logits.detach().sin()).sum().backward()
        runs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, plain_grads), (got, got_grads) = runs
    torch.testing.assert_close(got, plain, rtol=0, atol=1e-12)
    for name, g in plain_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=0, atol=1e-12 * max(1.0, float(g.abs().max())),
                                   msg=name)


def _sink_kernels_on_ranks():
    from ndtrain.mesh import MeshShape, ParallelMesh
    from ndtrain.parallel.context.allgather import AllGatherAttention
    from ndtrain.parallel.context.layout import zigzag_index
    from ndtrain.parallel.context.ring import RingAttention
    from ndtrain.parallel.context.ulysses import ulysses_attention
    from ndtrain.parallel.context.visibility import Visibility

    group = ParallelMesh.build(MeshShape(cp=2)).group("cp")
    cp, s, out = 2, 24, []
    for impl, fn in (("ring", RingAttention.apply), ("allgather", AllGatherAttention.apply),
                     ("ulysses", ulysses_attention)):
        for window, with_docs in ((0, False), (9, False), (0, True)):
            g = torch.Generator().manual_seed(window + with_docs)
            q = torch.randn(2, s, 4, 8, generator=g, dtype=torch.float64)
            k, v = (torch.randn(2, s, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
            sinks = torch.randn(4, generator=g, dtype=torch.float64) * 2
            w = torch.randn(2, s, 32, generator=g, dtype=torch.float64)
            docs = (torch.arange(s) // 10).expand(2, s).contiguous() if with_docs else None
            ref = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
            expected = _reference(*ref, window, docs)
            (expected * w).sum().backward()
            idx = zigzag_index(s, cp, group.rank)
            mine = [t[:, idx].clone().requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
            gathered = torch.stack([docs[:, zigzag_index(s, cp, r)] for r in range(cp)]) if with_docs else None
            got = fn(*mine[:3], group, Visibility(s, cp, group.rank, docs=gathered, window=window), None, "",
                     mine[3])
            (got * w[:, idx]).sum().backward()
            dsinks = mine[3].grad.clone()
            torch.distributed.all_reduce(dsinks, group=group.pg)  # the step sums over cp
            errors = [float((a.detach() - b.detach()[:, idx]).abs().max() / b.detach().abs().max())
                      for a, b in ((got, expected), *((m.grad, r.grad) for m, r in zip(mine[:3], ref[:3])))]
            errors.append(float((dsinks - ref[3].grad).abs().max() / ref[3].grad.abs().max()))
            out.append(((impl, window, with_docs), max(errors)))
    return out


def test_clamped_swiglu_and_biased_experts_equal_a_loop_over_experts():
    """The stacked, grouped experts with biases and the clamped SwiGLU equal transformers'
    GptOssExperts arithmetic written per token: gate_up = x·W + b, gate and up clamped,
    (up + 1)·gate·σ(1.702·gate), then the down projection and its bias."""
    from ndtrain.model.moe import Experts
    g = torch.Generator().manual_seed(1)
    n, dim, hidden, limit = 3, 6, 5, 0.7
    ex = Experts(n, dim, hidden, bias=True, limit=limit).double()
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    counts = torch.tensor([2, 0, 4])
    x = torch.randn(6, dim, generator=g, dtype=torch.float64)
    got = ex(x, counts)
    rows = []
    for i, e in enumerate([0, 0, 2, 2, 2, 2]):
        gate = (x[i] @ ex.w1[e].T + ex.w1_bias[e]).clamp(max=limit)
        up = (x[i] @ ex.w3[e].T + ex.w3_bias[e]).clamp(-limit, limit)
        rows.append(((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ ex.w2[e].T + ex.w2_bias[e])
    torch.testing.assert_close(got, torch.stack(rows), rtol=0, atol=1e-13)
    assert (got.abs() > 0).all()


# --------------------------------------------------------------------------- layout proofs

DEFAULT_ROWS = {
    "dp2": ["parallel.dp=2"],
    "zero3": ["parallel.zero=3"],
    "tp2-sp": ["parallel.tp=2"],
    "pp2-1f1b": ["parallel.pp=2", "train.micro_batch=4"],
    "cp2-ring": ["parallel.cp=2"],
    "ep2": ["parallel.ep=2"],
}
SLOW_ROWS = {
    "zero1": ["parallel.zero=1"],
    "zero2": ["parallel.zero=2"],
    "cp2-allgather": ["parallel.cp=2", "parallel.cp_impl=allgather"],
    "cp2-ulysses": ["parallel.cp=2", "parallel.cp_impl=ulysses"],
    "pp2-zb": ["parallel.pp=2", "parallel.pp_schedule=zb", "train.micro_batch=4"],
    "pp2-dualpipev": ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual=2", "train.micro_batch=2"],
}
ROWS_8 = {
    "tp2-pp2-dp2": ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "train.micro_batch=2"],
    "cp2-ep2-tp2": ["parallel.cp=2", "parallel.tp=2", "parallel.dp=2", "parallel.ep=2"],
    "zero3-cp2-tp2": ["parallel.zero=3", "parallel.dp=2", "parallel.cp=2", "parallel.tp=2"],
}


def _reference_run(data_dir):
    from helpers import reference_in_rank
    return reference_in_rank(OSS, data_dir)


def _cores(trainer):
    """Training runs the sinks on the fused ops: the sink core (cp = 1) or context
    parallelism's (which folds them itself), never the plain model's."""
    cores = {type(m).__name__ for n, m in trainer.par.model.named_modules() if n.endswith("attention.core")}
    expected = "ContextParallelAttention" if trainer.cfg.parallel.cp > 1 else "FusedSinkCore"
    assert cores == {expected}, f"attention cores {cores}, expected {expected}"


def _rows(data_dir, rows, kernels=False):
    """The proof runs of `rows`; with `kernels`, the sink kernels' cases first (one launch)."""
    from helpers import proof_in_rank
    out = {"kernels": _sink_kernels_on_ranks()} if kernels else {}
    return {**out, **{name: proof_in_rank(OSS + overrides, data_dir, before_fit=_cores)
                      for name, overrides in rows.items()}}


@pytest.fixture(scope="module")
def oss_reference(tiny_data):
    return run_ranks(_reference_run, 1, tiny_data)[0]


def _assert_rows(results, ref, rows):
    from helpers import assert_proof
    for name in rows:
        try:
            assert_proof(results[name], ref)
        except AssertionError as e:
            raise AssertionError(f"gpt-oss-tiny {name}: {e}") from None


def test_gpt_oss_under_every_layout_family_equals_one_process(tiny_data, oss_reference):
    """The sink kernels across cp = 2 (every rank's cases), then one row per layout family."""
    per_rank = run_ranks(_rows, 2, tiny_data, DEFAULT_ROWS, True, timeout=600)
    for rank, results in enumerate(per_rank):
        assert len(results["kernels"]) == 9
        for case, err in results["kernels"]:
            assert err <= TOL, f"sinks across cp = 2, rank {rank} {case}: differs by {err:.1e}"
    _assert_rows(per_rank[0], oss_reference, DEFAULT_ROWS)


@pytest.mark.slow
def test_gpt_oss_under_the_other_layouts_equals_one_process(tiny_data, oss_reference):
    results = run_ranks(_rows, 2, tiny_data, SLOW_ROWS, timeout=900)[0]
    _assert_rows(results, oss_reference, SLOW_ROWS)


@pytest.mark.slow
def test_gpt_oss_in_3d_compositions_equals_one_process(tiny_data, oss_reference):
    results = run_ranks(_rows, 8, tiny_data, ROWS_8, timeout=900)[0]
    _assert_rows(results, oss_reference, ROWS_8)


# --------------------------------------------------------------------------- planner, bad input

@pytest.mark.parametrize("preset, total, active", [("gpt-oss-20b", 20.91, 3.61), ("gpt-oss-120b", 116.83, 5.13)])
def test_plan_gives_the_published_parameter_counts(capsys, preset, total, active):
    """OpenAI's model card (2025): 20.91 B and 116.83 B parameters, 3.61 B and 5.13 B active
    per token without the input embedding (a lookup)."""
    import json

    from ndtrain.cli import main
    code = main(["plan", "--cluster", "H100", "--gpus", "64", "--json", f"model.preset={preset}", "parallel.ep=8",
                 "parallel.zero=3", "train.precision=bf16", "train.seq_len=4096", "train.global_batch=64",
                 "train.micro_batch=1"])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0
    embedding = plan["model"]["vocab_size"] * plan["model"]["dim"]
    assert abs(plan["params"] / 1e9 - total) < 0.005
    assert abs((plan["active_params"] - embedding) / 1e9 - active) < 0.005


@pytest.mark.slow
def test_planned_memory_of_gpt_oss_matches_the_dry_run():
    """The planner's parameter count per rank (exact), states and peak (5%) against the
    engine's dry run (tests/test_plan_memory.py's rule), experts split over ep and heads
    (and their sinks) over tp."""
    from test_plan_memory import _check_rows
    _check_rows(2, [("gpt-oss-tiny-ep2", ["model.preset=gpt-oss-tiny", "parallel.ep=2"]),
                    ("gpt-oss-tiny-tp2", ["model.preset=gpt-oss-tiny", "parallel.tp=2"])])


@pytest.mark.parametrize("overrides, fragment", [
    (["model.moe_swiglu_limit=-1"], "model.moe_swiglu_limit = -1.0: must be >= 0"),
    (["model.preset=tiny", "model.moe_router_bias=true"], "model.moe_router_bias = True: model.preset = 'tiny' is "
                                                          "a dense model"),
    (["model.preset=tiny", "model.moe_swiglu_limit=7"], "model.moe_swiglu_limit = 7.0: model.preset = 'tiny' is a dense"),
])
def test_bad_gpt_oss_keys(overrides, fragment):
    from ndtrain.config import ConfigError, load_config, validate
    cfg = load_config(None, ["model.preset=gpt-oss-tiny", "run.device=cpu", "train.seq_len=32", *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, world=1)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_dry_run_of_the_big_presets_says_what_they_need_and_points_at_plan(capsys):
    """`train --dry-run` builds the model: gpt-oss-20b and 120b do not fit this machine, and
    it says so in one line before building anything (`ndtrain plan` plans them)."""
    from ndtrain.cli import main
    for preset in ("gpt-oss-20b", "gpt-oss-120b"):
        assert main(["train", "--dry-run", f"model.preset={preset}", "run.device=cpu", "model.vocab_size=201088",
                     "train.seq_len=128"]) == 2
        err = capsys.readouterr().err
        assert "the model states alone" in err and "ndtrain plan --search" in err and err.count("\n") == 1, err
