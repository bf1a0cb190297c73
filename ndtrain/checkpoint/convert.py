"""`ndtrain convert`: Hugging Face model folders in and out, through the same slice reader as
every checkpoint.

- `to_hf(run, out)`: the run's newest good checkpoint → `model.safetensors` (HF names, one
  whole tensor at a time, assembled from whatever layout wrote it), `config.json` (the
  family's config: Llama, Qwen2 or Qwen3), `tokenizer.json` and a minimal
  `tokenizer_config.json`. Loads with `transformers.AutoModelForCausalLM.from_pretrained`.
- `from_hf(folder, run)`: a run directory holding a step-0 checkpoint of the HF weights (no
  optimizer state), its tokenizer and the model keys in `config.toml`; start training from
  it with `model.init_from=run:RUN` (any layout), or sample from it with `ndtrain generate`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ndtrain import config as config_mod
from ndtrain.checkpoint import store
from ndtrain.checkpoint.files import write_safetensors
from ndtrain.checkpoint.slices import Piece
from ndtrain.checkpoint.sources import MOE_KEYS, SHAPE_KEYS, CheckpointSource, HFSource
from ndtrain.checkpoint.store import CheckpointError
from ndtrain.data.tokenizer import TextTokenizer
from ndtrain.model import hf
from ndtrain.model.args import ModelArgs

DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float64: "float64"}


def checkpoint_of(path: Path, report=print) -> Path:
    """A run's newest checkpoint that passes its checks, or `path` if it is a checkpoint."""
    path = Path(path)
    if (path / "meta.json").is_file():
        reason = store.problem(path)
        if reason:
            raise CheckpointError(reason)
        return path
    found = store.select(path, report)
    if found is None:
        raise CheckpointError(f"{path} holds no usable checkpoint")
    return found


def to_hf(run: Path, out: Path, dtype: str | None = None, report=print) -> Path:
    """Export the newest good checkpoint of `run` as a Hugging Face model folder `out`."""
    path = checkpoint_of(run, report)
    meta = store.read_meta(path)
    args = ModelArgs(**meta["model_args"])
    try:
        hf.family_of(args)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if ((meta.get("config") or {}).get("train") or {}).get("moe_bias_rate"):
        raise CheckpointError(f"{path}: the routers' selection bias (train.moe_bias_rate > 0) has no place in a "
                              "Hugging Face Mixtral or Qwen3-MoE; exporting would change which experts tokens choose")
    source = CheckpointSource(path, meta)
    weights = {k[len("weight/"):]: t for k, t in meta["tensors"].items() if k.startswith("weight/")}
    stored = {torch.float64 if t["dtype"] == "F64" else torch.float32 for t in weights.values()}
    target = DTYPE_NAMES[dtype] if dtype else (torch.float32 if torch.float32 in stored else stored.pop())

    def fetch(key: str, shape: tuple, expert: int | None = None):
        """The whole tensor, or one expert of a stack (the piece [expert])."""
        piece = Piece.whole(shape) if expert is None else Piece(shape, (expert,) + (0,) * (len(shape) - 1),
                                                                (1, *shape[1:]))

        def read():
            data = torch.empty(piece.numel, dtype=torch.float64)
            source.fill(key, piece, data)
            return data.to(target).view(piece.box if expert is None else piece.box[1:])
        return read

    entries = []
    for name, t in weights.items():
        shape = tuple(t["shape"])
        for hf_key, expert in hf.hf_names(name, args):
            stored = shape if expert is None else shape[1:]
            entries.append((hf_key, target, stored, fetch(f"weight/{name}", shape, expert)))
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", sorted(entries), {"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf.hf_config_json(args, HF_DTYPE[target]), indent=1))
    run_dir = path.parent.parent
    if (run_dir / "tokenizer.json").is_file():
        shutil.copyfile(run_dir / "tokenizer.json", out / "tokenizer.json")
        tok = TextTokenizer.from_file(run_dir / "tokenizer.json")
        eos = tok._tok.id_to_token(tok.eot_id)
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "model_max_length": args.max_seq_len},
            indent=1))
    return out


def from_hf(folder: Path, run: Path) -> Path:
    """A run directory whose step-0 checkpoint holds the weights of the HF model `folder`."""
    source = HFSource(folder)
    if store.steps_of(run):
        raise CheckpointError(f"{run} already holds checkpoints; choose another directory")
    tensors = []
    for key, (shape, parts) in sorted(source.index.items()):
        data = torch.empty(int(torch.Size(shape).numel()), dtype=torch.float32)
        source.fill(key, Piece.whole(shape), data)
        tensors.append((key, Piece.whole(shape), data))
    args = source.args
    cfg = config_mod.Config()
    for key in SHAPE_KEYS + ("max_seq_len",) + (MOE_KEYS if args.is_moe else ()):
        setattr(cfg.model, key, config_mod.model_key_value(args, key))
    run.mkdir(parents=True, exist_ok=True)
    if (Path(folder) / "tokenizer.json").is_file():
        shutil.copyfile(Path(folder) / "tokenizer.json", run / "tokenizer.json")
        cfg.data.tokenizer = str((run / "tokenizer.json").resolve())
    (run / "config.toml").write_text(config_mod.to_toml(cfg))
    meta = {"model_args": args.to_dict(), "tokens": 0, "config": None, "precision": "fp32", "zero": 0,
            "scaler": None, "optimizer_step": 0, "mesh": {}, "converted_from": str(Path(folder).resolve())}
    return store.save(run, 0, tensors, meta)
