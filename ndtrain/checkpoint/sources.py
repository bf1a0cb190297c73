"""Where weights come from: a checkpoint of ours or a Hugging Face model folder, both seen as
global tensors made of pieces (checkpoint/slices.py), and `model.init_from`.

A `Source` answers one question, `fill(key, piece, data)`: copy into `data` the elements of
global tensor `key` ("weight/layers.0.attention.wq.weight") that `piece` covers, reading
only the rows they fall in. A checkpoint's pieces come from its meta.json; a Hugging Face
model's tensors are whole pieces found in the safetensors headers, renamed by
model/hf.py's tables.

`model.init_from = run:DIR | hf:DIR` starts a run from those weights on any layout (with a
fresh optimizer). `resolve_init_from(cfg)`, called before `validate`, makes the config's
model the source's (a model key that disagrees is an error naming it) and takes the source's
tokenizer unless `data.tokenizer` is set; each rank then reads only its slices.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from ndtrain.checkpoint import store
from ndtrain.checkpoint.files import Reader, SafetensorsError, header_of
from ndtrain.checkpoint.slices import Piece, copy_overlap, real_numel
from ndtrain.checkpoint.store import CheckpointError
from ndtrain.config import FAMILY_KEYS, Config, ConfigError, model_key_value
from ndtrain.model import hf
from ndtrain.model import hf_gpt_oss as gpt_oss
from ndtrain.model.args import ModelArgs


class Source:
    """Global tensors, each made of pieces that can be read a few rows at a time."""

    where = "source"

    def __init__(self):
        self.reader = Reader()
        self.index: dict[str, tuple[tuple[int, ...], list[tuple[Piece, object]]]] = {}
        self.dtypes: dict[str, set[str]] = {}  # the dtypes each tensor is stored in

    def has(self, kind: str) -> bool:
        return any(key.startswith(kind + "/") for key in self.index)

    def holds(self, key: str) -> bool:
        return key in self.index

    def fill(self, key: str, piece: Piece, data) -> None:
        if key not in self.index:
            raise CheckpointError(f"{self.where} holds no tensor {key}")
        shape, parts = self.index[key]
        if tuple(shape) != tuple(piece.shape):
            raise CheckpointError(f"{self.where}: {key} has shape {list(shape)}, this model's is {list(piece.shape)}")
        copied = sum(copy_overlap(piece, data, src, read) for src, read in parts)
        needed = real_numel(piece)
        if copied != needed:
            raise CheckpointError(f"{self.where}: the stored pieces of {key} cover {copied} of the {needed} "
                                  "elements this rank needs (a part is missing)")


class CheckpointSource(Source):
    def __init__(self, path: Path, meta: dict | None = None):
        super().__init__()
        self.path = Path(path)
        self.meta = meta if meta is not None else store.read_meta(self.path)
        self.where = f"checkpoint {self.path}"
        for key, t in self.meta["tensors"].items():
            parts = [(Piece.from_json(t["shape"], p), partial(self.reader.read, self.path / p["file"], p["key"]))
                     for p in t["pieces"]]
            self.index[key] = (tuple(t["shape"]), parts)
            self.dtypes[key] = {t.get("dtype")}


class HFSource(Source):
    """A Hugging Face causal-LM folder: config.json and safetensors weights (one file, or
    shards listed by model.safetensors.index.json). A fused HF tensor (Phi-3's qkv_proj,
    gate_up_proj) is read as several of ours, each a row range of it."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = Path(folder)
        self.where = f"Hugging Face model {self.folder}"
        refuse_adapter(self.folder)
        files = weight_files(self.folder)
        self.config = hf_config_of(self.folder)
        self.args = hf_args(self.folder, self.config)
        self.family = hf.family_of_config(self.config)
        self.hf_name: dict[str, str] = {}  # our key -> the HF tensor that holds it
        self.found: list[str] = []  # the HF tensors of the files
        self.stored: dict[str, tuple[Path, tuple[int, ...]]] = {}  # HF tensor -> its file and shape
        self._view: tuple[str, torch.Tensor] | None = None  # gpt_oss: the one view computed last
        found: dict[str, Path] = {}
        for file in files:
            try:
                header = header_of(file)
            except SafetensorsError as e:
                raise ConfigError(self.where, file.name, e.reason) from None
            except OSError as e:
                raise ConfigError(self.where, file.name, f"cannot be read ({e.strerror})") from None
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if name in found:
                    raise ConfigError(f"{self.where}: {name}", f"{found[name].name} and {file.name}",
                                      "is in two files; with no model.safetensors.index.json every *.safetensors "
                                      "file of the folder is read: remove the stray one")
                found[name] = file
                self.found.append(name)
                self.stored[name] = (file, tuple(info["shape"]))
                self._add(file, name, tuple(info["shape"]), info["dtype"])
        mtp = f"model.layers.{self.args.n_layers}."
        if self.family.deepseek and self.args.mtp_depth and not any(n.startswith(mtp) for n in self.found):
            # transformers' save_pretrained drops the MTP layer its config.json still counts
            self.args = replace(self.args, mtp_depth=0)
        self._check_mxfp4()

    def check(self, finite: bool = True) -> None:
        """Refuse, naming the tensor, weights that are not the model config.json describes
        (checkpoint/imports.py); with `finite`, also any NaN or infinite value."""
        from ndtrain.checkpoint.imports import check_finite, check_tensors, expected_shapes, missing_error
        wanted = {part.hf for key in expected_shapes(self.args) if key != "weight/output.weight" or
                  not self.args.tie_embeddings for part in hf.hf_parts(key[len("weight/"):], self.args, self.family)}
        missing = wanted - set(self.found)
        if missing:
            raise missing_error(self.where, missing, self.args)
        name_of = partial(self._hf_name_of)
        check_tensors(self, self.args, self.where, name_of)
        if finite:
            check_finite(self, self.where, name_of)

    def _hf_name_of(self, key: str) -> str:
        if key in self.hf_name:
            return self.hf_name[key]
        parts = hf.hf_parts(key[len("weight/"):], self.args, self.family)
        return parts[0].hf if len(parts) == 1 else f"{parts[0].hf} (experts 0-{len(parts) - 1})"

    def _add(self, file: Path, name: str, stored: tuple[int, ...], dtype: str) -> None:
        buffer = hf.our_buffer(name, self.args) if self.family.deepseek else None
        if buffer is not None:  # DeepSeek-V3's router bias: our router's expert_bias
            self.index[f"buffer/{buffer}"] = (stored, [(Piece.whole(stored), partial(self.reader.read, file, name))])
            return
        try:
            parts = hf.our_parts(name, self.args, self.family)
        except KeyError:
            raise ConfigError(f"{self.where}: {file.name}", name, f"no tensor of that name in a "
                              f"{self.family.model_type} model; a stray .safetensors file, or a model this "
                              "family does not describe") from None
        for ours, part in parts:
            self.dtypes.setdefault(f"weight/{ours}", set()).add(dtype)
            self.hf_name.setdefault(f"weight/{ours}", name if part.expert is None else
                                    re.sub(r"experts\.\d+\.", "experts.{j}.", name))
            if part.expert is not None and not 0 <= part.expert < self.args.moe_experts:
                raise ConfigError(f"{self.where}: {file.name}", name, f"an expert the config does not have (it "
                                  f"has {self.args.moe_experts})")
            if ours == "output.weight" and self.args.tie_embeddings:
                continue
            if part.layout or part.mxfp4:  # gpt_oss: a view of a whole HF tensor, maybe MXFP4
                self._add_view(ours, part, stored)
                continue
            read = partial(self.reader.read, file, name)
            if part.rows is not None:  # our tensor is rows of the fused one
                rows = parts[-1][1].rows[1]
                if stored[0] != rows:
                    raise CheckpointError(f"{self.where}: {name} has {stored[0]} rows, this model's "
                                          f"{', '.join(o for o, _ in parts)} need {rows}")
                inner = math.prod(stored[1:])
                shape = (part.rows[1] - part.rows[0], *stored[1:])
                self.index[f"weight/{ours}"] = (shape, [(Piece.whole(shape), _shifted(read, part.rows[0] * inner))])
            elif part.expert is None:
                self.index[f"weight/{ours}"] = (stored, [(Piece.whole(stored), read)])
            else:  # one expert of our stack [E, ...]: the piece [expert]
                shape = (self.args.moe_experts, *stored)
                piece = Piece(shape, (part.expert,) + (0,) * len(stored), (1, *stored))
                self.index.setdefault(f"weight/{ours}", (shape, []))[1].append((piece, read))


    def _add_view(self, ours: str, part, stored: tuple[int, ...]) -> None:
        """Our tensor as a view of a whole gpt_oss tensor (model/hf_gpt_oss.py): transposed,
        gate or up of the interleaved pair, dequantized from MXFP4; computed when first read
        (the last one kept, for the reads that follow)."""
        key = f"weight/{ours}"
        whole = gpt_oss.mxfp4_shape(stored) if part.mxfp4 else stored
        shape = gpt_oss.ours_shape(part.layout, whole)
        if part.mxfp4:
            self.found.append(part.hf[:-len("_blocks")])  # what hf_parts names: the matrix itself
            self.dtypes[key] = {"BF16"}  # e2m1 × 2^k: exact in bf16

        def read(lo: int, hi: int) -> torch.Tensor:
            if self._view is None or self._view[0] != key:
                t = self._whole(part.hf)
                if part.mxfp4:  # its scales are there (_check_mxfp4)
                    t = gpt_oss.dequantize_mxfp4(t, self._whole(part.hf[:-len("_blocks")] + "_scales"))
                self._view = (key, gpt_oss.ours_from_hf(part.layout, t).reshape(-1))
            return self._view[1][lo:hi]
        self.index[key] = (shape, [(Piece.whole(shape), read)])

    def _check_mxfp4(self) -> None:
        """Each MXFP4 *_blocks [E, rows, G, 16] of gpt_oss has its *_scales [E, rows, G]."""
        if self.family.model_type != "gpt_oss":
            return
        for name, (file, shape) in self.stored.items():
            if not name.endswith("_blocks"):
                continue
            scales = self.stored.get(name[:-len("_blocks")] + "_scales")
            if scales is None or scales[1] != shape[:-1] or shape[-1:] != (16,):
                raise ConfigError(f"{self.where}: {file.name}", name, "MXFP4 blocks [..., G, 16] need their "
                                  f"{name[:-len('_blocks')]}_scales [..., G] beside them; found "
                                  f"{list(scales[1]) if scales else 'none'} for blocks {list(shape)}")

    def _whole(self, name: str) -> torch.Tensor:
        file, shape = self.stored[name]
        return self.reader.read(file, name, 0, math.prod(shape)).view(shape)


def _shifted(read, offset: int):
    return lambda lo, hi: read(lo + offset, hi + offset)


def refuse_adapter(folder: Path) -> None:
    """A LoRA adapter's folder is not a model (ConfigError)."""
    adapter = [p.name for p in (folder / "adapter_config.json", folder / "adapter_model.safetensors") if p.is_file()]
    if adapter:
        raise ConfigError(f"Hugging Face model {folder}", adapter[0], "is a LoRA adapter, not a model: merge it "
                          "into its base model first (peft: merge_and_unload(), then save_pretrained) and use that")


def hf_config_of(folder: Path) -> dict:
    """config.json of a HF model folder, refusing a LoRA adapter's folder first."""
    folder = Path(folder)
    refuse_adapter(folder)
    config = json_object(folder / "config.json", f"Hugging Face model {folder}")
    if not isinstance(config, dict):
        raise ConfigError(f"Hugging Face model {folder}", "config.json", "is not a JSON object")
    return config


def json_object(path: Path, where: str):
    """The JSON value of a file; a missing, unreadable or non-JSON file is a ConfigError."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(where, Path(path).name, "is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConfigError(where, Path(path).name, f"is not a JSON file ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else 'unreadable'})") from None


def hf_args(folder: Path, config: dict | None = None) -> ModelArgs:
    """The model of a HF folder; a config we cannot read is a ConfigError naming its key."""
    config = hf_config_of(folder) if config is None else config
    try:
        return hf.args_from_hf_config(config)
    except hf.HFConfigError as e:
        raise ConfigError(f"Hugging Face model {folder}: config.json {e.key}", e.value, e.rule) from None


def weight_files(folder: Path) -> list[Path]:
    index = Path(folder) / "model.safetensors.index.json"
    if index.is_file():
        weight_map = (json_object(index, f"Hugging Face model {folder}") or {})
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v and Path(v).name == v
                                                       for v in weight_map.values()):
            raise ConfigError(f"Hugging Face model {folder}", index.name, "has no weight_map naming each tensor's "
                              "file of this folder (a JSON object of names to file names)")
        names = sorted(set(weight_map.values()))
        files = [Path(folder) / n for n in names]
    else:
        files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"Hugging Face model {folder}", "*.safetensors", "none there (only safetensors weights "
                          "are read)")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"Hugging Face model {folder}", missing[0], "is missing (model.safetensors.index.json "
                          "names it)")
    return files


VOCAB_KEYS = ("weight/tok_embeddings.weight", "weight/output.weight")


def grow_vocab(source: Source, vocab_size: int) -> None:
    """Let `source` fill a model whose vocabulary has `vocab_size` rows where the source's
    embedding (and head) have fewer: tokens added since, such as a chat template's special
    tokens. The source's rows are read as they are; every added row is the mean of the
    source's rows, so an added token starts as an average one (what Hugging Face's
    `resize_token_embeddings` does by default)."""
    for key in VOCAB_KEYS:
        if key not in source.index or source.index[key][0][0] >= vocab_size:
            continue
        shape, parts = source.index[key]
        grown = (vocab_size, *shape[1:])
        mean: list[torch.Tensor] = []

        def added_rows(lo: int, hi: int, shape=shape, parts=parts, mean=mean) -> torch.Tensor:
            if not mean:  # read once, by the ranks that hold an added row
                whole = torch.empty(math.prod(shape), dtype=torch.float32)
                for piece, read in parts:
                    copy_overlap(Piece.whole(shape), whole, piece, read)
                mean.append(whole.view(shape).mean(0).repeat(vocab_size - shape[0]))
            return mean[0][lo:hi]

        extra = Piece(grown, (shape[0],) + (0,) * (len(shape) - 1), (vocab_size - shape[0], *shape[1:]))
        source.index[key] = (grown, [(replace(p, shape=grown), read) for p, read in parts] + [(extra, added_rows)])


# --------------------------------------------------------------------------- model.init_from

KINDS = ("run", "hf")
# ModelArgs fields that are config keys of the same name and fix the parameters' shapes.
SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "head_dim", "qkv_bias",
              "qk_norm", "tie_embeddings", "rope_theta", "norm_eps") + FAMILY_KEYS + (
              "attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "rope_interleave", "mtp_depth")
# ... and those of a mixture-of-experts model (set only from an MoE source).
MOE_KEYS = ("moe_experts", "moe_top_k", "moe_shared_experts", "moe_ffn_dim", "moe_every", "moe_router",
            "moe_norm_topk", "moe_route_scale", "moe_capacity", "moe_groups", "moe_topk_groups", "first_k_dense",
            "moe_router_bias", "moe_expert_bias", "moe_swiglu_limit")


def parse_init_from(value: str) -> tuple[str, Path]:
    kind, sep, path = value.partition(":")
    if not sep or kind not in KINDS or not path:
        raise ConfigError("model.init_from", value, "expected run:DIR (an ndtrain run or checkpoint) or hf:DIR "
                          "(a Hugging Face model folder)")
    return kind, Path(path).expanduser()


def newest_readable(run_dir: Path) -> Path | None:
    """The newest checkpoint whose meta.json parses and whose files have their sizes (the
    cheap checks; the ranks verify the checksums before reading)."""
    for path in store.steps_of(run_dir):
        try:
            if store.size_problem(path, store.read_meta(path)) is None:
                return path
        except CheckpointError:
            continue
    return None


def init_checkpoint(path: Path) -> Path | None:
    """A run's newest readable checkpoint, or `path` itself when it is a checkpoint folder."""
    return path if (path / "meta.json").is_file() else newest_readable(path)


def source_args(value: str) -> tuple[ModelArgs, Path | None]:
    """The model of `model.init_from` and its tokenizer.json (None if it has none).
    Raises ConfigError naming model.init_from."""
    kind, path = parse_init_from(value)
    if not path.is_dir():
        raise ConfigError("model.init_from", value, "no such directory")
    try:
        if kind == "hf":  # every tensor checked here, so a bad folder is refused before anything is written
            tokenizer = path / "tokenizer.json"
            source = HFSource(path)
            source.check()
            return source.args, tokenizer if tokenizer.is_file() else None
        checkpoint = init_checkpoint(path)
        if checkpoint is None:
            raise CheckpointError(f"{path} holds no usable checkpoint")
        run_dir = path if checkpoint != path else path.parent.parent
        tokenizer = run_dir / "tokenizer.json"
        return checked_run_source(checkpoint), tokenizer if tokenizer.is_file() else None
    except CheckpointError as e:
        raise ConfigError("model.init_from", value, str(e)) from None


def checked_run_source(checkpoint: Path) -> ModelArgs:
    """The model of a checkpoint of ours, after the checks an import gets (checkpoint/imports.py)."""
    from ndtrain.checkpoint.imports import check_args, check_finite, check_tensors
    meta = store.read_meta(checkpoint)
    where = f"checkpoint {checkpoint}"
    try:
        args = ModelArgs(**meta["model_args"])
        source = CheckpointSource(checkpoint, meta)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{where}: meta.json is damaged ({type(e).__name__}: {e})") from None
    check_args(args, where, "meta.json model_args")
    check_tensors(source, args, where)
    check_finite(source, where)
    return args


def resolve_init_from(cfg: Config) -> None:
    """Make `cfg`'s model the one `model.init_from` holds, and its tokenizer the source's
    unless data.tokenizer is set. A model key set to another value is an error naming it."""
    if not cfg.model.init_from:
        return
    args, tokenizer = source_args(cfg.model.init_from)
    if args.lora_rank:  # its base weights alone are not the model it trained
        raise ConfigError("model.init_from", cfg.model.init_from, "holds LoRA adapters; start from its merged "
                          "weights: ndtrain convert --to-hf RUN --out DIR, then model.init_from=hf:DIR")
    for key in SHAPE_KEYS + (MOE_KEYS if args.is_moe else ()):
        mine, theirs = getattr(cfg.model, key), model_key_value(args, key)
        if mine is not None and mine != theirs:
            raise ConfigError(f"model.{key}", mine, f"differs from the model of model.init_from ({theirs}); "
                              "leave it out to take the source's")
        setattr(cfg.model, key, theirs)
    if cfg.model.max_seq_len is None:
        cfg.model.max_seq_len = args.max_seq_len
    if not cfg.data.tokenizer:
        if tokenizer is None:
            raise ConfigError("model.init_from", cfg.model.init_from, "has no tokenizer.json; set data.tokenizer "
                              "to the tokenizer the model was trained with")
        cfg.data.tokenizer = str(tokenizer)


def open_init_source(value: str, report=print) -> Source:
    """The source of `model.init_from`, in the ranks: a run's newest checkpoint that passes
    its checks (collective), or the Hugging Face folder."""
    kind, path = parse_init_from(value)
    if kind == "hf":
        return HFSource(path)
    if (path / "meta.json").is_file():
        reason = store.problem(path)
        if reason:
            raise CheckpointError(f"model.init_from: {reason}")
        return CheckpointSource(path)
    checkpoint = store.select(path, report)
    if checkpoint is None:
        raise CheckpointError(f"model.init_from: {path} holds no usable checkpoint")
    return CheckpointSource(checkpoint)
