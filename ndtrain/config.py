"""Typed configuration: TOML file + dotted KEY=VALUE overrides, checked before any process starts.

A config is five sections (model, parallel, train, data, run) of plain dataclasses. Values
come from the defaults, then a TOML file, then command-line overrides. `validate()` turns
every mistake we can see up front into a `ConfigError`: one line naming the key, the value
and the rule. The CLI prints it and exits with status 2 before writing anything.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tempfile
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ndtrain.model.args import PRESETS, ROUTERS, ModelArgs


class ConfigError(ValueError):
    """A configuration mistake. `str(err)` is the one line shown to the user."""

    def __init__(self, key: str, value: Any, rule: str):
        self.key, self.value, self.rule = key, value, rule
        shown = f"{value!r}" if isinstance(value, str) else f"{value}"
        super().__init__(f"{key} = {shown}: {rule}")


@dataclass
class ModelConfig:
    preset: str = "small"
    # None means "take it from the preset"; vocab_size None means "from the tokenizer".
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    vocab_size: int | None = None
    max_seq_len: int | None = None
    rope_theta: float | None = None
    tie_embeddings: bool | None = None
    head_dim: int | None = None  # None = dim / n_heads
    norm_eps: float | None = None
    qkv_bias: bool | None = None  # biases on q, k, v (Qwen2)
    qk_norm: bool | None = None  # RMSNorm of each query and key head (Qwen3)
    dropout: float = 0.0
    # Mixture of experts (model/moe.py): only on an MoE preset (tiny-moe, olmoe-1b-7b).
    moe_experts: int | None = None
    moe_top_k: int | None = None
    moe_shared_experts: int | None = None
    moe_ffn_dim: int | None = None
    moe_every: int | None = None  # block i is MoE when (i + 1) % moe_every == 0
    moe_router: str | None = None  # softmax_topk | topk_softmax | sigmoid
    moe_norm_topk: bool | None = None
    moe_route_scale: float | None = None
    moe_capacity: float | None = None  # capacity factor; 0 = dropless
    # "" = random init (ndtrain sft: the default pretraining run; "scratch" = random init);
    # run:DIR (an ndtrain run or checkpoint) or hf:DIR (a HF model folder)
    init_from: str = ""


@dataclass
class ParallelConfig:
    dp: int = 0  # total data-parallel size dp_replicate × dp_shard; 0 = every process left over
    dp_replicate: int = 1
    tp: int = 1
    sp: bool | None = None  # sequence parallelism; None = on whenever tp > 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    pp_split: str = ""  # blocks per pipeline chunk, e.g. "3,5,5,3"; "" = balanced by cost
    cp: int = 1
    cp_impl: str = "ring"  # context-parallel attention: ring | allgather | ulysses
    ep: int = 1  # experts split over ep ranks of dp_shard × cp
    zero: int = 0  # ZeRO stage over dp_shard: 0 (plain DP), 1 (optimizer), 2 (+ gradients), 3 (+ parameters)
    reshard_after_forward: bool = True  # zero=3: free each block after its forward (false: keep until backward)
    bucket_mb: float = 25.0

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp


@dataclass
class TrainConfig:
    steps: int = 400
    global_batch: int = 16  # sequences per optimizer step, over all data-parallel ranks
    micro_batch: int = 0  # sequences per forward/backward on one rank; 0 = no accumulation
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = no clipping
    seed: int = 0
    precision: str = "fp32"  # compute dtype: fp32 | bf16 | fp16 (the optimizer keeps fp32 masters) | fp64 (CPU proofs)
    reduce_fp32: bool = True  # reduce gradients in fp32; false: in train.precision, half the bytes
    loss_scaler: bool = True  # fp16: dynamic loss scaling
    allow_unscaled_fp16: bool = False  # permit fp16 with loss_scaler = false
    loss_scale_init: float = 65536.0
    loss_scale_window: int = 1000  # good steps before the loss scale doubles
    loss_scale_min: float = 1.0  # an overflow at this scale stops the run
    recompute: str = "none"  # none | full | selective (attention core) | every:K (blocks 0, K, 2K, ...)
    compile: bool = False  # torch.compile each decoder block and the loss (parallel/compile.py)
    compile_backend: str = "inductor"  # inductor | aot_eager (no code generation: the proofs) | eager
    moe_aux_loss: float = 0.01  # coefficient of the MoE load-balancing loss; 0 = none
    moe_bias_rate: float = 0.0  # aux-loss-free balancing: router bias step per optimizer step; 0 = off
    eval_every: int = 100  # 0 = evaluate only at the end
    eval_batches: int = 8
    save_every: int = 0  # 0 = save only at the end
    keep_checkpoints: int = 0  # keep the newest N checkpoints (the one just written always); 0 = keep all
    log_every: int = 10

    def accumulation(self, dp: int) -> int:
        return self.global_batch // (dp * self.micro_batch)


@dataclass
class DataConfig:
    path: str = "stdlib"  # "stdlib", a text/JSONL file or folder, or a prepared folder
    tokenizer: str = ""  # "" = train a byte-level BPE on the training split; or a tokenizer.json
    vocab_size: int = 4096  # size of the BPE trained when no tokenizer is given
    val_fraction: float = 0.05
    jsonl_key: str = "text"
    cache_dir: str = "~/.cache/ndtrain"
    # Supervised fine-tuning (ndtrain sft):
    packing: str = "bfd"  # bfd: several examples per row (best-fit decreasing); none: one per row, padded
    truncate: str = "keep_start"  # an example longer than train.seq_len: keep_start (cut its end) | drop
    on_bad_record: str = "error"  # a malformed record: error (stop, naming file:line) | skip (count it)
    template: str = "auto"  # builtin (our special tokens) | hf (the tokenizer's chat_template) | auto


@dataclass
class SFTConfig:
    generate: int = 0  # held-out prompts answered greedily after training (0 = none)
    max_new_tokens: int = 128
    score: str = "exact"  # exact (answer == reference) | MODULE:FUNCTION(prompt, completion, reference) -> float


@dataclass
class RLConfig:
    # What is asked: a built-in verifiable task (data/verifiable.py), drawn on the fly
    task: str = "addition"  # addition | reverse | sort | countdown
    size: int = 2  # digits per operand (addition), letters (reverse), list length (sort), numbers (countdown)
    reverse_answer: bool = True  # addition: the sum's digits least significant first
    reward: str = "builtin"  # builtin (the task's check) | MODULE:FUNCTION(prompt, completion, answer) -> number
    format_reward: float = 0.0  # builtin: added for a well-formed answer (correctness scores 1)
    # Rollouts
    group_size: int = 8  # completions sampled per prompt
    max_new_tokens: int = 6
    temperature: float = 1.0
    top_k: int = 0  # 0 = the whole vocabulary
    top_p: float = 1.0
    # The update
    loss: str = "grpo"  # reinforce | grpo | dr_grpo | dapo
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float | None = None  # None = 0.28 for dapo (clip-higher), clip_low otherwise
    kl_coef: float = 0.0  # β of the k3 KL to the frozen reference (the starting policy)
    ppo_epochs: int = 1  # updates per rollout batch (old log-probs kept)
    max_refills: int = 4  # dapo: extra rollout rounds to replace groups whose rewards are all equal
    overlong_buffer: int | None = None  # length penalty over the last N of max_new_tokens; None = dapo: a quarter, else 0
    shuffle_rewards: bool = False  # a negative control: rewards permuted over the batch before use
    logprob_tol: float = 1e-3  # fp32/fp64: largest |rollout − training| log-prob gap before stopping
    # Evaluation on held-out prompts (every train.eval_every steps and at the end)
    eval_prompts: int = 200  # held-out prompts, answered greedily (pass@1) and pass_k times
    pass_k: int = 4  # samples per prompt for pass@k (0 = none)
    # The default job's warm-up (model.init_from empty): SFT on the task through the SFT task
    warmup_steps: int = 350
    warmup_examples: int = 20000


@dataclass
class RunConfig:
    dir: str = ""  # "" = runs/<task>-<date>-<time>
    resume: str = "auto"  # auto: continue if run.dir holds a checkpoint; true: must; false: must not
    nproc: int = 0  # 0 = the product of the parallel sizes, or 2 CPU processes / every local GPU
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 0  # torch threads per rank on the CPU; 0 = cores / local ranks
    stop_after: int = 0  # stop (with a checkpoint) after this many steps in this invocation; 0 = never
    stop_after_s: float = 0.0  # stop (with a checkpoint) at the first step boundary after this many seconds of training in this invocation; 0 = never
    max_restarts: int = 0  # local launcher: restart every rank this often after one dies or hangs (last good checkpoint)
    heartbeat_s: float = 600.0  # local launcher: a rank that reports no progress for this long is hung; 0 = never
    collective_timeout_s: float = 600.0  # a collective not complete after this fails, naming it, its group and the rank
    progress: bool = True
    plot: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    run: RunConfig = field(default_factory=RunConfig)

    # The dotted keys the user set (in the file or on the command line), filled by
    # `load_config`; not a field, so it stays out of `to_dict` and config.toml.
    explicit = frozenset()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def copy(self) -> "Config":
        out = from_dict(self.to_dict())
        out.explicit = self.explicit
        return out

    def model_args(self, vocab_size: int | None = None) -> ModelArgs:
        """The model shape: the preset with this config's overrides applied."""
        m = self.model
        base = PRESETS[m.preset]
        changes = {f.name: getattr(m, f.name) for f in fields(m)
                   if f.name not in ("preset", "init_from") and getattr(m, f.name) is not None}
        if vocab_size is not None and m.vocab_size is None:
            changes["vocab_size"] = vocab_size
        if "max_seq_len" not in changes:
            changes["max_seq_len"] = max(base.max_seq_len, self.train.seq_len)
        return base.with_(**changes)


# `ndtrain sft`'s own defaults, applied before --config and KEY=VALUE (configs/sft.toml
# lists them): the embedded instruction set, longer rows than pretraining, a lower rate.
SFT_DEFAULTS = ["data.path=stdlib-functions", "train.seq_len=256", "train.steps=200", "train.lr=1e-3",
                "train.warmup=10", "train.eval_every=50", "train.eval_batches=16", "sft.generate=4"]

# `ndtrain rl`'s own defaults (configs/rl.toml lists them): a batch of 64 prompts × 8
# completions, a constant learning rate, held-out evaluation every 25 updates; the rows'
# length (train.seq_len) follows from the task unless given.
RL_DEFAULTS = ["train.steps=300", "train.global_batch=512", "train.lr=1e-4", "train.warmup=0", "train.min_lr_ratio=1.0",
               "train.weight_decay=0.0", "train.eval_every=25", "train.eval_batches=0", "train.log_every=5"]

SECTIONS = {f.name: f.type for f in fields(Config)}
_SECTION_CLASSES = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig,
                    "data": DataConfig, "sft": SFTConfig, "rl": RLConfig, "run": RunConfig}


def all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in _SECTION_CLASSES.items() for f in fields(cls)]


def _field_type(section: str, name: str):
    hints = typing.get_type_hints(_SECTION_CLASSES[section])
    return hints[name]


def _unknown_key(key: str, value: Any = "…") -> ConfigError:
    near = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
    if not near:  # a right name in the wrong section, or a typo of the name alone
        names = {k.split(".", 1)[1]: k for k in all_keys()}
        tail = key.split(".")[-1]
        close = difflib.get_close_matches(tail, list(names), n=1, cutoff=0.6)
        near = [names[close[0]]] if close else []
    hint = f"; did you mean {near[0]}?" if near else f"; valid sections are {', '.join(SECTIONS)}"
    return ConfigError(key, value, f"unknown key{hint}")


# --------------------------------------------------------------------------- coercion

_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _base_type(tp) -> tuple[type, bool]:
    """(the concrete type, whether None is allowed) for `int`, `int | None` and the like."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _coerce_text(key: str, text: str, tp) -> Any:
    """A command-line value (always text) to the key's type."""
    base, optional = _base_type(tp)
    low = text.strip().lower()
    if optional and low in ("none", "null", "preset", "auto", ""):
        return None
    try:
        if base is bool:
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if base is int:
            return int(text.replace("_", ""))
        if base is float:
            value = float(text)
            if not math.isfinite(value):
                raise ValueError
            return value
    except ValueError:
        raise ConfigError(key, text, f"expected {_TYPE_WORDS[base]}") from None
    return text


def _coerce_value(key: str, value: Any, tp) -> Any:
    """A TOML value (already typed) to the key's type, refusing silent conversions."""
    base, optional = _base_type(tp)
    if isinstance(value, str) and base is not str:
        if optional and value.strip().lower() in ("none", "preset", "auto", ""):
            return None
        raise ConfigError(key, value, f"expected {_TYPE_WORDS[base]}")
    if base is bool and not isinstance(value, bool):
        raise ConfigError(key, value, "expected true or false")
    if base is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(key, value, "expected an integer")
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, value, "expected a number")
        value = float(value)
        if not math.isfinite(value):  # TOML has nan and inf; no key means either
            raise ConfigError(key, value, "expected a finite number")
    if base is str:
        if isinstance(value, bool):  # resume = true in a file means the word "true"
            return "true" if value else "false"
        if not isinstance(value, str):
            raise ConfigError(key, value, "expected a string")
    return value


def _set(cfg: Config, key: str, value: Any, *, from_text: bool) -> None:
    parts = key.split(".")
    if len(parts) != 2 or parts[0] not in _SECTION_CLASSES:
        raise _unknown_key(key, value)
    section, name = parts
    obj = getattr(cfg, section)
    if name not in {f.name for f in fields(obj)}:
        raise _unknown_key(key, value)
    tp = _field_type(section, name)
    value = _coerce_text(key, value, tp) if from_text else _coerce_value(key, value, tp)
    setattr(obj, name, value)


def from_dict(data: dict, base: list[str] | tuple = ()) -> Config:
    cfg = Config()
    for item in base:
        key, value = item.split("=", 1)
        _set(cfg, key, value, from_text=True)
    for section, values in data.items():
        if section not in _SECTION_CLASSES:
            near = difflib.get_close_matches(section, list(_SECTION_CLASSES), n=1)
            hint = f"did you mean [{near[0]}]?" if near else f"valid sections are {', '.join(SECTIONS)}"
            raise ConfigError(f"[{section}]", "table", f"unknown section; {hint}")
        if not isinstance(values, dict):
            raise ConfigError(section, values, "expected a table of keys")
        for name, value in values.items():
            if value is None:
                continue
            _set(cfg, f"{section}.{name}", value, from_text=False)
    return cfg


def _read_toml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError("--config", str(path), "file does not exist")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError("--config", str(path), f"cannot be read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError("--config", str(path), "is not a UTF-8 text file (a TOML config is text)") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("--config", str(path), f"not valid TOML ({e})") from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = (),
                defaults: list[str] | tuple = ()) -> Config:
    """Defaults (the code's, then a command's own `defaults`, KEY=VALUE), then the TOML
    file, then KEY=VALUE overrides. Raises ConfigError. `cfg.explicit` holds the keys the
    file and the overrides set."""
    data: dict = _read_toml(path) if path is not None else {}
    cfg = from_dict(data, base=defaults)
    explicit = {f"{s}.{k}" for s, values in data.items() for k, v in values.items() if v is not None}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, item, "expected KEY=VALUE, e.g. train.steps=100")
        key, value = item.split("=", 1)
        _set(cfg, key.strip(), value, from_text=True)
        explicit.add(key.strip())
    cfg.explicit = frozenset(explicit)
    return cfg


# --------------------------------------------------------------------------- TOML output

def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    text = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def to_toml(cfg: Config) -> str:
    """The config as TOML. Keys whose value is None ("from the preset") are left out."""
    out = []
    for section, values in cfg.to_dict().items():
        out.append(f"[{section}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
        out.append("")
    return "\n".join(out)


# --------------------------------------------------------------------------- validation

PRECISIONS = ("fp32", "bf16", "fp16", "fp64")
PACKINGS = ("bfd", "none")
TRUNCATIONS = ("keep_start", "drop")
BAD_RECORD_POLICIES = ("error", "skip")
TEMPLATES = ("auto", "builtin", "hf")
EMBEDDED_DATA = ("stdlib", "stdlib-functions")  # pretraining corpus, SFT instruction set
PP_SCHEDULES = ("afab", "1f1b", "interleaved", "zb")
_RECOMPUTE = re.compile(r"^(none|full|selective|every:(-?\d+))$")

# Dimensions whose implementation has not landed yet: refused up front, never half-run.
NOT_YET: dict[str, str] = {}  # every dimension has landed
MOE_KEYS = tuple(f.name for f in fields(ModelConfig) if f.name.startswith("moe_"))
CP_IMPLS = ("ring", "allgather", "ulysses")
RL_TASKS = ("addition", "reverse", "sort", "countdown")
RL_LOSSES = ("reinforce", "grpo", "dr_grpo", "dapo")
RL_SIZES = {"addition": (1, 9), "reverse": (2, 30), "sort": (2, 20), "countdown": (2, 6)}


def _positive(key: str, value, *, zero_ok: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(key, value, "must be >= 0" if zero_ok else "must be > 0")


def resolve_world(cfg: Config, world: int | None) -> None:
    """Fill parallel.dp and run.nproc from each other and check their product.

    `world` is the process count imposed from outside (torchrun/SLURM), or None locally.
    """
    p, run = cfg.parallel, cfg.run
    fixed = p.pp * p.cp * p.tp
    nproc = world or run.nproc
    if p.dp == 0:
        if nproc == 0:
            nproc = fixed * default_local_processes(run.device)
        if nproc % fixed:
            raise ConfigError("run.nproc", nproc,
                              f"must be a multiple of pp×cp×tp = {p.pp}×{p.cp}×{p.tp} = {fixed}")
        p.dp = nproc // fixed
    if nproc == 0:
        nproc = p.world
    if p.world != nproc:
        source = "the launcher's WORLD_SIZE" if world else "run.nproc (--nproc)"
        raise ConfigError("parallel", f"pp×dp×cp×tp = {p.pp}×{p.dp}×{p.cp}×{p.tp} = {p.world}",
                          f"must equal the process count, {nproc} from {source}")
    run.nproc = nproc


def _uses_cuda(device: str) -> bool:
    if device == "cuda":
        return True
    if device != "auto":
        return False
    import torch
    return torch.cuda.is_available()


def default_local_processes(device: str) -> int:
    import torch
    if device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2


COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def _check_compile(cfg: Config) -> None:
    """train.compile: a known backend; not with the zero-bubble schedule (a compiled block's
    backward is one node, which cannot be split into input and weight parts); Inductor on
    the CPU needs a C++ compiler."""
    t, p = cfg.train, cfg.parallel
    if t.compile_backend not in COMPILE_BACKENDS:
        raise ConfigError("train.compile_backend", t.compile_backend, f"choose one of {', '.join(COMPILE_BACKENDS)}")
    if not t.compile:
        return
    if p.pp > 1 and p.pp_schedule == "zb":
        raise ConfigError("train.compile", True, "cannot compile under parallel.pp_schedule=zb: zero bubble "
                          "splits each backward into input and weight parts, which a compiled block computes "
                          "in one node; use 1f1b, afab or interleaved, or train.compile=false")
    if t.compile_backend == "inductor" and not _uses_cuda(cfg.run.device):
        import shutil
        if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
            raise ConfigError("train.compile", True, "Inductor on the CPU needs a C++ compiler (g++, c++ or "
                              "clang++) on PATH; install one or set train.compile_backend=aot_eager")


def validate(cfg: Config, *, world: int | None = None, check_paths: bool = True) -> Config:
    """Check everything that can be checked before a process starts; fills derived values
    (parallel.dp, run.nproc, train.micro_batch, parallel.sp). Raises the first ConfigError."""
    m, p, t, d, r = cfg.model, cfg.parallel, cfg.train, cfg.data, cfg.run

    if m.preset not in PRESETS:
        raise ConfigError("model.preset", m.preset, f"unknown preset; choose one of {', '.join(PRESETS)}")
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len", "head_dim"):
        _positive(f"model.{key}", getattr(m, key))
    for key in ("rope_theta", "norm_eps"):
        if getattr(m, key) is not None:
            _positive(f"model.{key}", getattr(m, key))
    if m.init_from:
        kind, _, path = m.init_from.partition(":")
        if kind not in ("run", "hf") or not path:
            raise ConfigError("model.init_from", m.init_from, "expected run:DIR (an ndtrain run or checkpoint) "
                              "or hf:DIR (a Hugging Face model folder)")
        if check_paths and not Path(os.path.expanduser(path)).is_dir():
            raise ConfigError("model.init_from", m.init_from, "no such directory")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError("model.dropout", m.dropout, "must be in [0, 1)")

    for key in ("pp", "dp_replicate", "tp", "cp", "ep", "pp_virtual"):
        _positive(f"parallel.{key}", getattr(p, key))
    _positive("parallel.dp", p.dp, zero_ok=True)
    for key, what in NOT_YET.items():
        value = getattr(p, key.split(".")[1])
        if value != 1:
            raise ConfigError(key, value, f"{what} is not implemented yet; use 1")
    if p.zero not in (0, 1, 2, 3):
        raise ConfigError("parallel.zero", p.zero, "choose a ZeRO stage: 0, 1, 2 or 3")
    if p.cp_impl not in CP_IMPLS:
        raise ConfigError("parallel.cp_impl", p.cp_impl, f"choose one of {', '.join(CP_IMPLS)}")
    if p.pp_schedule not in PP_SCHEDULES:
        raise ConfigError("parallel.pp_schedule", p.pp_schedule, f"unknown schedule; choose one of {', '.join(PP_SCHEDULES)}")
    _positive("parallel.bucket_mb", p.bucket_mb)

    _positive("train.steps", t.steps)
    _positive("train.seq_len", t.seq_len)
    _positive("train.lr", t.lr)
    _positive("train.global_batch", t.global_batch)
    _positive("train.micro_batch", t.micro_batch, zero_ok=True)
    for key in ("warmup", "eval_every", "save_every", "eval_batches", "grad_clip", "weight_decay"):
        _positive(f"train.{key}", getattr(t, key), zero_ok=True)
    _positive("train.log_every", t.log_every)
    if not 0 <= t.seed < 2**32:
        raise ConfigError("train.seed", t.seed, "must be in [0, 2**32)")
    _positive("train.eps", t.eps)
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError("train.min_lr_ratio", t.min_lr_ratio, "must be in [0, 1]")
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(t, key) < 1.0:
            raise ConfigError(f"train.{key}", getattr(t, key), "must be in [0, 1)")
    if t.precision not in PRECISIONS:
        raise ConfigError("train.precision", t.precision, f"choose one of {', '.join(PRECISIONS)}")
    if t.precision == "fp64" and _uses_cuda(r.device):
        raise ConfigError("train.precision", t.precision, "fp64 is for the CPU layout proofs (run.device=cpu); "
                          "on a GPU use fp32, bf16 or fp16")
    if t.precision == "fp16" and not t.loss_scaler and not t.allow_unscaled_fp16:
        raise ConfigError("train.loss_scaler", False, "fp16 without loss scaling flushes small gradients "
                          "to zero; keep it on, or set train.allow_unscaled_fp16=true to insist")
    for key in ("loss_scale_init", "loss_scale_min"):
        value = getattr(t, key)
        _positive(f"train.{key}", value)
        if not math.log2(value).is_integer():
            raise ConfigError(f"train.{key}", value, "must be a power of two (so scaling is exact)")
    _positive("train.loss_scale_window", t.loss_scale_window)
    if t.loss_scale_init < t.loss_scale_min:
        raise ConfigError("train.loss_scale_init", t.loss_scale_init,
                          f"must be at least train.loss_scale_min = {t.loss_scale_min}")
    match = _RECOMPUTE.match(t.recompute)
    if not match:
        raise ConfigError("train.recompute", t.recompute, "choose none, full, selective or every:K")
    if match.group(2) is not None and int(match.group(2)) < 1:
        raise ConfigError("train.recompute", t.recompute, "every:K needs K >= 1 (every:1 = full)")

    _check_compile(cfg)
    if r.device not in ("auto", "cpu", "cuda"):
        raise ConfigError("run.device", r.device, "choose auto, cpu or cuda")
    if r.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ConfigError("run.device", r.device, "no CUDA device is available")
    if r.resume not in ("auto", "true", "false"):
        raise ConfigError("run.resume", r.resume, "choose auto, true or false")
    _positive("run.nproc", r.nproc, zero_ok=True)
    _positive("run.threads", r.threads, zero_ok=True)
    cores = os.cpu_count() or 1
    if r.threads > cores:
        raise ConfigError("run.threads", r.threads, f"must be at most this machine's {cores} CPU cores")
    _positive("run.stop_after", r.stop_after, zero_ok=True)
    _positive("run.stop_after_s", r.stop_after_s, zero_ok=True)
    _positive("run.max_restarts", r.max_restarts, zero_ok=True)
    _positive("run.heartbeat_s", r.heartbeat_s, zero_ok=True)
    _positive("run.collective_timeout_s", r.collective_timeout_s)
    _positive("train.keep_checkpoints", t.keep_checkpoints, zero_ok=True)

    # The layout: process count, batch split, head split.
    if p.dp and p.dp % p.dp_replicate:
        raise ConfigError("parallel.dp_replicate", p.dp_replicate, f"must divide parallel.dp = {p.dp}")
    resolve_world(cfg, world)
    if p.dp % p.dp_replicate:
        raise ConfigError("parallel.dp_replicate", p.dp_replicate, f"must divide parallel.dp = {p.dp}")
    if t.micro_batch == 0:
        if t.global_batch % p.dp:
            raise ConfigError("train.global_batch", t.global_batch, f"must be divisible by parallel.dp = {p.dp}")
        t.micro_batch = t.global_batch // p.dp
    if t.global_batch % (p.dp * t.micro_batch):
        raise ConfigError("train.global_batch", t.global_batch,
                          f"must be divisible by dp × micro_batch = {p.dp} × {t.micro_batch} = {p.dp * t.micro_batch}")
    if p.sp is None:
        p.sp = p.tp > 1
    if p.zero and p.dp_shard * p.cp == 1:
        raise ConfigError("parallel.zero", p.zero, "ZeRO shards over dp_shard × cp = (dp / dp_replicate) × cp "
                          f"= ({p.dp} / {p.dp_replicate}) × {p.cp} = 1: nothing to shard; use zero=0 or more "
                          "data-parallel ranks")

    a = cfg.model_args(vocab_size=m.vocab_size or PRESETS[m.preset].vocab_size)
    if m.head_dim is None and a.dim % a.n_heads:
        raise ConfigError("model.n_heads", a.n_heads, f"must divide model.dim = {a.dim} (or set model.head_dim)")
    if a.head_dim % 2:
        key, value = ("model.head_dim", a.head_dim) if m.head_dim else ("model.n_heads", a.n_heads)
        raise ConfigError(key, value, f"head dim {a.head_dim} must be even for RoPE")
    if a.qkv_bias and a.qk_norm:
        raise ConfigError("model.qk_norm", True, "with model.qkv_bias as well is no known model family; choose one")
    if a.n_kv_heads > a.n_heads or a.n_heads % a.n_kv_heads:
        raise ConfigError("model.n_kv_heads", a.n_kv_heads, f"must divide model.n_heads = {a.n_heads}")
    _check_pipeline(cfg, a)
    if p.tp > a.n_heads:
        raise ConfigError("parallel.tp", p.tp, f"must be at most model.n_heads = {a.n_heads} (tensor parallelism splits heads)")
    if a.n_heads % p.tp:
        raise ConfigError("model.n_heads", a.n_heads, f"must be divisible by parallel.tp = {p.tp}")
    if a.n_kv_heads % p.tp and p.tp % a.n_kv_heads:
        raise ConfigError("model.n_kv_heads", a.n_kv_heads,
                          f"must divide or be divisible by parallel.tp = {p.tp}")
    if a.ffn_dim % p.tp:
        raise ConfigError("model.ffn_dim", a.ffn_dim, f"must be divisible by parallel.tp = {p.tp}")
    if a.max_seq_len < t.seq_len:
        raise ConfigError("model.max_seq_len", a.max_seq_len, f"must be at least train.seq_len = {t.seq_len} "
                          "(the rotary tables cover max_seq_len positions)")
    if p.sp and p.tp > 1 and t.seq_len % p.tp:
        raise ConfigError("train.seq_len", t.seq_len,
                          f"must be divisible by parallel.tp = {p.tp} with sequence parallelism (parallel.sp) on")
    _check_moe(cfg, a)

    _check_context(cfg, a)

    if check_paths:
        if d.path not in EMBEDDED_DATA and not Path(os.path.expanduser(d.path)).exists():
            raise ConfigError("data.path", d.path, "path does not exist (use \"stdlib\" for the embedded corpus, "
                              "\"stdlib-functions\" for the embedded instruction set)")
        if d.tokenizer and not Path(os.path.expanduser(d.tokenizer)).is_file():
            raise ConfigError("data.tokenizer", d.tokenizer, "file does not exist")
        if r.dir:  # the default, runs/<task>-<time>, is checked where the CLI names it
            check_writable_dir("run.dir", r.dir)
        if not is_prepared_folder(d.path):
            check_writable_dir("data.cache_dir", d.cache_dir)
    _positive("data.vocab_size", d.vocab_size)
    if d.vocab_size < 257:
        raise ConfigError("data.vocab_size", d.vocab_size, "must be at least 257 (256 bytes + end of text)")
    if not 0.0 < d.val_fraction <= 0.5:
        raise ConfigError("data.val_fraction", d.val_fraction, "must be in (0, 0.5]")
    for key, choices in (("packing", PACKINGS), ("truncate", TRUNCATIONS), ("on_bad_record", BAD_RECORD_POLICIES),
                         ("template", TEMPLATES)):
        if getattr(d, key) not in choices:
            raise ConfigError(f"data.{key}", getattr(d, key), f"choose one of {', '.join(choices)}")
    _check_sft(cfg.sft)
    _check_rl(cfg.rl)
    return cfg


def _check_rl(r: RLConfig) -> None:
    """The rl keys on their own; `check_rl_job` adds what only `ndtrain rl` needs."""
    if r.task not in RL_TASKS:
        raise ConfigError("rl.task", r.task, f"choose one of {', '.join(RL_TASKS)}")
    lo, hi = RL_SIZES[r.task]
    if not lo <= r.size <= hi:
        raise ConfigError("rl.size", r.size, f"must be in [{lo}, {hi}] for rl.task = {r.task}")
    if r.loss not in RL_LOSSES:
        raise ConfigError("rl.loss", r.loss, f"choose one of {', '.join(RL_LOSSES)}")
    if r.reward != "builtin" and not _SCORE.match(r.reward):
        raise ConfigError("rl.reward", r.reward, "choose builtin, or MODULE:FUNCTION (a function of prompt, "
                          "completion and answer that returns a number)")
    for key in ("group_size", "max_new_tokens", "ppo_epochs", "logprob_tol"):
        _positive(f"rl.{key}", getattr(r, key))
    for key in ("top_k", "kl_coef", "max_refills", "overlong_buffer", "eval_prompts", "pass_k", "warmup_steps",
                "format_reward", "temperature"):
        _positive(f"rl.{key}", getattr(r, key), zero_ok=True)
    _positive("rl.warmup_examples", r.warmup_examples)
    if not 0.0 < r.top_p <= 1.0:
        raise ConfigError("rl.top_p", r.top_p, "must be in (0, 1]")
    if not 0.0 <= r.clip_low < 1.0:
        raise ConfigError("rl.clip_low", r.clip_low, "must be in [0, 1): the ratio is clipped to [1 - clip_low, "
                          "1 + clip_high]")
    _positive("rl.clip_high", r.clip_high, zero_ok=True)
    if r.overlong_buffer is not None and r.overlong_buffer >= r.max_new_tokens:
        raise ConfigError("rl.overlong_buffer", r.overlong_buffer,
                          f"must be less than rl.max_new_tokens = {r.max_new_tokens}")


def check_rl_job(cfg: Config) -> None:
    """What `ndtrain rl` needs of a validated config: whole groups on every data-parallel
    rank, groups that can disagree, an update rule that fits the batch."""
    r, t, p = cfg.rl, cfg.train, cfg.parallel
    if r.loss != "reinforce" and r.group_size < 2:
        raise ConfigError("rl.group_size", r.group_size, f"rl.loss = {r.loss} normalises rewards within a group of "
                          "completions of one prompt: it needs at least 2 (or rl.loss = reinforce)")
    if t.global_batch % (r.group_size * p.dp):
        raise ConfigError("train.global_batch", t.global_batch,
                          f"must be divisible by rl.group_size × dp = {r.group_size} × {p.dp} = {r.group_size * p.dp} "
                          "(each data-parallel rank trains on whole groups)")
    if r.loss != "reinforce" and r.temperature == 0:
        raise ConfigError("rl.temperature", 0.0, "greedy sampling gives a group the same completion every time: "
                          "its rewards never differ, so there is nothing to learn; use a temperature > 0")
    if r.loss == "reinforce" and r.ppo_epochs > 1:
        raise ConfigError("rl.ppo_epochs", r.ppo_epochs, "reinforce has no importance ratio, so it cannot reuse a "
                          "batch; use grpo, dr_grpo or dapo for several updates per rollout")
    if cfg.model_args().is_moe:
        raise ConfigError("model.preset", cfg.model.preset, "is a mixture-of-experts model: ndtrain rl does not "
                          "generate with experts yet (its generation layout copies parameters, not the routers' "
                          "biases, and does not gather experts split by parallel.ep); use a dense model")


def rl_overlong_buffer(r: RLConfig) -> int:
    """rl.overlong_buffer, or its default: a quarter of max_new_tokens for dapo, else none."""
    if r.overlong_buffer is not None:
        return r.overlong_buffer
    return r.max_new_tokens // 4 if r.loss == "dapo" else 0


def rl_clip_high(r: RLConfig) -> float:
    """rl.clip_high, or its default: DAPO's clip-higher 0.28, else symmetric."""
    if r.clip_high is not None:
        return r.clip_high
    return 0.28 if r.loss == "dapo" else r.clip_low


def _check_moe(cfg: Config, a: ModelArgs) -> None:
    """Mixture-of-experts keys and expert parallelism."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if not PRESETS[m.preset].is_moe and not m.init_from:  # (an MoE source sets them: checkpoint/sources.py)
        for key in MOE_KEYS:
            if getattr(m, key) is not None:
                moe = ", ".join(n for n, pa in PRESETS.items() if pa.is_moe)
                raise ConfigError(f"model.{key}", getattr(m, key), f"model.preset = {m.preset!r} is a dense model "
                                  f"(no experts); choose an MoE preset ({moe})")
    for key in ("moe_aux_loss", "moe_bias_rate"):
        _positive(f"train.{key}", getattr(t, key), zero_ok=True)
    if not a.is_moe:
        if p.ep != 1:
            raise ConfigError("parallel.ep", p.ep, f"model.preset = {m.preset!r} has no experts to split; use 1")
        if t.moe_bias_rate:
            raise ConfigError("train.moe_bias_rate", t.moe_bias_rate, f"model.preset = {m.preset!r} has no routers")
        return
    for key in ("moe_experts", "moe_top_k", "moe_every", "moe_route_scale"):
        _positive(f"model.{key}", getattr(a, key))
    for key in ("moe_shared_experts", "moe_ffn_dim", "moe_capacity"):
        _positive(f"model.{key}", getattr(a, key), zero_ok=True)
    if a.moe_top_k > a.moe_experts:
        raise ConfigError("model.moe_top_k", a.moe_top_k, f"must be at most model.moe_experts = {a.moe_experts}")
    if a.moe_router not in ROUTERS:
        raise ConfigError("model.moe_router", a.moe_router, f"choose one of {', '.join(ROUTERS)}")
    if a.moe_router == "topk_softmax" and a.moe_norm_topk:
        raise ConfigError("model.moe_norm_topk", True, "topk_softmax weights already sum to 1; leave it false")
    if a.moe_experts % p.ep:
        raise ConfigError("parallel.ep", p.ep, f"must divide model.moe_experts = {a.moe_experts} "
                          "(every rank of an expert group holds as many experts)")
    if (p.dp_shard * p.cp) % p.ep:
        raise ConfigError("parallel.ep", p.ep, f"must divide dp_shard × cp = {p.dp_shard} × {p.cp} = "
                          f"{p.dp_shard * p.cp}: expert parallelism splits the experts over those ranks")
    if p.tp > 1 and t.seq_len % p.tp:
        raise ConfigError("train.seq_len", t.seq_len, f"must be divisible by parallel.tp = {p.tp}: "
                          "each tp rank routes 1/tp of the positions of an MoE block")
    if a.moe_capacity and (p.tp > 1 or p.cp > 1):
        raise ConfigError("model.moe_capacity", a.moe_capacity, "dropping tokens would depend on how tp and cp "
                          "split the sequence (the capacity is per rank); use 0 (dropless) with tp or cp > 1")
_SCORE = re.compile(r"^(exact|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$")


def _check_sft(s: SFTConfig) -> None:
    _positive("sft.generate", s.generate, zero_ok=True)
    _positive("sft.max_new_tokens", s.max_new_tokens)
    if not _SCORE.match(s.score):
        raise ConfigError("sft.score", s.score, "choose exact, or MODULE:FUNCTION (a function of prompt, "
                          "completion and reference that returns a number)")


def is_prepared_folder(path: str) -> bool:
    """A folder `ndtrain prepare` wrote (read as is: no tokenizer training, no cache)."""
    return path != "stdlib" and (Path(path).expanduser() / "meta.json").is_file()


def check_writable_dir(key: str, value: str, path: str | Path | None = None) -> None:
    """Raise ConfigError unless a directory can be created or written at `path` (default:
    `value`). Permission bits cannot tell (root, read-only mounts), so the nearest existing
    directory is probed with a temporary directory, removed at once."""
    target = Path(os.path.expanduser(str(path if path is not None else value)))
    if target.exists() and not target.is_dir():
        raise ConfigError(key, value, "exists and is not a directory")
    parent = target
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(key, value, f"cannot be created: {parent} is a file")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".ndtrain-probe-", dir=parent))
    except OSError as e:
        raise ConfigError(key, value, f"cannot be written: creating a directory in {parent} fails "
                          f"({e.strerror})") from None


def _check_pipeline(cfg: Config, a: ModelArgs) -> None:
    """The pipeline's layout: chunks, split, micro-batches per schedule."""
    p, t = cfg.parallel, cfg.train
    n_chunks = p.pp * p.pp_virtual
    if p.pp == 1:
        for key, value, default in (("pp_virtual", p.pp_virtual, 1), ("pp_split", p.pp_split, "")):
            if value != default:
                raise ConfigError(f"parallel.{key}", value, "needs parallel.pp > 1")
        return
    if p.pp_virtual > 1 and p.pp_schedule != "interleaved":
        raise ConfigError("parallel.pp_virtual", p.pp_virtual,
                          f"needs parallel.pp_schedule = 'interleaved' (it is {p.pp_schedule!r})")
    if p.pp_split:
        try:
            counts = parse_split(p.pp_split)
        except ValueError:
            raise ConfigError("parallel.pp_split", p.pp_split, "expected layers per chunk, e.g. \"3,5\"") from None
        error = split_error(counts, n_chunks, a.n_layers)
        if error:
            raise ConfigError("parallel.pp_split", p.pp_split, error)
    elif a.n_layers < n_chunks:
        raise ConfigError("model.n_layers", a.n_layers, f"must be at least pp × pp_virtual = "
                          f"{p.pp} × {p.pp_virtual} = {n_chunks}: every pipeline chunk needs a layer")
    m = t.accumulation(p.dp)
    if p.pp_schedule == "interleaved" and m % p.pp:
        raise ConfigError("parallel.pp_schedule", p.pp_schedule,
                          f"needs the micro-batch count global_batch / (dp × micro_batch) = {t.global_batch} / "
                          f"({p.dp} × {t.micro_batch}) = {m} to be a multiple of parallel.pp = {p.pp}")


def _check_context(cfg: Config, a: ModelArgs) -> None:
    """Context parallelism: the zigzag layout's chunks, sequence parallelism inside a CP
    rank's tokens, and Ulysses' head split (on the heads each tp rank holds)."""
    p, t = cfg.parallel, cfg.train
    if p.cp == 1:
        return
    if t.seq_len % (2 * p.cp):
        raise ConfigError("train.seq_len", t.seq_len, f"must be divisible by 2 × parallel.cp = {2 * p.cp}: "
                          "context parallelism cuts each sequence into 2·cp equal chunks")
    local = t.seq_len // p.cp
    if p.sp and p.tp > 1 and local % p.tp:
        raise ConfigError("train.seq_len", t.seq_len, f"must be divisible by cp × tp = {p.cp} × {p.tp}: sequence "
                          f"parallelism splits each CP rank's {local} tokens over parallel.tp = {p.tp}")
    if p.cp_impl == "ulysses":
        heads = a.n_heads // p.tp
        kv = a.n_kv_heads // p.tp if a.n_kv_heads % p.tp == 0 else 1
        if heads % p.cp:
            raise ConfigError("parallel.cp", p.cp, f"cp_impl = ulysses splits the query heads per tp rank, "
                              f"n_heads / tp = {a.n_heads} / {p.tp} = {heads}, over cp: they must be divisible by it")
        if kv % p.cp and p.cp % kv:
            raise ConfigError("parallel.cp", p.cp, f"cp_impl = ulysses needs the KV heads per tp rank ({kv}, of "
                              f"n_kv_heads = {a.n_kv_heads}) to divide cp or be divisible by it")


def parse_split(text: str) -> list[int]:
    """"3,5,5,3" → [3, 5, 5, 3]; raises ValueError on anything else."""
    parts = [p.strip() for p in text.split(",")]
    counts = [int(p) for p in parts]  # ValueError on a non-integer
    return counts


def split_error(counts: list[int], n_chunks: int, n_layers: int) -> str | None:
    """Why a hand-written split cannot be used, or None."""
    if len(counts) != n_chunks:
        return f"lists {len(counts)} chunks, but pp × pp_virtual = {n_chunks}"
    if min(counts) < 1:
        return "every chunk needs at least one layer"
    if sum(counts) != n_layers:
        return f"covers {sum(counts)} layers, but model.n_layers = {n_layers}: a split must cover every layer once"
    return None


def recompute_every(spec: str) -> int:
    """`every:K` → K; `full` → 1; `none`/`selective` → 0."""
    if spec == "full":
        return 1
    m = _RECOMPUTE.match(spec)
    return int(m.group(2)) if m and m.group(2) else 0
