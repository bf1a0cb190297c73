"""Tensor and sequence parallelism: the operators, agreement with DTensor TP, the bytes on
the wire, GQA splits, vocabulary padding, tied embeddings, dropout, bad input.

(TP, TP × DP, TP × ZeRO-1/2/3 and TP × recomputation against one process over 3 steps are
rows of tests/test_layouts.py; the bit-exact resume of a TP layout is in tests/test_resume.py.)
"""

import pytest
import torch

from helpers import TINY, assert_proof, assert_states_close, proof_in_rank, reference_in_rank
from ndtrain.testing import run_ranks

# --- the conjugate operators ----------------------------------------------------------


def _operators():
    import torch.distributed as dist

    from ndtrain.mesh import MeshShape, ParallelMesh
    from ndtrain.parallel.tensor import CopyToTP, GatherSequence, ReduceFromTP, ReduceScatterSequence

    mesh = ParallelMesh.build(MeshShape(tp=2))
    group, r = mesh.group("tp"), dist.get_rank()
    out = {}
    # rank r's tensor: distinct values, so a wrong order or a missing sum shows
    x = (torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3) + 100 * r).requires_grad_()
    weight = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3) * (r + 1)
    for name, op in [("f", CopyToTP), ("g", ReduceFromTP), ("gather", GatherSequence), ("scatter", ReduceScatterSequence)]:
        x.grad = None
        inp = x * 1.0  # g reduces in place: hand it a non-leaf
        y = op.apply(inp, group)
        w = weight if y.shape == weight.shape else torch.cat([weight, weight], 1)[:, :y.shape[1]]
        (y * w).sum().backward()
        out[name] = (y.detach().clone(), x.grad.clone())
    return out


def test_operators_forward_and_backward():
    results = run_ranks(_operators, 2)
    xs = [torch.arange(24, dtype=torch.float32).view(2, 4, 3) + 100 * r for r in range(2)]
    ws = [torch.arange(24, dtype=torch.float32).view(2, 4, 3) * (r + 1) for r in range(2)]
    for r, out in enumerate(results):
        # f: identity forward, all-reduce backward
        y, gx = out["f"]
        assert torch.equal(y, xs[r]) and torch.equal(gx, ws[0] + ws[1])
        # g: all-reduce forward, identity backward
        y, gx = out["g"]
        assert torch.equal(y, xs[0] + xs[1]) and torch.equal(gx, ws[r])
        # all-gather along the sequence forward, reduce-scatter backward
        y, gx = out["gather"]
        assert torch.equal(y, torch.cat(xs, 1))
        full_w = [torch.cat([w, w], 1) for w in ws]
        assert torch.equal(gx, (full_w[0] + full_w[1])[:, 4 * r:4 * (r + 1)])
        # reduce-scatter along the sequence forward, all-gather backward
        y, gx = out["scatter"]
        assert torch.equal(y, (xs[0] + xs[1])[:, 2 * r:2 * (r + 1)])
        assert torch.equal(gx, torch.cat([ws[0][:, :2], ws[1][:, :2]], 1))


def _vocab_parallel_loss_with_a_padding_shard():
    """Vocabulary 5 over tp 4: two columns per rank, rank 2 holds id 4 and a padding column,
    rank 3 only padding (logits −inf, as VocabParallelHead makes them)."""
    import torch.distributed as dist

    from ndtrain.mesh import MeshShape, ParallelMesh
    from ndtrain.model.loss import IGNORE
    from ndtrain.parallel.tensor import vocab_parallel_cross_entropy

    group, r = ParallelMesh.build(MeshShape(tp=4)).group("tp"), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    full = torch.randn(6, 5, generator=g, dtype=torch.float64)
    targets = torch.tensor([0, 4, 2, IGNORE, 3, 1])
    padded = torch.cat([full, torch.full((6, 3), float("-inf"), dtype=torch.float64)], 1)
    local = padded[:, 2 * r:2 * r + 2].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, group)
    loss.sum().backward()
    return loss.detach(), local.grad


def test_vocab_parallel_loss_survives_a_shard_of_padding_only():
    """Issue 9: a rank whose vocabulary shard is all padding gathered its 'target logit' from
    a −inf column and multiplied it by 0: NaN for every token."""
    from ndtrain.model.loss import IGNORE
    g = torch.Generator().manual_seed(0)
    full = torch.randn(6, 5, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.tensor([0, 4, 2, IGNORE, 3, 1])
    ref = torch.nn.functional.cross_entropy(full, targets, ignore_index=IGNORE, reduction="none")
    ref.sum().backward()
    ref_grad = torch.cat([full.grad, torch.zeros(6, 3, dtype=torch.float64)], 1)
    for r, (loss, grad) in enumerate(run_ranks(_vocab_parallel_loss_with_a_padding_shard, 4)):
        assert torch.allclose(loss, ref.detach(), rtol=0, atol=1e-12), r
        assert torch.allclose(grad, ref_grad[:, 2 * r:2 * r + 2], rtol=0, atol=1e-12), r


# --- agreement with PyTorch's DTensor tensor parallelism --------------------------------


def _ours_vs_dtensor(data_dir):
    from torch.distributed.device_mesh import init_device_mesh

    from ndtrain.bench.tp import dtensor_loss_backward, dtensor_model
    from ndtrain.config import load_config, validate
    from ndtrain.data.batch import MicroBatch
    from ndtrain.data.loader import BatchLoader
    from ndtrain.data.prepare import PreparedData
    from ndtrain.mesh import MeshShape, ParallelMesh
    from ndtrain.parallel import tensor
    from ndtrain.parallel.parallelize import build

    data = PreparedData.open(data_dir)
    x, y = BatchLoader(data.stream("train"), 32, 4, 0).rows(0, 0, 4)
    n = float(y.numel())
    mesh = ParallelMesh.build(MeshShape(tp=2))
    tp_mesh = init_device_mesh("cpu", (2,))
    out = {}
    for sp in (True, False):
        cfg = validate(load_config(None, TINY + ["parallel.tp=2", f"parallel.sp={sp}"]), world=2)
        args = cfg.model_args(vocab_size=data.vocab_size)
        ours = build(args, mesh, cfg)
        loss = ours.forward_backward([MicroBatch(x, y)], n)
        grads = tensor.full_state(ours.model, {k: p.grad for k, p in ours.model.named_parameters()},
                                  mesh.group("tp"))
        with torch.no_grad():  # each rank holds only its half of the vocabulary's logits
            assert ours.model(x).shape == (*x.shape, args.vocab_size // 2)
        ref = dtensor_model(args, cfg.train.seed, torch.device("cpu"), tp_mesh, sp)
        ref_loss = dtensor_loss_backward(ref, x, y, n)
        # without SP the norms stay plain tensors (replicated, not DTensors)
        ref_grads = {k: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for k, p in ref.named_parameters()}
        out[sp] = (float(loss), float(ref_loss), grads, ref_grads)
    return out


def test_matches_dtensor_tensor_parallel(tiny_data):
    """Same weights, same batch: our TP (+SP) and DTensor's ColwiseParallel /
    RowwiseParallel / SequenceParallel / loss_parallel give the same loss and gradients."""
    for sp, (loss, ref_loss, grads, ref_grads) in run_ranks(_ours_vs_dtensor, 2, tiny_data)[0].items():
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (sp, loss, ref_loss)
        assert_states_close(grads, ref_grads, 1e-5)


# --- communication: bytes per layer over tp -----------------------------------------------


def _tp_bytes(data_dir):
    import torch.distributed as dist

    from ndtrain.config import load_config, validate
    from ndtrain.data.batch import MicroBatch
    from ndtrain.data.prepare import PreparedData
    from ndtrain.mesh import MeshShape, ParallelMesh
    from ndtrain.parallel.parallelize import build

    vocab = PreparedData.open(data_dir).vocab_size
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (2, 32), generator=g)
    out = {}
    for t in (2, 4):
        mesh = ParallelMesh.build(MeshShape(dp_shard=dist.get_world_size() // t, tp=t))
        for sp in (False, True):
            for layers in (1, 2):
                cfg = validate(load_config(None, TINY + [f"parallel.tp={t}", f"parallel.sp={sp}",
                                                         f"model.n_layers={layers}",
                                                         "model.n_kv_heads=4"]), world=dist.get_world_size())
                par = build(cfg.model_args(vocab_size=vocab), mesh, cfg)
                for m in (1, 2):  # micro-batches in the step
                    mesh.stats.reset()
                    par.forward_backward([MicroBatch(x, x)] * m, float(m * x.numel()))
                    par.grad_sync.zero_grad()
                    out[t, sp, layers, m] = mesh.stats.wire("tp")
    return out


def test_bytes_per_layer_match_the_formulas(tiny_data):
    """Per layer, in fp32 bytes (4 per element), b=2, s=32, h=64, m micro-batches of b×s:
    - plain TP (Narayanan et al. 2021): 4 all-reduces of b·s·h per micro-batch,
      8·b·s·h·(t−1)/t elements each;
    - with SP: 4 all-gathers + 4 reduce-scatters of b·s·h per micro-batch (the same
      8·b·s·h·(t−1)/t), plus, once per step whatever m is, the all-reduce of the two norm
      weights' partial gradients, 2 × 2·h·(t−1)/t.
    Outside the layers, per micro-batch: the embedding's exit and the head's entry
    (2·b·s·h·(t−1)/t times 2), and the loss's max and sums (3 all-reduced numbers per
    token: 6·b·s·(t−1)/t); with SP, once per step, the final norm weight's 2·h·(t−1)/t."""
    b, s, h, nbytes = 2, 32, 64, 4
    measured = run_ranks(_tp_bytes, 4, tiny_data)[0]
    for t in (2, 4):
        for sp in (False, True):
            for m in (1, 2):
                per_layer = measured[t, sp, 2, m] - measured[t, sp, 1, m]
                expected = m * 8 * b * s * h * (t - 1) / t + (4 * h * (t - 1) / t if sp else 0)
                assert per_layer == pytest.approx(expected * nbytes, rel=1e-12), (t, sp, m)
                outside = m * (4 * b * s * h + 6 * b * s) * (t - 1) / t + (2 * h * (t - 1) / t if sp else 0)
                assert measured[t, sp, 1, m] == pytest.approx((expected + outside) * nbytes, rel=1e-12), (t, sp, m)


# --- equivalence cases with their own single-process reference -------------------------

CASES = {
    # kv heads split two per rank; and one kv head replicated on every rank (MQA)
    "kv4": ["model.n_kv_heads=4"],
    "kv1": ["model.n_kv_heads=1"],
    # 515 tokens pad to 516 on 2 and 4 ranks; the padded head is the embedding
    "vocab515-tied": ["model.vocab_size=515", "model.tie_embeddings=true"],
    # the mask of every dropout equals one device's, with and without SP
    "dropout": ["model.dropout=0.1"],
}
TP_RUNS = {  # name: (case, extra overrides); on 2 ranks
    "kv4-tp2": ("kv4", ["parallel.tp=2"]),
    "kv1-tp2": ("kv1", ["parallel.tp=2"]),
    "vocab515-tied-tp2": ("vocab515-tied", ["parallel.tp=2"]),
    "vocab515-tied-tp2-nosp": ("vocab515-tied", ["parallel.tp=2", "parallel.sp=false"]),
    "dropout-tp2": ("dropout", ["parallel.tp=2"]),
    "dropout-tp2-nosp": ("dropout", ["parallel.tp=2", "parallel.sp=false"]),
}


def _summary(overrides, data_dir):
    """An fp64 proof run (tests/helpers.py), without its history."""
    proof = proof_in_rank(overrides, data_dir)
    proof.pop("history")
    return proof


def _references(data_dir):
    out = {name: reference_in_rank(ov, data_dir) for name, ov in CASES.items()}
    out["plain"] = _summary([], data_dir)
    for ref in out.values():
        ref.pop("history", None)
    return out


def _tp_runs(data_dir):
    out = {name: _summary(CASES[case] + extra, data_dir) for name, (case, extra) in TP_RUNS.items()}
    # negative control: f without its backward all-reduce
    from ndtrain.parallel.tensor import CopyToTP
    backward = CopyToTP.backward
    CopyToTP.backward = staticmethod(lambda ctx, grad: (grad, None))
    try:
        out["no-f-all-reduce"] = _summary(["parallel.tp=2", "parallel.sp=false"], data_dir)
    finally:
        CopyToTP.backward = backward
    return out


@pytest.fixture(scope="module")
def references(tiny_data):
    return run_ranks(_references, 1, tiny_data)[0]


def test_tp_cases_equal_one_process(tiny_data, references):
    """Each case, under tp 2, equals its own one-process reference under the fp64 proof rule
    (first update exact; later steps within the twin's gaps)."""
    results = run_ranks(_tp_runs, 2, tiny_data, timeout=600)
    for name, (case, _) in TP_RUNS.items():
        proof = results[0][name]
        try:
            assert_proof(proof, references[case])  # clipping counts each shard once: the norms
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
        assert results[1][name]["losses"] == proof["losses"], f"{name}: ranks report other losses"
    # the cases are not vacuous: dropout and the negative control change the result
    gaps = [abs(a - b) for a, b in zip(references["dropout"]["losses"], references["plain"]["losses"])]
    assert max(gaps) > 1e-3, gaps
    with pytest.raises(AssertionError):
        assert_states_close(results[0]["no-f-all-reduce"]["state"], references["plain"]["state"], 1e-3)


def test_padded_vocabulary_is_cut_from_the_full_state(references):
    state = references["vocab515-tied"]["state"]
    assert state["tok_embeddings.weight"].shape[0] == 515
    assert "output.weight" not in state  # tied: stored once


# --- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, fragment", [
    (["model.preset=tiny", "parallel.tp=8", "run.nproc=8"], "parallel.tp = 8: must be at most model.n_heads = 4"),
    (["model.preset=tiny", "model.n_heads=8", "model.n_kv_heads=2", "parallel.tp=3", "run.nproc=3"],
     "model.n_heads = 8: must be divisible by parallel.tp = 3"),
    (["model.preset=tiny", "parallel.tp=2", "train.seq_len=33", "run.nproc=2"],
     "train.seq_len = 33: must be divisible by parallel.tp = 2 with sequence parallelism"),
    (["model.preset=tiny", "model.ffn_dim=130", "parallel.tp=4", "run.nproc=4"],
     "model.ffn_dim = 130: must be divisible by parallel.tp = 4"),
])
def test_bad_tensor_parallel_input(overrides, fragment, tmp_path, capsys, monkeypatch):
    from ndtrain.cli import main
    from ndtrain.config import ConfigError, load_config, validate
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, overrides + ["run.device=cpu"]))
    assert fragment in str(e.value) and "\n" not in str(e.value)
    monkeypatch.chdir(tmp_path)
    assert main(["train"] + overrides + ["run.device=cpu", f"run.dir={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err.startswith("ndtrain: error: " + fragment.split(":")[0])
    assert list(tmp_path.iterdir()) == []


def test_sp_defaults_on_with_tp_and_seq_len_need_not_divide_without_it():
    from ndtrain.config import load_config, validate
    assert validate(load_config(None, ["parallel.tp=2", "run.nproc=2", "run.device=cpu"])).parallel.sp is True
    cfg = validate(load_config(None, ["model.preset=tiny", "parallel.tp=2", "parallel.sp=false",
                                      "train.seq_len=33", "run.nproc=2", "run.device=cpu"]))
    assert cfg.parallel.sp is False and cfg.parallel.tp == 2
