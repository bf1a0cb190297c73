"""Sliding windows, rotary scalings and Gemma 2's pieces under every layout (issue 22).

- Context-parallel attention with a window: each back end (ring, all-gather, Ulysses) on
  cp = 2 ranks in fp64 against one device's windowed attention, with and without packed
  documents, for a window shorter than a zigzag chunk of 6 and one between one and two
  chunks (blocks cut by the mask):
  output and dq, dk, dv within 1e-10 of the reference's largest element. The ring skips
  exactly the blocks whose pairs all lie a window or more apart.
- Layout proofs (tests/helpers.assert_proof, fp64): a model with a window on two of its
  four layers and llama3 scaling past its original context of 16, under CP (every back
  end, packed documents) and TP/PP; a Gemma-2-shaped model (offset and sandwich norms,
  GeGLU, embedding scale, query scalar, soft-capped scores and logits, alternating window,
  dynamic scaling past its original context) under TP with SP, PP and ZeRO-3.
"""

from __future__ import annotations

import math

import pytest
import torch

from ndtrain.testing import run_ranks

TOL = 1e-10
LLAMA3 = '{"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, ' \
         '"original_max_position_embeddings": 16}'
WINDOWED = ["model.sliding_window=12", "model.window_layers=1,3", f"model.rope_scaling={LLAMA3}"]
GEMMA = ["model.norm_offset=1.0", "model.sandwich_norm=true", "model.mlp_act=gelu_tanh", "model.embed_scale=8.0",
         "model.query_pre_attn_scalar=24", "model.attn_softcap=3.0", "model.logit_softcap=5.0",
         "model.sliding_window=12", "model.window_layers=0,2", "model.tie_embeddings=true",
         'model.rope_scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}']


def _reference(q, k, v, window, docs):
    """Causal attention with a window on one device, fp64 plain math: out [b, S, H·d]."""
    b, s, h, d = q.shape
    k, v = (t.repeat_interleave(h // k.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    pos = torch.arange(s)
    mask = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < window)
    mask = mask.expand(b, s, s)
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])
    p = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), -1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v).flatten(2)


def _windowed_kernels_on_ranks():
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
        for window in (4, 9):
            for with_docs in (False, True):
                g = torch.Generator().manual_seed(window)
                q = torch.randn(2, s, 4, 8, generator=g, dtype=torch.float64)
                k, v = (torch.randn(2, s, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
                w = torch.randn(2, s, 32, generator=g, dtype=torch.float64)
                docs = (torch.arange(s) // 10).expand(2, s).contiguous() if with_docs else None
                ref = [t.clone().requires_grad_() for t in (q, k, v)]
                expected = _reference(*ref, window, docs)
                (expected * w).sum().backward()
                idx = zigzag_index(s, cp, group.rank)
                mine = [t[:, idx].clone().requires_grad_() for t in (q, k, v)]
                gathered = torch.stack([docs[:, zigzag_index(s, cp, r)] for r in range(cp)]) if with_docs else None
                got = fn(*mine, group, Visibility(s, cp, group.rank, docs=gathered, window=window))
                (got * w[:, idx]).sum().backward()
                errors = [float((a.detach() - b.detach()[:, idx]).abs().max() / b.detach().abs().max())
                          for a, b in ((got, expected), *((m.grad, r.grad) for m, r in zip(mine, ref)))]
                out.append(((impl, window, with_docs), max(errors)))
    return out


def test_windowed_attention_across_ranks_equals_one_device_fp64():
    per_rank = run_ranks(_windowed_kernels_on_ranks, 2)
    for rank, results in enumerate(per_rank):
        assert len(results) == 12
        for case, err in results:
            assert err <= TOL, f"rank {rank} {case}: differs by {err:.1e}"


@pytest.mark.parametrize("cp", [2, 4])
def test_the_ring_skips_exactly_the_blocks_beyond_the_window(cp):
    """Every visible (query, key) pair with a window is computed once over the ring; a block
    is skipped when none of its pairs is visible."""
    from ndtrain.parallel.context.visibility import Visibility
    s = 2 * cp * 6
    for window in (3, 6, 7, 13, 100):
        pairs, skipped = 0, 0
        for r in range(cp):
            vis = Visibility(s, cp, r, window=window)
            for src in range(cp):
                block = vis.ring_block(src)
                q, k = vis.index[r][:, None], vis.index[src][None, :]
                visible = int(((q >= k) & (q - k < window)).sum())
                assert (block is None) == (visible == 0), (window, r, src)
                if block is None:
                    skipped += 1
                    continue
                n = (block.rows.stop - block.rows.start) * (block.cols.stop - block.cols.start)
                shown = block.explicit("cpu")  # the mask, or the causal square spelled out
                counted = n if shown is None else int(shown.sum())
                assert counted == visible, (window, r, src)
                pairs += counted
        assert pairs == sum(min(i + 1, window) for i in range(s)), window
        if cp == 4 and window <= 6:  # ranks two apart hold no chunks within a window of each other
            assert skipped > 0, window


# --------------------------------------------------------------------------- layout proofs

STEPS = ["train.steps=3"]
LAYOUTS = [  # (name, model, overrides, reference)
    *((f"windowed-cp2-{impl}", WINDOWED, ["parallel.cp=2", f"parallel.cp_impl={impl}"], "windowed")
      for impl in ("ring", "allgather", "ulysses")),
    ("windowed-cp2-ring-packed", WINDOWED, ["parallel.cp=2"], "windowed-packed"),
    ("windowed-cp2-ulysses-packed", WINDOWED, ["parallel.cp=2", "parallel.cp_impl=ulysses"], "windowed-packed"),
    ("windowed-tp2", WINDOWED, ["parallel.tp=2"], "windowed"),
    ("gemma-tp2-sp", GEMMA, ["parallel.tp=2"], "gemma"),
    ("gemma-pp2", GEMMA, ["parallel.pp=2", "train.micro_batch=4"], "gemma"),
    ("gemma-zero3", GEMMA, ["parallel.zero=3"], "gemma"),
]
REFERENCES = {"windowed": (WINDOWED, False), "windowed-packed": (WINDOWED, True), "gemma": (GEMMA, False)}


def _packing(packed: bool):
    from test_cp import packed_documents
    return packed_documents if packed else None


def _references(data_dir):
    """Each reference with its twin (tests/helpers.reference_in_rank: the tolerance rule)."""
    from helpers import reference_in_rank
    return {name: reference_in_rank(STEPS + model, data_dir, before_fit=_packing(packed))
            for name, (model, packed) in REFERENCES.items()}


def _layouts(data_dir):
    from helpers import proof_in_rank
    return {name: proof_in_rank(STEPS + model + overrides, data_dir, before_fit=_packing(REFERENCES[ref][1]))
            for name, model, overrides, ref in LAYOUTS}


def test_family_features_under_every_layout_equal_one_process(tiny_data):
    from helpers import assert_proof
    refs = run_ranks(_references, 1, tiny_data)[0]
    results = run_ranks(_layouts, 2, tiny_data, timeout=600)[0]
    for name, _, _, ref in LAYOUTS:
        try:
            assert_proof(results[name], refs[ref])
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    # the window and the packing change what is computed (else the proofs would prove less)
    assert refs["windowed"]["losses"][0] != refs["windowed-packed"]["losses"][0]


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("overrides, fragment", [
    (["model.rope_scaling={nope"], "model.rope_scaling = '{nope': is not JSON"),
    (['model.rope_scaling={"rope_type": "ntk"}'], "rope_type 'ntk' is not supported; known: default, linear"),
    (['model.rope_scaling={"rope_type": "llama3", "factor": 8}'],
     "rope_type 'llama3' needs low_freq_factor, high_freq_factor, original_max_position_embeddings"),
    (['model.rope_scaling={"rope_type": "linear", "factor": 0.5}'], "factor must be >= 1, not 0.5"),
    (["model.sliding_window=-1"], "model.sliding_window = -1: must be >= 0"),
    (["model.window_layers=1;2"], "model.window_layers = '1;2': expected layer indices separated by commas"),
    (["model.sliding_window=8", "model.window_layers=1,7"], "model.window_layers = '1,7': layer 7 is not one of "
                                                           "the model's 4"),
    (["model.mlp_act=relu"], "model.mlp_act = 'relu': choose one of silu, gelu_tanh"),
    (["model.embed_scale=0"], "model.embed_scale = 0.0: must be > 0"),
    (["model.attn_softcap=50", "parallel.cp=2"], "parallel.cp = 2: model.attn_softcap = 50.0 (Gemma 2) caps "
                                                 "attention scores inside the kernel"),
    (['model.rope_scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}',
      "parallel.cp=2"], "parallel.cp = 2: dynamic rotary scaling picks its frequencies from the longest position"),
    (['model.rope_scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}',
      "parallel.cp=2"], None),  # sequences within the original context: the default angles on every rank
])
def test_bad_family_keys(overrides, fragment):
    from ndtrain.config import ConfigError, load_config, validate
    cfg = load_config(None, ["model.preset=tiny", "run.device=cpu", "train.seq_len=32", *overrides])
    world = cfg.parallel.cp
    if fragment is None:
        validate(cfg, world=world)
        return
    with pytest.raises(ConfigError) as e:
        validate(cfg, world=world)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)
