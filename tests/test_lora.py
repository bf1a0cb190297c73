"""LoRA (model/lora.py): the frozen base holds no gradient, buffer or optimizer state in any
layout, every layout trains the adapters exactly as one process does (fp64 proofs), and the
export (merged weights, a PEFT adapter folder) gives the logits our model gives.

The proofs start from `lora.init=random`: with B = 0 (the default) the first step's gradient
of every A is exactly zero, so a layout that lost or double-counted A's gradient would still
pass the first-update comparison. The control below shows a defect of exactly that kind (A
of a column-parallel layer not summed over tp) failing the proof with B drawn.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import GRAD_TOL, TINY, assert_proof, proof_in_rank, reference_in_rank, tensor_gap, train_in_rank
from ndtrain.testing import run_ranks

LORA = ["lora.rank=4", "lora.alpha=8", "lora.init=random"]
MOE = ["model.preset=tiny-moe", "train.moe_aux_loss=0.01"]
SMALL = ["model.preset=small"]
REFERENCES = {"tiny": [], "moe": MOE, "small": SMALL}

# (name, overrides, reference): each row against the one-process run of its reference. The
# default tier keeps one row of every family; "slow" adds ZeRO-1, EP (an MoE model's attention
# adapters; alone and with ZeRO-3), PP with the small model's tied embedding, and "four" the
# 4-rank compositions.
ROWS = {
    "default": [("dp2-accumulation", ["parallel.dp=2", "train.micro_batch=1"], "tiny"),
                ("zero2-accumulation", ["parallel.zero=2", "train.micro_batch=2"], "tiny"),
                ("zero3-accumulation", ["parallel.zero=3", "train.micro_batch=2"], "tiny"),
                ("tp2-sp", ["parallel.tp=2"], "tiny"),
                ("tp2", ["parallel.tp=2", "parallel.sp=false"], "tiny"),
                ("pp2-1f1b", ["parallel.pp=2", "parallel.pp_schedule=1f1b", "train.micro_batch=2"], "tiny"),
                ("cp2-ring", ["parallel.cp=2", "parallel.cp_impl=ring"], "tiny")],
    "slow": [("zero1", ["parallel.zero=1"], "tiny"),
             ("ep2-moe", ["parallel.ep=2", *MOE], "moe"),
             ("ep2-zero3-moe", ["parallel.ep=2", "parallel.zero=3", "train.micro_batch=2", *MOE], "moe"),
             # the default job's shape: a frozen tied embedding held on both ends of the pipeline
             ("pp2-small-tied", ["parallel.pp=2", "train.micro_batch=2", *SMALL], "small")],
    "four": [("tp4-replicated-kv-heads", ["parallel.tp=4"], "tiny"),
             ("tp2-dp2-zero3", ["parallel.tp=2", "parallel.zero=3"], "tiny"),
             ("pp2-dp2-zero3-zb", ["parallel.pp=2", "parallel.pp_schedule=zb", "parallel.zero=3",
                                   "train.micro_batch=2"], "tiny"),
             ("zero3-recompute-full", ["parallel.zero=3", "train.recompute=full", "train.micro_batch=1"], "tiny"),
             ("hsdp2x2-zero2", ["parallel.zero=2", "parallel.dp_replicate=2"], "tiny"),
             ("pp2-cp2-ep2-moe", ["parallel.pp=2", "parallel.cp=2", "parallel.ep=2", "train.micro_batch=2", *MOE],
              "moe")],
}


def _reference(data_dir, overrides):
    return reference_in_rank(LORA + overrides, data_dir)


def _unsummed_column_a():
    """The defect of the control: a column-parallel layer's A whole on every rank but its
    gradient left unsummed over tp (no partial mark)."""
    from ndtrain.parallel import tensor
    original = tensor._adapter

    def defect(m, c, a_dim, b_dim):
        lora = original(m, c, a_dim, b_dim)
        if lora is not None and a_dim is None and b_dim == 0:
            lora.a.__dict__.pop("_ndtrain_partial_dims", None)
        return lora
    tensor._adapter = defect
    return original


def _layouts(data_dir, rows, control: bool):
    out = {name: proof_in_rank(LORA + o, data_dir) for name, o, _ in rows}
    if control:
        from ndtrain.parallel import tensor
        original = _unsummed_column_a()
        try:
            out["control"] = proof_in_rank(LORA + ["parallel.tp=2", "parallel.sp=false"], data_dir)
        finally:
            tensor._adapter = original
    return out


@pytest.fixture(scope="module")
def references(tiny_data):
    return {"tiny": run_ranks(_reference, 1, tiny_data, [])[0]}


def _check(tier, world, tiny_data, references, control=False):
    rows = ROWS[tier]
    for ref in {ref for _, _, ref in rows} - set(references):
        references[ref] = run_ranks(_reference, 1, tiny_data, REFERENCES[ref])[0]
    proofs = run_ranks(_layouts, world, tiny_data, rows, control, timeout=900)[0]
    for name, _, ref in rows:
        try:
            assert_proof(proofs[name], references[ref])
        except AssertionError as e:
            raise AssertionError(f"layout {name} (fp64, LoRA): {e}") from None
    return proofs


def test_lora_layouts_equal_one_process_in_fp64(tiny_data, references):
    """DP, ZeRO-2/3, TP (column: B split; row: A split), PP and CP each equal one process;
    and the control: A's tp sum left out fails."""
    proofs = _check("default", 2, tiny_data, references, control=True)
    ref = references["tiny"]
    assert set(proofs["dp2-accumulation"]["grads"]) == {k for k in ref["state"] if k.endswith((".lora.a", ".lora.b"))}
    assert all(ref["grads"][k].abs().max() > 0 for k in ref["grads"]), "every adapter has a gradient at step 1"
    control = proofs["control"]
    with pytest.raises(AssertionError, match="step 1 loss|first-step gradient"):
        assert_proof(control, ref)
    for name in ref["grads"]:  # the defect shows in exactly the gradients it touches, far above 1e-10
        gap = tensor_gap({name: control["grads"][name]}, {name: ref["grads"][name]})
        column_a = name.endswith(".lora.a") and name.split(".")[-3] in ("wq", "wk", "wv", "w1", "w3")
        assert gap > 1e-3 if column_a else gap <= GRAD_TOL, (name, gap)


@pytest.mark.slow
def test_lora_layouts_equal_one_process_zero1_and_ep(tiny_data, references):
    _check("slow", 2, tiny_data, references)


@pytest.mark.slow
def test_lora_layouts_equal_one_process_on_four_ranks(tiny_data, references):
    _check("four", 4, tiny_data, references)


# -- frozen base: no gradients, no buffers, no optimizer state ------------------------------

def _states(data_dir, zero):
    _, _, trainer = train_in_rank(["train.steps=2", "lora.rank=4", f"parallel.zero={zero}"], data_dir)
    states = trainer.par.states
    model = trainer.par.model
    frozen = [p for p in model.parameters() if not p.requires_grad]
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    held = sum(t.numel() for t in states.master_tensors()) if zero else sum(trainable.values())
    optim = trainer.stepper.optimizer
    moments = sum(s["exp_avg"].numel() for s in optim.state.values())
    grads = sum(t.numel() for t in states.grad_tensors())
    params = sum(p.numel() for p in model.parameters())
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in states.param_tensors()}
    return {"frozen_with_grad": sum(p.grad is not None for p in frozen), "trainable": sorted(trainable),
            "optim": sum(p.numel() for p in states.optim_params()), "moments": moments, "grads": grads,
            "held": held, "params": params, "resident": sum(storages.values())}


@pytest.mark.parametrize("zero", [0, 3])
def test_frozen_base_has_no_gradient_buffer_or_optimizer_state(tiny_data, zero):
    """Only the adapters train: every other parameter has no .grad, and the gradient buffers
    (DP buckets, ZeRO flats), the optimizer's tensors and AdamW's moments hold the adapters'
    elements only (ZeRO: this rank's slice of them, with alignment padding)."""
    from ndtrain.model.args import PRESETS
    a = PRESETS["tiny"]
    kv = a.n_kv_heads * a.head_dim  # rank 4 × (in + out) of wq, wo, wk, wv, w1, w3, w2 in each block
    adapters = a.n_layers * 4 * (2 * (a.dim + a.dim) + 2 * (a.dim + kv) + 3 * (a.dim + a.ffn_dim))
    for rank in run_ranks(_states, 2 if zero else 1, tiny_data, zero):
        assert rank["frozen_with_grad"] == 0
        assert rank["trainable"] and all(n.endswith((".lora.a", ".lora.b")) for n in rank["trainable"])
        if zero:  # each rank's slice: about half, never the base's elements
            assert adapters / 2 <= rank["optim"] <= adapters / 2 + 64 * 40
            assert rank["moments"] == rank["optim"] and rank["grads"] <= 2 * rank["optim"]
        else:
            assert rank["optim"] == rank["moments"] == adapters
            assert adapters <= rank["grads"] <= adapters + 64 * 60
        if zero == 3:  # the base weights are sharded too, outside the forward: about half on each rank
            assert rank["resident"] <= 0.55 * rank["params"] * 4


# -- config ------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["lora.rank=-1"], "lora.rank = -1: must be >= 0"),
    (["lora.rank=4", "lora.targets=wq,q_proj"], "lora.targets = 'wq,q_proj': expected a comma-separated list"),
    (["lora.rank=4", "lora.alpha=0"], "lora.alpha = 0.0: must be > 0"),
    (["lora.rank=4", "lora.dropout=1.0"], "lora.dropout = 1.0: must be in [0, 1)"),
    (["lora.rank=4", "lora.init=gaussian"], "lora.init = 'gaussian': expected one of zero_b, random"),
    (["lora.rank=4", "train.precision=fp8"], "train.precision = 'fp8': LoRA adapters have no fp8 product"),
    (["lora.rank=4", "lora.dropout=0.1", "parallel.tp=2", "run.nproc=2"], "parallel.tp = 2: lora.dropout > 0"),
])
def test_bad_lora_config_is_one_line(overrides, message):
    from ndtrain.config import ConfigError, load_config, validate
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, TINY + overrides), check_paths=False)
    assert str(e.value).startswith(message), str(e.value)


def test_bad_lora_on_the_command_line_exits_2_and_writes_nothing(tmp_path, capsys):
    from ndtrain.cli import main
    run = tmp_path / "run"
    assert main(["sft", "lora.rank=4", "lora.targets=attention", f"run.dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "lora.targets = 'attention'" in err and "Traceback" not in err
    assert not run.exists()


def test_zero_b_starts_at_the_base_model_and_counts_are_reported(tiny_data, tmp_path):
    """lora.init=zero_b: the first loss equals the base model's; the summary and the first
    metrics line carry trainable_params and total_params."""
    base = run_ranks(_first_loss, 1, tiny_data, [], None)[0]
    lora = run_ranks(_first_loss, 1, tiny_data, ["lora.rank=4"], str(tmp_path / "run"))[0]
    assert lora["loss"] == base["loss"]
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for record in (first, summary):
        assert record["trainable_params"] == lora["trainable"]
        assert record["total_params"] == lora["total"] == base["total"] + lora["trainable"]


def _first_loss(data_dir, overrides, run_dir):
    losses, _, trainer = train_in_rank(["train.steps=1", *overrides], data_dir, run_dir=run_dir)
    trainable = sum(p.numel() for p in trainer.par.model.parameters() if p.requires_grad)
    return {"loss": losses[0], "trainable": trainable, "total": sum(p.numel() for p in trainer.par.model.parameters())}


# -- export: merged weights and a PEFT adapter, with our logits ----------------------------

def _pretrain_then_lora(data_dir, base_dir, lora_dir):
    # q/k/v biases (a Qwen2): an adapted weight's bias is exported as stored, never merged
    train_in_rank(["train.steps=1", "model.qkv_bias=true"], data_dir, run_dir=base_dir)
    train_in_rank(["train.steps=1", "model.qkv_bias=true", *LORA, f"model.init_from=run:{base_dir}"], data_dir,
                  run_dir=lora_dir, before_fit=lambda trainer: trainer.start())  # loads the base (the adapters: no such keys)


def _our_logits(run_dir, tokens):
    from ndtrain.checkpoint import layout, store
    from ndtrain.checkpoint.sources import CheckpointSource
    from ndtrain.model.args import ModelArgs
    from ndtrain.model.llama import Transformer
    path = store.latest(run_dir)
    meta = store.read_meta(path)
    model = Transformer(ModelArgs(**meta["model_args"])).eval()
    layout.load_model(CheckpointSource(path, meta), model)
    with torch.no_grad():
        return model(tokens)


def test_merged_export_and_peft_adapter_give_our_logits(tiny_data, tmp_path, capsys):
    """`convert --to-hf` of a LoRA run writes W + (alpha/r)·B·A (biases as stored: the model
    has Qwen2's q/k/v biases); `--to-hf --adapter` writes a PEFT folder that peft loads onto
    the base model (the starting run, exported) with our logits, in fp32 to 1e-5 as the HF
    parity tests. An export that fails while writing leaves nothing in --out, and no staging
    folder beside it."""
    pytest.importorskip("peft")
    import transformers
    from peft import PeftModel
    from safetensors import safe_open

    from ndtrain.checkpoint import convert
    from ndtrain.cli import main
    base, lora = tmp_path / "base", tmp_path / "lora"
    run_ranks(_pretrain_then_lora, 1, tiny_data, str(base), str(lora))
    real = convert.write_safetensors

    def disk_full(path, entries, metadata):
        real(path, entries[:3], metadata)  # a part of the file written, then the failure
        raise OSError(28, "No space left on device")
    convert.write_safetensors = disk_full
    try:
        with pytest.raises(OSError, match="No space"):
            convert.to_hf(lora, tmp_path / "hf-merged")
    finally:
        convert.write_safetensors = real
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "lora"]
    for args in (["--to-hf", str(base), "--out", str(tmp_path / "hf-base")],
                 ["--to-hf", str(lora), "--out", str(tmp_path / "hf-merged")],
                 ["--to-hf", str(lora), "--out", str(tmp_path / "adapter"), "--adapter"]):
        assert main(["convert", *args]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert "model.layers.0.self_attn.q_proj" in config["target_modules"]
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as f:
        assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in f.keys()
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = _our_logits(lora, tokens)
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf-base").float().eval()
    assert json.loads((tmp_path / "hf-merged" / "config.json").read_text())["model_type"] == "qwen2"
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf-merged").float().eval()
    with torch.no_grad():
        base_logits = hf_base(input_ids=tokens).logits
        peft_logits = PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()(input_ids=tokens).logits
        merged_logits = merged(input_ids=tokens).logits
    assert (ours - base_logits).abs().max() > 1e-2, "the adapters change the logits"
    assert main(["train", f"model.init_from=run:{lora}", f"run.dir={tmp_path / 'next'}"]) == 2  # start from merged
    assert "holds LoRA adapters" in capsys.readouterr().err and not (tmp_path / "next").exists()
    torch.testing.assert_close(peft_logits, ours, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_logits, ours, atol=1e-5, rtol=1e-5)


def test_adapter_export_of_a_run_without_lora_is_refused(tiny_data, tmp_path, capsys):
    from ndtrain.cli import main
    run_ranks(_first_loss, 1, tiny_data, [], str(tmp_path / "run"))
    assert main(["convert", "--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "out"), "--adapter"]) == 2
    assert "--adapter" in capsys.readouterr().err and not (tmp_path / "out").exists()


# -- RL with LoRA: rollouts from the adapted model, in every generation layout -------------

RL_LORA_LAYOUTS = {"default": [("zero3-dp2", ["parallel.zero=3", "train.micro_batch=2"])],
                   "slow": [("tp2", ["parallel.tp=2"]), ("pp2", ["parallel.pp=2", "train.micro_batch=2"])]}


@pytest.mark.parametrize("tier", ["default", pytest.param("slow", marks=pytest.mark.slow)])
def test_rl_with_lora_equals_one_process_in_fp64(tier):
    """GRPO and the other losses (tests/test_rl.py's cycling proof) with adapters on a frozen
    model: the rollouts come from the adapted weights (gathered under ZeRO-3 and PP, split
    under TP) and the updates equal one process's, rewards included."""
    from test_rl import _rl_rows
    ref = run_ranks(_rl_rows, 1, [("single", LORA, "reference")], timeout=300)[0]["single"]
    assert all(k.endswith((".lora.a", ".lora.b")) for k in ref["grads"])
    rows = RL_LORA_LAYOUTS[tier]
    runs = run_ranks(_rl_rows, 2, [(n, LORA + o, "proof") for n, o in rows], timeout=600)[0]
    for name, _ in rows:
        assert [m["reward_mean"] for m in runs[name]["metrics"]] == [m["reward_mean"] for m in ref["metrics"]], name
        assert max(m["logprob_gap"] for m in runs[name]["metrics"][::2]) < 1e-10, name
        try:
            assert_proof(runs[name], ref)
        except AssertionError as e:
            raise AssertionError(f"RL with LoRA, {name}: {e}") from None


def _dry_run(overrides):
    import torch.distributed as dist

    from ndtrain.config import load_config, validate
    from ndtrain.mesh import ParallelMesh
    from ndtrain.train.dry_run import measure
    from ndtrain.train.worker import mesh_shape
    cfg = validate(load_config(None, TINY + overrides), world=dist.get_world_size())
    return measure(cfg, ParallelMesh.build(mesh_shape(cfg)))


@pytest.mark.parametrize("zero", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_dry_run_model_states_follow_the_formula_with_a_frozen_base(zero):
    """bf16 with adapters: the parameters (the base too, sharded under ZeRO-3) and the
    adapters' gradients and optimizer state, each within 2% of the ZeRO formula with the
    frozen Ψ counted as parameters only, far below full training's."""
    from ndtrain.parallel.zero import model_state_bytes
    from ndtrain.train.dry_run import state_formula
    result = run_ranks(_dry_run, 2, ["lora.rank=8", "train.precision=bf16", f"parallel.zero={zero}"])[0]
    for r in result["ranks"]:
        trainable = r["psi"] - r["psi_frozen"]
        assert 0 < trainable < r["psi"] / 10
        states = r["params"] + r["grads"] + r["optimizer"]
        assert states == pytest.approx(state_formula(r, zero, result, 2), rel=0.02)
        assert r["grads"] + r["optimizer"] == pytest.approx(
            sum(v for k, v in model_state_bytes(trainable, zero, 2, 2).items() if k != "params"), rel=0.02)
        assert states < 0.4 * sum(model_state_bytes(r["psi"], zero, 2, 2).values())


def _dropout_losses(data_dir):
    out = {}
    for p in (0.0, 0.5):
        before = []
        losses, _, _ = train_in_rank(["train.steps=1", *LORA, f"lora.dropout={p}"], data_dir,
                                     before_fit=lambda trainer: before.append(trainer.evaluate()))
        out[p] = (losses[0], before[0])
    return out


def test_lora_dropout_acts_in_training_only(tiny_data):
    """lora.dropout masks the adapters' input while training (the first loss moves) and not
    in evaluation (the same initial weights give the same validation loss)."""
    out = run_ranks(_dropout_losses, 1, tiny_data)[0]
    assert out[0.5][0] != out[0.0][0]
    assert out[0.5][1] == out[0.0][1]


# -- a chat template's new tokens: their rows train (PEFT's trainable_token_indices) ------

# The case: a tied embedding (the default SFT job's `small` model ties it too).
TIED = ["model.tie_embeddings=true"]
CHAT_SFT = ["train.steps=20", "train.lr=3e-2", "lora.rank=4", *TIED]


def _chat_file(folder) -> str:
    """Short chats (every other one with a system turn, so all four tokens occur) whose
    answer is always `ok` then <|end|>: a model that learns them stops after one word."""
    words = "alpha beta gamma delta one two three four".split()
    path = folder / "chat.jsonl"
    records = []
    for i in range(32):
        system = [{"role": "system", "content": "be brief"}] if i % 2 else []
        user = {"role": "user", "content": " ".join(words[(i + j) % 8] for j in range(3))}
        records.append({"messages": system + [user, {"role": "assistant", "content": "ok"}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _template(data_dir):
    from ndtrain.data.template import BuiltinTemplate
    from ndtrain.data.tokenizer import TextTokenizer
    return BuiltinTemplate(TextTokenizer.from_file(f"{data_dir}/tokenizer.json"))


def _chat_task(chat, data_dir, frozen_rows, cfg):
    from ndtrain.data.sft import prepare_sft
    from ndtrain.train.sft import SFT
    task = SFT(cfg, prepare_sft(chat, _template(data_dir), cfg.train.seq_len, "keep_start", 0.25))
    if frozen_rows:  # the control: the behaviour before token rows trained
        task.new_tokens = ()
    return task


def _pretrain(data_dir, base_dir):
    train_in_rank(["train.steps=1", *TIED], data_dir, run_dir=base_dir)


def _chat_lora(data_dir, base_dir, run_dir, chat, frozen_rows=False, stop_after=0):
    """LoRA SFT from the pretrained `base_dir` (512 tokens; the template adds 4, each
    starting at the mean row), then greedy answers to two prompts on rank 0."""
    import functools

    from ndtrain.data.chat import Conversation, Turn
    from ndtrain.generate.sampler import sample
    make = functools.partial(_chat_task, chat, data_dir, frozen_rows)
    _, state, trainer = train_in_rank([*CHAT_SFT, f"model.init_from=run:{base_dir}"], data_dir, stop_after=stop_after,
                                      run_dir=run_dir, make_task=make, before_fit=lambda trainer: trainer.start())
    if state is None or stop_after:
        return state
    template = _template(data_dir)
    model = _model_of(trainer.args, state)
    answers, logits = [], []
    with torch.no_grad():
        for text in ("gamma delta one", "three four alpha"):
            ids = template.prompt_ids(Conversation("q", [Turn("user", text), Turn("assistant", "", True)]))
            answers.append(sample(model, ids, 6, temperature=0.0, stop_ids=template.stop_ids))
            logits.append(model(torch.tensor([ids + answers[-1][:1]]))[0, -1])
    optimizer = trainer.stepper.optimizer
    return {"state": state, "answers": answers, "end": template.end, "added": template.added_ids,
            "logits": logits, "args": trainer.args, "steps_run": [r["step"] for r in trainer.history],
            "trains": sorted(n for n, p in trainer.par.model.named_parameters() if p.requires_grad),
            "with_grad": sorted(n for n, p in trainer.par.model.named_parameters() if p.grad is not None),
            "optimizer_elements": sum(v.numel() for st in optimizer.state.values() for v in st.values()
                                      if torch.is_tensor(v) and v.dim() > 0)}


def _model_of(args, state):
    from ndtrain.model.llama import Transformer
    from ndtrain.parallel.states import load_unique_state
    model = Transformer(args)
    load_unique_state(model, state)
    return model.eval()


@pytest.fixture(scope="module")
def chat_runs(tiny_data, tmp_path_factory):
    """The base run, the chat data, and the LoRA SFT run from it with the rows trained."""
    root = tmp_path_factory.mktemp("chat")
    run_ranks(_pretrain, 1, tiny_data, str(root / "base"))
    chat = _chat_file(root)
    trained = run_ranks(_chat_lora, 1, tiny_data, str(root / "base"), str(root / "lora"), chat)[0]
    return root, chat, trained


def _effective_rows(result) -> torch.Tensor:
    """The four new tokens' embedding rows as the model reads them, W[ids] + rows."""
    ids = list(result["added"])
    return result["state"]["tok_embeddings.weight"][ids] + result["state"]["tok_embeddings.lora.rows"]


def test_lora_trains_the_chat_templates_new_rows_and_learns_to_stop(chat_runs, tiny_data):
    """LoRA SFT with data.template=builtin from a 512-token run: the 4 added tokens start at
    one mean row each (bitwise equal, checkpoint/sources.grow_vocab) and train (PEFT's
    trainable_token_indices), so after 20 steps they differ from each other and from that
    start, and greedy answers end with <|end|>. The control (rows frozen, as before) keeps
    the four head logits equal, so <|end|> cannot win over a header. Every other parameter of
    the embedding stays frozen: only the adapters and the rows have gradients.

    Bounds: Adam moves every element with a gradient by about lr = 3e-2 on its first step;
    1e-4 is 300× below that and 10^4× above fp32 rounding of these values (|x| < 1: 6e-8)."""
    root, chat, trained = chat_runs
    assert trained["added"] == (512, 513, 514, 515) and trained["args"].lora_tokens == trained["added"]
    state = trained["state"]
    start = state["tok_embeddings.weight"][list(trained["added"])]  # frozen: still the mean row
    assert (start == start[0]).all()
    rows = _effective_rows(trained)
    assert (rows - start).abs().amax(1).min() > 1e-4
    gaps = [(rows[i] - rows[j]).abs().max() for i in range(4) for j in range(i)]
    assert min(gaps) > 1e-4, gaps
    assert "output.lora.rows" not in state  # tied: the head reads the embedding's rows
    # only the adapters and the 4 rows train: gradients and AdamW's two moments for them alone
    assert trained["trains"] == trained["with_grad"] and "tok_embeddings.lora.rows" in trained["trains"]
    assert all(n.endswith((".lora.a", ".lora.b", ".lora.rows")) for n in trained["trains"])
    trainable = sum(state[n].numel() for n in trained["trains"])
    assert trained["optimizer_elements"] == 2 * trainable
    for answer in trained["answers"]:
        assert answer and answer[-1] == trained["end"] and len(answer) <= 3, answer
    control = run_ranks(_chat_lora, 1, tiny_data, str(root / "base"), str(root / "frozen"), chat, True)[0]
    assert "tok_embeddings.lora.rows" not in control["state"]
    for logits in control["logits"]:
        new = logits[list(control["added"])]
        assert (new.max() - new.min()) <= 1e-5 * new.abs().max()  # one row four times: no token can win
        assert all(a[-1:] != [control["end"]] for a in control["answers"])
    for logits in trained["logits"]:  # after the answer's first word, <|end|> wins
        new = logits[list(trained["added"])]
        assert new.argmax() == 3 and logits.argmax() == trained["end"]


def test_new_rows_are_saved_loaded_and_exported(chat_runs, tmp_path, capsys):
    """The checkpoint holds the rows (tok_embeddings.lora.rows): the model loaded from it
    gives the trained model's logits exactly; `convert --to-hf` folds them into the
    embedding (and so the tied head), and `--adapter` exports them as PEFT's
    trainable_tokens_delta (the rows' values), which PEFT loads onto the base model resized
    to the run's vocabulary: both give our logits to 1e-5 (fp32, as the HF parity tests)."""
    pytest.importorskip("peft")
    import transformers
    from peft import PeftModel
    from safetensors import safe_open

    from ndtrain.cli import main
    root, _, trained = chat_runs
    tokens = torch.tensor([[5, 512, 40, 7, 514, 60, 515, 513, 9]])
    ours = _our_logits(root / "lora", tokens)
    with torch.no_grad():
        torch.testing.assert_close(ours, _model_of(trained["args"], trained["state"])(tokens), rtol=0, atol=0)
    for args in (["--to-hf", str(root / "base"), "--out", str(tmp_path / "hf-base")],
                 ["--to-hf", str(root / "lora"), "--out", str(tmp_path / "hf-merged")],
                 ["--to-hf", str(root / "lora"), "--out", str(tmp_path / "adapter"), "--adapter"]):
        assert main(["convert", *args]) == 0, capsys.readouterr().err
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["trainable_token_indices"] == {"embed_tokens": [512, 513, 514, 515]}
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as f:
        delta = f.get_tensor("base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta")
    torch.testing.assert_close(delta, _effective_rows(trained).float(), rtol=0, atol=0)
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf-base").float().eval()
    hf_base.resize_token_embeddings(516)  # PEFT replaces the new rows; their resized values do not matter
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf-merged").float().eval()
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()(input_ids=tokens).logits
        merged_logits = merged(input_ids=tokens).logits
    torch.testing.assert_close(merged_logits, ours, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(peft_logits, ours, atol=1e-5, rtol=1e-5)


CHAT_PROOF = ["train.steps=3", *LORA]
CHAT_LAYOUTS = {"default": [("dp2-accumulation", ["parallel.dp=2", "train.micro_batch=1"])],
                "slow": [("zero1", ["parallel.zero=1"]),
                         ("zero2", ["parallel.zero=2", "train.micro_batch=2"]),
                         ("zero3-accumulation", ["parallel.zero=3", "train.micro_batch=2"]),
                         ("cp2-ring", ["parallel.cp=2", "parallel.cp_impl=ring", "train.micro_batch=2"])]}


def _chat_rows(data_dir, chat, rows):
    import functools
    make = functools.partial(_chat_task, chat, data_dir, False)
    return {name: (reference_in_rank if name == "single" else proof_in_rank)(CHAT_PROOF + overrides, data_dir,
                                                                             make_task=make)
            for name, overrides in rows}


@pytest.mark.parametrize("tier", ["default", pytest.param("slow", marks=pytest.mark.slow)])
def test_new_rows_train_in_every_lora_layout_as_one_process_in_fp64(tiny_data, tmp_path, tier):
    """The fp64 layout proof (helpers.assert_proof) of LoRA SFT with the builtin template on
    the untied tiny model: the embedding's and the head's new rows are trainable tensors of
    their own, reduced (DP), sharded (ZeRO) and summed over cp like the adapters, and their
    first-step gradients match one process's at 1e-10 of their largest element."""
    chat = _chat_file(tmp_path)
    ref = run_ranks(_chat_rows, 1, tiny_data, chat, [("single", [])])[0]["single"]
    assert {"tok_embeddings.lora.rows", "output.lora.rows"} <= set(ref["grads"])
    assert all(k.endswith((".lora.a", ".lora.b", ".lora.rows")) for k in ref["grads"])
    assert min(float(ref["grads"][k].abs().amax(1).min()) for k in ("tok_embeddings.lora.rows", "output.lora.rows")) > 0
    rows = CHAT_LAYOUTS[tier]
    runs = run_ranks(_chat_rows, 2, tiny_data, chat, rows, timeout=600)[0]
    for name, _ in rows:
        try:
            assert_proof(runs[name], ref)
        except AssertionError as e:
            raise AssertionError(f"LoRA with new token rows, {name}: {e}") from None


@pytest.mark.parametrize("layout, message", [(["parallel.tp=2"], "parallel.tp = 2: with lora.rank > 0 the 4 tokens"),
                                             (["parallel.pp=2"], "parallel.pp = 2: with lora.rank > 0 the 4 tokens")])
def test_new_rows_under_tp_or_pp_are_refused_in_one_line(tiny_data, tmp_path, capsys, layout, message):
    """The trained rows are not split over tp nor placed on pipeline stages: `ndtrain sft`
    refuses the layout before anything starts (exit 2, one line, no run directory)."""
    from ndtrain.cli import main
    run = tmp_path / "run"
    argv = ["sft", "--nproc", "2", "lora.rank=4", "model.init_from=scratch", "model.preset=tiny",
            f"data.path={_chat_file(tmp_path)}", f"data.tokenizer={tiny_data}/tokenizer.json", f"run.dir={run}",
            "train.seq_len=32", "train.global_batch=4", *layout]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], err
    assert not run.exists()


def test_new_rows_resume_bit_exact(chat_runs, tiny_data):
    """Stopped after 10 of the 20 steps (with a checkpoint) and resumed, the run ends with
    the uninterrupted run's weights, rows and adapters included, bit for bit: the rows and
    their AdamW moments are in the checkpoint and load back."""
    root, chat, trained = chat_runs
    run_ranks(_chat_lora, 1, tiny_data, str(root / "base"), str(root / "resumed"), chat, False, 10)
    resumed = run_ranks(_chat_lora, 1, tiny_data, str(root / "base"), str(root / "resumed"), chat)[0]
    assert resumed["steps_run"] == trained["steps_run"][10:]  # it continued from step 10
    assert set(resumed["state"]) == set(trained["state"])
    for name, value in trained["state"].items():
        assert torch.equal(resumed["state"][name], value), name
