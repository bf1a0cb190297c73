"""Hugging Face in and out, for Llama (tied and untied), Qwen2 (q/k/v biases) and Qwen3 (q/k
norms, head_dim ≠ dim / heads): `transformers` builds tiny random models from a config (no
download) and saves them; we read them.

- One process: our logits equal theirs within 1e-5 (fp32) at positions up to 2048, where a
  wrong rotary layout shows.
- `model.init_from=hf:DIR` on TP=2, PP=2 and ZeRO-3: every rank reads only its slices, the
  gathered weights equal HF's exactly, the loss of a 2048-token sequence equals HF's, and
  3 training steps (gradients through the biases and q/k norms under each layout) equal one
  process at 1e-5.
- `ndtrain convert --to-hf` of a trained run loads in `AutoModelForCausalLM` and keeps the
  run's validation loss; `--from-hf` makes a run that `init_from=run:` and `generate` read.
"""

import json
import shutil

import pytest
import torch

from ckpt_helpers import full_state, make_trainer, train
from hf_helpers import ours_from
from ndtrain.testing import run_ranks

transformers = pytest.importorskip("transformers")

SEQ = 2048
# name: (config class, extra config keys)
FAMILIES = {
    "llama-untied": ("LlamaConfig", {"tie_word_embeddings": False}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False, "head_dim": 24}),
}
LAYOUTS = {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2", "train.micro_batch=4"], "zero3": ["parallel.zero=3"]}


def make_hf_model(folder, family: str, tokenizer_json):
    """A random tiny HF model, saved; biases and norm weights randomised (HF starts them at
    0 and 1, which would hide a wrong mapping), q and k sharpened (so the rotary matters)."""
    cls, extra = FAMILIES[family]
    config = getattr(transformers, cls)(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                        rope_theta=50000.0, rms_norm_eps=1e-6, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "q_proj" in name or "k_proj" in name:
                p.mul_(4)
    model.save_pretrained(folder)
    shutil.copyfile(tokenizer_json, folder / "tokenizer.json")
    return model


@pytest.fixture(scope="module")
def hf_models(tiny_data, tmp_path_factory):
    from pathlib import Path
    root = tmp_path_factory.mktemp("hf")
    return {f: (root / f, make_hf_model(root / f, f, Path(tiny_data) / "tokenizer.json")) for f in FAMILIES}


def tokens(n: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 512, (1, n + 1), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_at_long_positions(hf_models, family):
    folder, theirs = hf_models[family]
    ours = ours_from(folder)
    a = ours.args
    assert (a.qkv_bias, a.qk_norm, a.tie_embeddings) == (family == "qwen2", family == "qwen3",
                                                         FAMILIES[family][1]["tie_word_embeddings"])
    assert a.head_dim == (24 if family == "qwen3" else 16) and a.rope_theta == 50000.0 and a.norm_eps == 1e-6
    x = tokens()[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(input_ids=x).logits, atol=1e-5, rtol=1e-5)


def _layouts(data_dir, folders, layouts):
    """For each family and layout: the gathered weights right after init_from, the loss sum
    of one 2048-token sequence, then 3 training steps' losses and final weights."""
    from ndtrain.data.batch import MicroBatch
    out = {}
    seq = tokens()
    for family, folder in folders.items():
        for name, overrides in layouts.items():
            common = [f"model.init_from=hf:{folder}", "train.steps=3", "train.warmup=1"]
            trainer = make_trainer(common + overrides, data_dir, None)
            trainer.start()
            loaded = full_state(trainer)
            trainer.par.model.eval()
            loss = float(trainer.par.evaluate([MicroBatch(seq[:, :-1], seq[:, 1:])]))
            trainer.par.model.train()
            trainer.fit()
            out[(family, name)] = (loaded, loss, [r["loss"] for r in trainer.history], full_state(trainer))
    return out


def test_init_from_hf_on_any_layout(hf_models, tiny_data):
    from ndtrain.model.hf import from_hf_state_dict
    folders = {f: str(folder) for f, (folder, _) in hf_models.items() if f in ("llama-tied", "qwen2", "qwen3")}
    single = run_ranks(_layouts, 1, tiny_data, folders, {"single": []}, timeout=600)[0]
    results = run_ranks(_layouts, 2, tiny_data, folders, LAYOUTS, timeout=600)[0]
    seq = tokens()
    for family in folders:
        theirs = hf_models[family][1]
        with torch.no_grad():
            logits = theirs(input_ids=seq[:, :-1]).logits[0]
        hf_sum = float(torch.nn.functional.cross_entropy(logits, seq[0, 1:], reduction="sum"))
        expected = from_hf_state_dict(theirs.state_dict(), theirs_args(theirs))
        if theirs.config.tie_word_embeddings:
            del expected["output.weight"]  # the embedding, held once
        _, _, ref_losses, ref_state = single[(family, "single")]
        for name in ("single", *LAYOUTS):
            loaded, loss, losses, state = (single if name == "single" else results)[(family, name)]
            where = f"{family} on {name}"
            assert set(loaded) == set(expected), where
            for k, v in loaded.items():
                assert torch.equal(v, expected[k]), f"{where}: {k} differs from the HF weight"
            assert abs(loss - hf_sum) <= 1e-5 * hf_sum, (where, loss, hf_sum)
            assert len(losses) == 3
            for a, b in zip(losses, ref_losses):
                assert abs(a - b) <= 1e-5 * abs(b), (where, losses, ref_losses)
            for k in ref_state:
                err = (state[k] - ref_state[k]).norm() / ref_state[k].norm()
                assert err <= 1e-5, f"{where}: {k} relative error {err:.2e}"


def theirs_args(model):
    from ndtrain.model.hf import args_from_hf_config
    return args_from_hf_config(model.config)


def test_convert_to_hf_keeps_the_loss_and_comes_back(hf_models, tiny_data, tmp_path, capsys):
    """A Qwen3 run trained 3 steps from a HF model exports to a folder that
    `AutoModelForCausalLM` loads, with our logits and the run's validation loss; converting
    that folder back gives a run whose weights are the same and which `generate` reads."""
    import math

    from ndtrain.checkpoint import store
    from ndtrain.checkpoint.layout import load_model
    from ndtrain.checkpoint.sources import CheckpointSource
    from ndtrain.cli import main
    from ndtrain.data.loader import BatchLoader
    from ndtrain.data.prepare import PreparedData
    from ndtrain.model.args import ModelArgs
    from ndtrain.model.llama import Transformer

    folder = hf_models["qwen3"][0]
    run, out, back = tmp_path / "run", tmp_path / "hf", tmp_path / "back"
    _, _, trainer = train([f"model.init_from=hf:{folder}", "train.steps=3", "train.warmup=1"], tiny_data, str(run))
    val_loss = trainer.history[-1]["val_loss"]
    shutil.copyfile(folder / "tokenizer.json", run / "tokenizer.json")  # as the command line's run would hold
    assert main(["convert", "--to-hf", str(run), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    meta = store.read_meta(store.latest(run))
    ours = Transformer(ModelArgs(**meta["model_args"])).eval()
    load_model(CheckpointSource(store.latest(run), meta), ours)
    x = tokens(512)[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(input_ids=x).logits, atol=1e-5, rtol=1e-5)
        inputs, targets = BatchLoader(PreparedData.open(tiny_data).stream("val"), 32, 8, 0, shuffle=False).rows(0, 0, 8)
        logits = theirs(input_ids=inputs).logits
        hf_val = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    assert math.isclose(hf_val, val_loss, rel_tol=1e-5), (hf_val, val_loss)

    assert main(["convert", "--from-hf", str(out), "--to", str(back)]) == 0
    capsys.readouterr()
    again = Transformer(ModelArgs(**meta["model_args"])).eval()
    load_model(CheckpointSource(store.latest(back)), again)
    for (k, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k
    assert main(["generate", "--run", str(back), "--prompt", "def ", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    # bad input: one line, status 2
    assert main(["convert", "--to-hf", str(run)]) == 2
    assert main(["convert", "--from-hf", str(out), "--to", str(back)]) == 2  # already holds a checkpoint
    assert "already holds checkpoints" in capsys.readouterr().err
