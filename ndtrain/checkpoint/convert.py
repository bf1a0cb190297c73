"""`ndtrain convert`: Hugging Face model folders in and out, through the same slice reader as
every checkpoint.

- `to_hf(run, out)`: the run's newest good checkpoint → `model.safetensors` (HF names, one
  whole tensor at a time, assembled from whatever layout wrote it, in the dtype the model
  came from unless --dtype), `config.json` (the family it came from, or the simplest one
  that holds it: docs/hf.md), and the run's tokenizer files, chat template and generation
  config (checkpoint/hf_files.py). Loads with `transformers.AutoModelForCausalLM`.
- `from_hf(folder, run)`: a run directory holding a step-0 checkpoint of the HF weights (no
  optimizer state), its tokenizer files, generation config and config.json, and the model
  keys in `config.toml`; start training from it with `model.init_from=run:RUN` (any
  layout), or sample from it with `ndtrain generate`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ndtrain import config as config_mod
from ndtrain.checkpoint import hf_files, store
from ndtrain.checkpoint.adapter import (adapted, base_model_path, check_adapter, merged_fetch, rows_fetch,
                                       write_adapter)
from ndtrain.checkpoint.files import write_safetensors
from ndtrain.checkpoint.slices import Piece
from ndtrain.checkpoint.sources import MOE_KEYS, SHAPE_KEYS, CheckpointSource, HFSource
from ndtrain.checkpoint.store import CheckpointError
from ndtrain.config import ConfigError
from ndtrain.data.tokenizer import TextTokenizer
from ndtrain.model import hf
from ndtrain.model.args import ModelArgs
from ndtrain.model.lora import is_adapter

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


def to_hf(run: Path, out: Path, dtype: str | None = None, report=print, overwrite: bool = False,
          adapter: bool = False) -> Path:
    """Export the newest good checkpoint of `run` as a Hugging Face model folder `out`: in
    the family and dtype the model came from (unless `dtype`), with the run's tokenizer
    files and generation config; a LoRA run's adapters merged into their weights, or with
    `adapter`, only the adapters, as a PEFT adapter folder (checkpoint/adapter.py). A
    non-empty `out` is refused unless `overwrite`, which clears its model files first.
    Every refusal comes before anything is written."""
    try:
        path = checkpoint_of(run, report)
    except CheckpointError as e:  # no checkpoint of the run given can be read: bad input, nothing written
        raise ConfigError("--to-hf", str(run), str(e)) from None
    meta = store.read_meta(path)
    args = ModelArgs(**meta["model_args"])
    run_dir = path.parent.parent
    base = hf_files.read_json(run_dir / hf_files.HF_CONFIG)
    try:
        family = hf.family_of(args, (base or {}).get("model_type"))
    except ValueError as e:
        raise ConfigError("--to-hf", str(run), str(e)) from None
    if ((meta.get("config") or {}).get("train") or {}).get("moe_bias_rate") and not family.deepseek:
        raise ConfigError("--to-hf", str(run), "the routers' selection bias (train.moe_bias_rate > 0) has no place "
                          "in a Hugging Face Mixtral or Qwen3-MoE; exporting would change which experts tokens choose")
    if adapter:
        check_adapter(args, family, run)
    check_output_dir("--out", out, run, run_dir, path)
    try:
        hf_files.check_export_dir(out, overwrite)
    except ValueError as e:
        raise ConfigError("--out", str(out), str(e)) from None
    source = CheckpointSource(path, meta)
    weights = {k[len("weight/"):]: t for k, t in meta["tensors"].items() if k.startswith("weight/")}
    with hf_files.staged_export(out, overwrite) as stage:  # a failure below leaves `out` as it was
        if adapter:
            write_adapter(source, weights, args, family, base_model_path(meta), stage)
            return out
        target = _export_dtype(dtype, base, weights)
        if family.model_type == "gpt_oss":  # what a gpt-oss user may expect otherwise: OpenAI's MXFP4 experts
            report(f"gpt_oss: the experts are written unquantized, as {HF_DTYPE[target]} gate_up_proj and down_proj "
                   "(not MXFP4), like every other tensor")
        entries = _hf_entries(source, weights, args, family, target) + _buffer_entries(source, meta, family, args,
                                                                                       target)
        write_safetensors(stage / "model.safetensors", sorted(entries, key=lambda e: e[0]), {"format": "pt"})
        config = hf.hf_config_json(args, HF_DTYPE[target], base)
        (stage / "config.json").write_text(json.dumps(config, indent=1))
        eot_token = eot_id = None
        if (run_dir / "tokenizer.json").is_file():
            tok = TextTokenizer.from_file(run_dir / "tokenizer.json")
            eot_id, eot_token = tok.eot_id, tok._tok.id_to_token(tok.eot_id)
        hf_files.export(run_dir, stage, eot_token, eot_id, args.max_seq_len)
    return out


def _export_dtype(dtype: str | None, base: dict | None, weights: dict) -> torch.dtype:
    """--dtype, else the dtype of the HF model the run came from, else as stored (fp32)."""
    if dtype:
        return DTYPE_NAMES[dtype]
    named = {v: k for k, v in HF_DTYPE.items()}.get(hf.source_dtype(base or {}) or "")
    if named is not None and named != torch.float64:
        return named
    stored = {torch.float64 if t["dtype"] == "F64" else torch.float32 for t in weights.values()}
    return torch.float32 if torch.float32 in stored else stored.pop()


def _hf_entries(source: CheckpointSource, weights: dict, args: ModelArgs, family, target: torch.dtype) -> list:
    """(HF name, dtype, shape, read) of every tensor of the HF checkpoint, sorted: one of
    ours, one expert of a stack, or (Phi-3) ours stacked by rows."""
    pieces: dict[str, list] = {}
    views: dict[str, dict] = {}  # gpt_oss: HF tensor -> {layout: (our shape, fetch)}
    for name, t in weights.items():
        if is_adapter(name):  # folded into its base weight (merged_fetch)
            continue
        shape = tuple(t["shape"])
        for part in hf.hf_parts(name, args, family):
            stored = shape if part.expert is None else shape[1:]
            fetch = _fetch(source, f"weight/{name}", shape, part.expert, target)
            weight = name.endswith(".weight")  # a bias beside an adapted weight stays as stored
            if weight and f"{adapted(name)}.lora.a" in weights:
                fetch = merged_fetch(source, name, weights, args, target)
            elif weight and f"{adapted(name)}.lora.rows" in weights:  # a chat template's trained token rows
                fetch = rows_fetch(source, name, weights, args, target)
            if part.layout:
                views.setdefault(part.hf, {})[part.layout] = (shape, fetch)
                continue
            pieces.setdefault(part.hf, []).append((part.rows or (0, stored[0]), stored, fetch))
    entries = []
    for hf_name, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        reads = [read for _, _, read in parts]
        shape = (parts[-1][0][1], *parts[0][1][1:])
        read = reads[0] if len(reads) == 1 else (lambda reads=reads: torch.cat([r() for r in reads]))
        entries.append((hf_name, target, shape, read))
    for hf_name, parts in views.items():
        layout, (shape, _) = next(iter(parts.items()))
        read = (lambda parts=parts: hf.gpt_oss.hf_from_ours({lay: fetch() for lay, (_, fetch) in parts.items()}))
        entries.append((hf_name, target, hf.gpt_oss.hf_shape(layout, shape), read))
    return sorted(entries, key=lambda e: e[0])


def _buffer_entries(source: CheckpointSource, meta: dict, family, args: ModelArgs,
                    target: torch.dtype = torch.float32) -> list:
    """What DeepSeek-V3's checkpoints carry beyond our parameters: the routers' bias (in
    fp32, as transformers keeps it), and each MTP layer's copies of the embedding and head."""
    if not family.deepseek:
        return []
    out = []
    for d in range(args.mtp_depth):
        for theirs, ours in hf.MTP_COPIES.items():
            key = "weight/tok_embeddings.weight" if args.tie_embeddings else f"weight/{ours}"
            shape = tuple(meta["tensors"][key]["shape"])
            out.append((f"model.layers.{args.n_layers + d}.{theirs}", target, shape,
                        _fetch(source, key, shape, None, target)))
    for key, t in meta["tensors"].items():
        name = hf.hf_buffer(key[len("buffer/"):], args) if key.startswith("buffer/") else None
        if name is not None:
            out.append((name, torch.float32, tuple(t["shape"]), _fetch(source, key, tuple(t["shape"]), None,
                                                                         torch.float32)))
    return out


def _fetch(source: CheckpointSource, key: str, shape: tuple, expert: int | None, target: torch.dtype):
    """The whole tensor, or one expert of a stack (the piece [expert]), as a function."""
    piece = Piece.whole(shape) if expert is None else Piece(shape, (expert,) + (0,) * (len(shape) - 1),
                                                            (1, *shape[1:]))

    def read():
        data = torch.empty(piece.numel, dtype=torch.float64)
        source.fill(key, piece, data)
        return data.to(target).view(piece.box if expert is None else piece.box[1:])
    return read


def check_output_dir(key: str, out: Path, *sources: Path) -> None:
    """Refuse an output folder that cannot be written, is a file, or is a source itself."""
    config_mod.check_writable_dir(key, str(out))
    for source in sources:
        if Path(out).expanduser().resolve() == Path(source).expanduser().resolve():
            raise ConfigError(key, str(out), f"is the folder being converted ({source}); write to a new folder")


def from_hf(folder: Path, run: Path) -> Path:
    """A run directory whose step-0 checkpoint holds the weights of the HF model `folder`."""
    source = HFSource(folder)
    check_output_dir("--to", run, folder)
    source.check()  # every tensor against config.json, and finite, before a byte is written
    if store.steps_of(run):
        raise ConfigError("--to", str(run), "already holds checkpoints; choose another directory")
    tensors = []
    for key, (shape, parts) in sorted(source.index.items()):
        data = torch.empty(int(torch.Size(shape).numel()), dtype=torch.float32)
        source.fill(key, Piece.whole(shape), data)
        tensors.append((key, Piece.whole(shape), data))
    args = source.args
    cfg = config_mod.Config()
    for key in SHAPE_KEYS + ("max_seq_len",) + (MOE_KEYS if args.is_moe else ()):
        setattr(cfg.model, key, config_mod.model_key_value(args, key))
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)  # first: it marks an ndtrain run (config/paths.py)
    if (Path(folder) / "tokenizer.json").is_file():
        shutil.copyfile(Path(folder) / "tokenizer.json", run / "tokenizer.json")
        cfg.data.tokenizer = str((run / "tokenizer.json").resolve())
    hf_files.carry(f"hf:{folder}", run)
    (run / "config.toml").write_text(config_mod.to_toml(cfg))
    meta = {"model_args": args.to_dict(), "tokens": 0, "config": None, "precision": "fp32", "zero": 0,
            "scaler": None, "optimizer_step": 0, "mesh": {}, "converted_from": str(Path(folder).resolve())}
    return store.save(run, 0, tensors, meta)
