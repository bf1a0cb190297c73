"""RL's generation layout: the weights moved from any training layout into the generation
layout (rl.generate_tp) equal the trainer's bit for bit in fp64, and so do the
log-probabilities they give; the sampler reads the host once per step; an RL step's memory
at a 128k vocabulary stays bounded; an MoE model's rollout routes every token as its update
does."""

from __future__ import annotations

import pytest
import torch

from helpers import TINY
from ndtrain.testing import run_ranks


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py's: one torch thread here


class _Stub:
    """Just enough of a task for a Trainer that never steps."""

    vocab_size, baseline = 61, None

    @staticmethod
    def objective(nll, mb):
        return nll.sum()


def _rows(n: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    completions = [torch.randint(0, vocab, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(n)]
    return prompts, completions


def _sync_cases(cases):
    """For each (name, overrides): a trainer in fp64 (its routers' biases set apart from 0),
    then the generator's weights and log-probabilities of fixed rows, and the same from a
    one-process model holding the trainer's whole weights (on rank 0)."""
    from ndtrain.config import load_config, validate
    from ndtrain.mesh import ParallelMesh
    from ndtrain.model.llama import Transformer
    from ndtrain.parallel import tensor
    from ndtrain.parallel.expert import moe_blocks
    from ndtrain.parallel.generation import GenerationLayout, Generator
    from ndtrain.parallel.states import load_unique_state, persistent_buffers
    from ndtrain.train.rl.rollout import completion_logprobs
    from ndtrain.train.trainer import Trainer
    from ndtrain.train.worker import mesh_shape

    out = {}
    for name, overrides in cases:
        cfg = validate(load_config(None, TINY + ["train.precision=fp64", "train.micro_batch=2"] + overrides), world=2)
        mesh = ParallelMesh.build(mesh_shape(cfg))
        trainer = Trainer(cfg, mesh, _Stub(), None)
        for _, moe in moe_blocks(trainer.par.model):
            moe.router.expert_bias.copy_(torch.arange(moe.n_experts, dtype=torch.float32) * 0.01)
        gen = Generator(trainer.par, cfg, trainer.args, GenerationLayout(mesh, cfg))
        model = gen.model()
        copy = model.model if hasattr(model, "group") else model
        state = {**dict(copy.named_parameters()), **persistent_buffers(copy)}
        mine = tensor.full_state(copy, {k: v.detach() for k, v in state.items()}, gen.layout.tp)
        full = trainer.par.full_model_state()
        prompts, completions = _rows(6, trainer.args.vocab_size, 0)
        logp = completion_logprobs(model, prompts, completions, 5, 0, 4)
        trained = _trainer_logprobs(trainer, prompts, completions, 5)
        if mesh.rank == 0:
            ref = Transformer(trainer.args).double()
            load_unique_state(ref, full)
            ref_logp = completion_logprobs(ref, prompts, completions, 5, 0, 4)
            out[name] = {"names": sorted(full) == sorted(mine),
                         "weights_equal": all(torch.equal(mine[k], full[k]) for k in full),
                         "logp_equal": torch.equal(logp, ref_logp), "logp_gap": float((logp - ref_logp).abs().max()),
                         "trainer_equal": torch.equal(logp, trained), "trainer_gap": float((logp - trained).abs().max()),
                         "bytes": gen.transfer.bytes, "copied": gen.copy is not None}
    return out


def _trainer_logprobs(trainer, prompts, completions, width: int):
    """The same log-probabilities from the training layout's own forward (Trainer.logprobs,
    what RL takes as the old policy's), [n, width]."""
    from ndtrain.data.batch import IGNORE, MicroBatch
    s = trainer.cfg.train.seq_len
    tokens = torch.zeros((len(prompts), s), dtype=torch.long)
    targets = torch.full((len(prompts), s), IGNORE, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        tokens[i, :len(p) + len(c)] = torch.tensor(p + c)
        targets[i, len(p) - 1:len(p) - 1 + len(c)] = torch.tensor(c)
    full = trainer.logprobs(MicroBatch(tokens, targets)).double().cpu()
    out = torch.zeros((len(prompts), width), dtype=torch.float64)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        out[i, :len(c)] = full[i, len(p) - 1:len(p) - 1 + len(c)]
    return out


# (name, training layout, rl.generate_tp); every one on 2 processes. The default tier runs
# one of each kind of move; the slow tier the rest.
SYNC = [("zero3>tp2", ["parallel.zero=3"], 2), ("pp2>1", ["parallel.pp=2"], 1), ("tp2>1", ["parallel.tp=2"], 1),
        ("dp2>dp2", ["parallel.dp=2"], 1),
        ("moe-zero3-ep2>tp2", ["model.preset=tiny-moe", "parallel.zero=3", "parallel.ep=2"], 2)]
SYNC_MORE = [("zero3>1", ["parallel.zero=3"], 1), ("pp2>tp2", ["parallel.pp=2"], 2),
             ("tp2-sp>tp2", ["parallel.tp=2", "parallel.sp=true"], 2), ("dp2>tp2", ["parallel.dp=2"], 2),
             ("moe-ep2>1", ["model.preset=tiny-moe", "parallel.dp=2", "parallel.ep=2"], 1),
             ("moe-tp2>tp2", ["model.preset=tiny-moe", "parallel.tp=2"], 2)]


def _check_sync(rows):
    """Whatever the training layout (ZeRO-3, pipeline, tensor parallelism with or without
    SP, plain DP, experts split over ep) and whatever the generation's tensor parallelism,
    the generator holds the trainer's weights and routers' biases bit for bit; its
    log-probabilities (device cross-entropy, as the trainer computes them) equal a
    one-process model's on the trainer's whole weights bit for bit where generation is not
    tensor-parallel, and to 1e-12 where it is (its matmuls add the heads' shares in another
    order). Against the training layout's own forward (rows padded to train.seq_len, in
    micro-batches: other shapes, other rounding) they agree to 1e-12 (measured: 1e-15)."""
    cases = [(name, overrides + [f"rl.generate_tp={g}"]) for name, overrides, g in rows]
    runs = run_ranks(_sync_cases, 2, cases, timeout=300)[0]
    for name, _, g in rows:
        run = runs[name]
        assert run["names"] and run["weights_equal"], (name, run)
        if g == 1:
            assert run["logp_equal"], (name, run)
        assert run["logp_gap"] < 1e-12 and run["trainer_gap"] < 1e-12, (name, run)
        assert run["copied"] == (name != "dp2>dp2"), (name, run)  # DP generates with the training model itself
        moved = any(k in name for k in ("zero3", "pp2", "ep2", "tp2>1"))  # collectives carried weights
        assert (run["bytes"] > 0) == moved, (name, run)


def test_generation_weights_and_log_probabilities_equal_the_trainers_bitwise_in_fp64():
    _check_sync(SYNC)


@pytest.mark.slow
def test_generation_weights_equal_the_trainers_in_more_layouts():
    _check_sync(SYNC_MORE)


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the reads of a tensor's value by the host (`.item()`, `bool()`, `int()`,
    `float()`: aten._local_scalar_dense) and copies between devices."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_the_sampler_reads_the_host_once_per_step():
    """A batch of rows sampled for 8 steps costs the host one read per step but the last
    (whether any row still runs: 7), not one per row per token; the results come back
    once, at the end (`.tolist()`, which reads no scalar)."""
    from ndtrain.generate.sampler import generate
    from ndtrain.model.args import PRESETS
    from ndtrain.model.llama import Transformer
    model = Transformer(PRESETS["tiny"].with_(vocab_size=40, max_seq_len=64))
    model.init_weights(3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
    for temperature in (1.0, 0.0):
        with _HostReads() as reads:
            out = generate(model, prompts, 8, temperature, seeds=[1, 2, 3, 4], stop_ids=[39])
        assert max(len(t) for t in out.tokens) == 8 and reads.reads == 7, (temperature, reads.reads)


def test_an_rl_step_at_a_128k_vocabulary_holds_memory_independent_of_its_rows(monkeypatch):
    """An RL step (rollout with the reference's log-probabilities, the old policy's, the
    update) on a small model with a 131,072-token vocabulary: the host memory it allocates
    at its peak (the CPU meter, observe/memory.py) is the same for 8 rows as for 2, and
    within what the step must hold whatever its rows: the model states (weights, gradients,
    two AdamW moments), the frozen reference's weights, the sampler's batch
    (rollout.SAMPLE_BYTES, here 8 MiB: 2 rows at this vocabulary) and a micro-batch's
    logits a few times over (forward, softmax, their gradients: 4). The reference
    log-probabilities used to build an fp64 [rows, length, vocabulary] table on the host."""
    from ndtrain.config import load_config, validate
    from ndtrain.data.template import BuiltinTemplate
    from ndtrain.data.verifiable import char_tokenizer
    from ndtrain.mesh import ParallelMesh
    from ndtrain.observe.memory import measure_peak
    from ndtrain.train.rl import rollout
    from ndtrain.train.rl.task import RL, Environment
    from ndtrain.train.trainer import Trainer
    from ndtrain.train.worker import mesh_shape
    monkeypatch.setattr(rollout, "SAMPLE_BYTES", 2**23)
    vocab, micro, seq, peaks = 131072, 2, 16, {}
    for rows in (2, 8):
        cfg = validate(load_config(None, TINY + [
            "model.dim=16", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=32", "model.n_layers=1",
            f"model.vocab_size={vocab}", f"train.global_batch={rows}", "rl.group_size=2", f"train.seq_len={seq}",
            f"train.micro_batch={micro}", "rl.max_new_tokens=4", "rl.eval_prompts=0", "rl.kl_coef=0.05",
            "train.steps=1"]), world=1)
        task = RL(cfg, Environment(cfg, BuiltinTemplate(char_tokenizer())))
        trainer = Trainer(cfg, ParallelMesh.build(mesh_shape(cfg)), task, None)
        trainer.meter_steps = 0
        with measure_peak(trainer.mesh.device) as step:
            trainer.train_step(0)
        peaks[rows] = step["bytes"]
    weights = sum(p.numel() * p.element_size() for p in trainer.par.model.parameters())
    bound = 5 * weights + rollout.SAMPLE_BYTES + 4 * micro * seq * vocab * 4
    assert abs(peaks[8] - peaks[2]) < 2**20 and max(peaks.values()) < bound, (peaks, bound)


# ----------------------------------------------------------------------------- MoE


def test_moe_rollouts_route_every_token_as_the_update_does():
    """A mixture-of-experts policy (tiny-moe, fp32): the experts the sampler's forwards
    choose for each sampled token's input (a prefill, then one token at a time with the KV
    cache) are those the training forward (whole rows) chooses for it, in every block, so
    the two log-probabilities agree to fp32 rounding."""
    from ndtrain.generate.sampler import generate
    from ndtrain.model.args import PRESETS
    from ndtrain.model.llama import Transformer
    from ndtrain.model.moe import Router
    from ndtrain.train.rl.rollout import completion_logprobs
    model = Transformer(PRESETS["tiny-moe"].with_(vocab_size=40, max_seq_len=64))
    model.init_weights(5)
    calls: list[list] = []  # per forward: each block's chosen experts [tokens, k]

    def hook(module, inputs, routes):
        calls[-1].append(routes.experts.clone())
    for m in model.modules():
        if isinstance(m, Router):
            m.register_forward_hook(hook)
    forward = model.forward

    def recorded(*args, **kwargs):
        calls.append([])
        return forward(*args, **kwargs)
    model.forward = recorded
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
    out = generate(model, prompts, 6, 1.0, seeds=[1, 2, 3, 4], stop_ids=[39])
    sampled, width = calls, max(len(p) for p in prompts)
    calls = []
    logp = completion_logprobs(model, prompts, out.tokens, 6, 0, 4)
    (trained,) = calls
    length = max(len(p) + len(c) for p, c in zip(prompts, out.tokens))
    compared = 0
    for i, (p, c) in enumerate(zip(prompts, out.tokens)):
        for t in range(len(c)):  # token t is read after the input at position len(p) - 1 + t
            for block in range(len(trained)):
                if t == 0:  # the prompt's last token, in the (left-padded) prefill
                    rollout = sampled[0][block].view(len(prompts), width, -1)[i, -1]
                else:
                    rollout = sampled[t][block].view(len(prompts), -1)[i]
                update = trained[block].view(len(prompts), length, -1)[i, len(p) - 1 + t]
                assert torch.equal(rollout, update), (i, t, block)
                compared += 1
    assert compared > 40
    gap = max(abs(a - float(b)) for row, lp in zip(out.logprobs, logp) for a, b in zip(row, lp))
    assert gap < 1e-5, gap


MOE_PROOF = ["model.preset=tiny-moe", "train.steps=2"]  # with test_rl's RL_PROOF: one grpo rollout, two updates
MOE_LAYOUTS = {"zero3-ep2": ["parallel.zero=3", "parallel.ep=2", "train.micro_batch=2"], "tp2": ["parallel.tp=2"]}


@pytest.mark.parametrize("name", [
    "zero3-ep2", pytest.param("tp2", marks=pytest.mark.slow)])
def test_moe_rl_equals_one_process_in_fp64(name):
    """RL on a mixture of experts: a seeded rollout and two updates on it (grpo with a KL
    term; the second with ratios ≠ 1) under expert parallelism with ZeRO-3 (the generator a
    copy with every expert gathered) or tensor parallelism (the experts whole on each tp
    rank, the copy routing every token) equal one process's, with the shared proof
    tolerances; the sampler's and the update's log-probabilities agree to 1e-10, so every
    token was routed alike, and each update's routing statistics (tokens per expert) equal
    one process's."""
    from helpers import assert_proof
    from test_rl import _rl_rows
    ref = run_ranks(_rl_rows, 1, [("single", MOE_PROOF, "reference")], timeout=300)[0]["single"]
    run = run_ranks(_rl_rows, 2, [(name, MOE_PROOF + MOE_LAYOUTS[name], "proof")], timeout=600)[0][name]
    assert [m["reward_mean"] for m in run["metrics"]] == [m["reward_mean"] for m in ref["metrics"]]
    assert max(m["logprob_gap"] for m in run["metrics"][::2]) < 1e-10
    loads = [m["moe"]["tokens_per_expert"] for m in run["metrics"]]  # each update's routing, as one process's
    assert loads == [m["moe"]["tokens_per_expert"] for m in ref["metrics"]] and all(loads)
    assert_proof(run, ref)
