"""Imports checked before anything is written (issue 27): `convert --from-hf` and
`model.init_from=hf:` / `run:` refuse a folder whose files are damaged, whose weights are
not the model its config describes (a missing layer, a missing expert, a wrong shape, a
stray layer), hold NaN or infinite values, or whose config is no model (no heads, heads that
do not divide the width, a negative layer count, top-k above the expert count) — one line
naming the tensor or key, exit status 2, and nothing written: no run directory, no output.

The folders are made here from our own tiny models (no `transformers`), each a few kB.
"""

import json
import os
import struct

import pytest
import torch

from helpers import refused, unwritable_dir
from hf_helpers import DENSE, MOE, make_hf
from ndtrain.cli import main

def _set(name, value):
    return lambda state: state.__setitem__(name, value)


def _poison(name, value):
    def damage(state):
        state[name] = state[name].clone()
        state[name].view(-1)[3] = value
    return damage


def _drop(prefix):
    return lambda state: [state.pop(k) for k in list(state) if k.startswith(prefix)]


def _rewrite(name, how):
    def damage(folder):
        path = folder / name
        data = path.read_bytes()
        path.write_bytes(how(data))
    return damage


# name: (folder maker, what the one line must hold)
FOLDERS = {
    "missing layer": (lambda f: make_hf(f, tensors=_drop("model.layers.1.")),
                      "'model.layers.1.input_layernorm.weight, model.layers.1.mlp.down_proj.weight, "),
    "missing expert": (lambda f: make_hf(f, MOE, tensors=_drop("model.layers.0.block_sparse_moe.experts.3.w2")),
                       "= 'model.layers.0.block_sparse_moe.experts.3.w2.weight': missing (1 tensor"),
    "wrong shape": (lambda f: make_hf(f, tensors=_set("model.layers.0.mlp.up_proj.weight", torch.zeros(64, 30))),
                    "model.layers.0.mlp.up_proj.weight = 'shape [64, 30]': expected [64, 32]"),
    "NaN weight": (lambda f: make_hf(f, tensors=_poison("model.layers.1.self_attn.k_proj.weight", float("nan"))),
                   "model.layers.1.self_attn.k_proj.weight = 'holds nan': weights must be finite"),
    "infinite weight": (lambda f: make_hf(f, tensors=_poison("lm_head.weight", float("-inf"))),
                        "lm_head.weight = 'holds -inf'"),
    "integer weight": (lambda f: make_hf(f, tensors=_set("model.norm.weight", torch.ones(32, dtype=torch.int32))),
                       "model.norm.weight = 'I32': a weight must be one of F64, F32, F16, BF16"),
    "stray layer": (lambda f: make_hf(f, tensors=_set("model.layers.7.mlp.up_proj.weight", torch.zeros(64, 32))),
                    "'model.layers.7.mlp.up_proj.weight': not part of the model its config describes (2 layers)"),
    "config: more layers": (lambda f: make_hf(f, config=lambda c: c.update(num_hidden_layers=3)),
                            "missing (9 tensors the model of its config needs: 3 layers"),
    "config: fewer layers": (lambda f: make_hf(f, config=lambda c: c.update(num_hidden_layers=1)),
                             "not part of the model its config describes (1 layers)"),
    "config: vocabulary": (lambda f: make_hf(f, config=lambda c: c.update(vocab_size=400)),
                           "model.embed_tokens.weight = 'shape [300, 32]': expected [400, 32]: the config's "
                           "vocabulary has 400 tokens"),
    "config: no heads": (lambda f: make_hf(f, config=lambda c: c.update(num_attention_heads=0)),
                         "config.json num_attention_heads = 0: must be a positive integer"),
    "config: heads do not divide": (lambda f: make_hf(f, config=lambda c: c.update(num_attention_heads=3, head_dim=None)),
                                    "num_attention_heads = 3: must divide hidden_size = 32"),
    "config: kv heads do not divide": (lambda f: make_hf(f, config=lambda c: c.update(num_key_value_heads=3)),
                                       "num_key_value_heads = 3: must divide num_attention_heads = 4"),
    "config: negative layers": (lambda f: make_hf(f, config=lambda c: c.update(num_hidden_layers=-2)),
                                "num_hidden_layers = -2: must be a positive integer"),
    "config: top-k above experts": (lambda f: make_hf(f, MOE, config=lambda c: c.update(num_experts_per_tok=9)),
                                    "num_experts_per_tok = 9: must be at most the expert count = 4"),
    "config: NaN norm epsilon": (lambda f: make_hf(f, config=lambda c: c.update(rms_norm_eps=float("nan"))),
                                 "rms_norm_eps = nan: must be a positive finite number"),
    "config.json an array": (lambda f: (make_hf(f), (f / "config.json").write_text("[1, 2]")),
                             "= 'config.json': is not a JSON object"),
    "config.json binary": (lambda f: (make_hf(f), (f / "config.json").write_bytes(bytes(range(200, 256)))),
                           "= 'config.json': is not a JSON file (UnicodeDecodeError"),
    "truncated safetensors": (lambda f: (make_hf(f), _rewrite("model.safetensors", lambda b: b[:len(b) // 2])(f)),
                              "(a corrupt or truncated file)"),
    "random bytes": (lambda f: (make_hf(f), (f / "model.safetensors").write_bytes(os.urandom(4096))),
                     "= 'model.safetensors': not a safetensors file"),
    "header claims 2^62 bytes": (lambda f: (make_hf(f), _rewrite("model.safetensors",
                                                                 lambda b: struct.pack("<Q", 2 ** 62) + b[8:])(f)),
                                 "its header claims 4611686018427387904 bytes"),
    "index not JSON": (lambda f: (make_hf(f), (f / "model.safetensors.index.json").write_text("{weight_map")),
                       "'model.safetensors.index.json': is not a JSON file"),
    "index without weight_map": (lambda f: (make_hf(f), (f / "model.safetensors.index.json").write_text("{}")),
                                 "'model.safetensors.index.json': has no weight_map"),
}




@pytest.fixture(scope="module")
def tokenizer(tiny_data):
    return os.path.join(tiny_data, "tokenizer.json")


def test_damaged_or_inconsistent_hf_folders_are_refused_before_anything_is_written(tmp_path, capsys, monkeypatch,
                                                                                  tokenizer):
    """Each folder through `convert --from-hf` and `train model.init_from=hf:` (the checks
    run before the run directory is chosen)."""
    monkeypatch.chdir(tmp_path)
    for name, (make, fragment) in FOLDERS.items():
        folder = tmp_path / name.replace(" ", "_").replace(":", "")
        make(folder)
        refused(["convert", "--from-hf", str(folder), "--to", str(tmp_path / "run")], tmp_path, capsys, fragment)
        refused(["train", f"model.init_from=hf:{folder}", f"data.tokenizer={tokenizer}", "run.device=cpu"],
                 tmp_path, capsys, fragment)


def test_convert_output_paths_that_cannot_be_used(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = make_hf(tmp_path / "model")
    (tmp_path / "a_file").write_text("x")
    for out, fragment in ((tmp_path / "a_file", "exists and is not a directory"),
                          (unwritable_dir(tmp_path) / "run", "cannot be written"),
                          (folder, "is a folder that is neither empty nor an ndtrain run")):  # the source itself
        refused(["convert", "--from-hf", str(folder), "--to", str(out)], tmp_path, capsys, fragment)
    assert main(["convert", "--from-hf", str(folder), "--to", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    for out, fragment in ((tmp_path / "a_file", "exists and is not a directory"),
                          (unwritable_dir(tmp_path) / "hf", "cannot be written"),
                          (tmp_path / "run", "is the folder being converted")):
        refused(["convert", "--to-hf", str(tmp_path / "run"), "--out", str(out)], tmp_path, capsys, fragment)


def test_run_sources_are_checked_alike(tmp_path, capsys, monkeypatch, tokenizer):
    """`model.init_from=run:` on a run whose weights went NaN, and on one whose meta.json
    describes another model, is refused before anything is written."""
    from ndtrain.checkpoint import convert, store
    from ndtrain.checkpoint.sources import HFSource
    monkeypatch.chdir(tmp_path)
    nan = make_hf(tmp_path / "nan", tensors=_poison("model.norm.weight", float("nan")))
    monkeypatch.setattr(HFSource, "check", lambda self, finite=True: None)  # a run that diverged, as convert made it
    convert.from_hf(nan, tmp_path / "nan_run")
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    convert.from_hf(make_hf(tmp_path / "good"), tmp_path / "other_run")
    meta_file = store.steps_of(tmp_path / "other_run")[-1] / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["model_args"]["n_layers"] = 3
    meta_file.write_text(json.dumps(meta))
    cases = {"nan_run": "norm.weight = 'holds nan': weights must be finite",
             "other_run": "= 'layers.2.attention.wk.weight, layers.2.attention.wo.weight"}
    for run, fragment in cases.items():
        refused(["train", f"model.init_from=run:{tmp_path / run}", f"data.tokenizer={tokenizer}", "run.device=cpu"],
                 tmp_path, capsys, fragment)
