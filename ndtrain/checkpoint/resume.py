"""What a resumed run may change and what it may not.

A checkpoint holds global tensors, so the layout (`parallel.*`), the precision, ZeRO, the
micro-batch, the schedule of the learning rate and the number of steps may all change on
resume. What may not: the model (its parameters would not fit, or would mean something
else) and the data and their order (the batch of step s is a function of the seed, the
global batch, the sequence length and the token stream). A change is refused before
anything is written, naming the key.
"""

from __future__ import annotations

import os
from dataclasses import fields

from ndtrain.config import Config, ConfigError
from ndtrain.model.args import ModelArgs

FIXED = ("data.path", "data.sources", "data.tokenizer", "data.vocab_size", "data.val_fraction", "data.text_key",
         "train.seq_len", "train.global_batch", "train.seed")
FREE_ARGS = ("max_seq_len", "dropout", "doc_attention")  # change what is computed (or how), not what the weights are


def _normal(key: str, value):
    if key == "data.sources":  # a mixture: its sources, their paths absolute
        return [{**s, "path": _normal("data.path", s["path"])} for s in value]
    if key in ("data.path", "data.tokenizer") and value and value != "stdlib":
        return os.path.abspath(os.path.expanduser(value))
    return value


def check_resume_config(cfg: Config, meta: dict, args: ModelArgs | None = None) -> None:
    """Raise ConfigError naming the first key whose value differs from the checkpoint's in
    a way a resume cannot honour. `args`: this run's model when known (else the config's,
    with the checkpoint's vocabulary unless model.vocab_size is set)."""
    if meta.get("model_args"):
        saved = ModelArgs(**meta["model_args"])
        mine = args or cfg.model_args(vocab_size=saved.vocab_size)
        for f in fields(ModelArgs):
            a, b = getattr(mine, f.name), getattr(saved, f.name)
            if f.name not in FREE_ARGS and a != b:
                raise ConfigError(f"model.{f.name}", a, f"differs from the checkpoint being resumed ({b}): a resumed "
                                  "run keeps its model; use another run.dir to train a different one")
    saved_cfg = meta.get("config") or {}
    if saved_cfg.get("train", {}).get("optimizer") == "muon" and cfg.train.optimizer != "muon":
        raise ConfigError("train.optimizer", cfg.train.optimizer, "the run being resumed trained with Muon: its "
                          "matrices hold Muon's momentum, not AdamW's moments; resume with train.optimizer=muon")
    for key in FIXED:
        section, name = key.split(".")
        if name not in saved_cfg.get(section, {}):
            continue
        a, b = getattr(getattr(cfg, section), name), saved_cfg[section][name]
        if _normal(key, a) != _normal(key, b):
            raise ConfigError(key, a, f"differs from the run being resumed ({b!r}): a resumed run keeps its data "
                              "and their order; use the same value or another run.dir")
