"""Validation per section: the rules of the model, parallel, train, run and data keys, each
section's keys on their own. validate.py runs these first, then the rules between sections
(layout.py), the paths (paths.py) and the task sections (tasks.py)."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from ndtrain.config.schema import (ConfigError, DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig,
                                   uses_cuda)
from ndtrain.data.chat import BAD_RECORD_POLICIES
from ndtrain.data.packing import PACKINGS, TRUNCATIONS
from ndtrain.model.args import PRESETS

PRECISIONS = ("fp32", "bf16", "fp16", "fp64", "fp8", "nvfp4")
FP8_RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")
NVFP4_KEYS = (("nvfp4_hadamard", True), ("nvfp4_stochastic_rounding", True), ("nvfp4_2d_weights", True),
              ("nvfp4_base_blocks", -1))
FP8_BASES = ("bf16", "fp32", "fp64")
TEMPLATES = ("auto", "builtin", "hf")
PP_SCHEDULES = ("afab", "1f1b", "interleaved", "zb", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")  # two chunks per rank, placed in a V
CP_IMPLS = ("ring", "allgather", "ulysses")
RECOMPUTE = re.compile(r"^(none|full|selective|every:(-?\d+))$")

# Dimensions whose implementation has not landed yet: refused up front, never half-run.
NOT_YET: dict[str, str] = {}  # every dimension has landed


def positive(key: str, value, *, zero_ok: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(key, value, "must be >= 0" if zero_ok else "must be > 0")


DOC_ATTENTIONS = ("auto", "mask", "flex")


def check_model(m: ModelConfig, check_paths: bool, device: str = "auto") -> None:
    if m.preset not in PRESETS:
        raise ConfigError("model.preset", m.preset, f"unknown preset; choose one of {', '.join(PRESETS)}")
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len", "head_dim"):
        positive(f"model.{key}", getattr(m, key))
    for key in ("rope_theta", "norm_eps"):
        if getattr(m, key) is not None:
            positive(f"model.{key}", getattr(m, key))
    if m.init_from:
        kind, _, path = m.init_from.partition(":")
        if kind not in ("run", "hf") or not path:
            raise ConfigError("model.init_from", m.init_from, "expected run:DIR (an ndtrain run or checkpoint) "
                              "or hf:DIR (a Hugging Face model folder)")
        if check_paths and not Path(os.path.expanduser(path)).is_dir():
            raise ConfigError("model.init_from", m.init_from, "no such directory")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError("model.dropout", m.dropout, "must be in [0, 1)")
    if m.doc_attention not in DOC_ATTENTIONS:
        raise ConfigError("model.doc_attention", m.doc_attention, f"choose one of {', '.join(DOC_ATTENTIONS)}")
    if m.doc_attention == "flex" and not uses_cuda(device):
        raise ConfigError("model.doc_attention", "flex", "needs CUDA: torch's flex_attention has no backward on the "
                          "CPU; use mask (or auto) there")


def check_parallel(p: ParallelConfig) -> None:
    for key in ("pp", "dp_replicate", "tp", "cp", "ep", "pp_virtual"):
        positive(f"parallel.{key}", getattr(p, key))
    positive("parallel.dp", p.dp, zero_ok=True)
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
    positive("parallel.bucket_mb", p.bucket_mb)


def check_train(t: TrainConfig, device: str) -> None:
    """The train keys; `device` is run.device, on which fp64 depends."""
    positive("train.steps", t.steps)
    positive("train.seq_len", t.seq_len)
    positive("train.lr", t.lr)
    positive("train.global_batch", t.global_batch)
    positive("train.micro_batch", t.micro_batch, zero_ok=True)
    for key in ("warmup", "eval_every", "save_every", "eval_batches", "grad_clip", "weight_decay", "loss_chunk"):
        positive(f"train.{key}", getattr(t, key), zero_ok=True)
    positive("train.log_every", t.log_every)
    if not 0 <= t.seed < 2**32:
        raise ConfigError("train.seed", t.seed, "must be in [0, 2**32)")
    positive("train.eps", t.eps)
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError("train.min_lr_ratio", t.min_lr_ratio, "must be in [0, 1]")
    _check_schedule(t)
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(t, key) < 1.0:
            raise ConfigError(f"train.{key}", getattr(t, key), "must be in [0, 1)")
    _check_optimizer(t)
    _check_precision(t, device)
    match = RECOMPUTE.match(t.recompute)
    if not match:
        raise ConfigError("train.recompute", t.recompute, "choose none, full, selective or every:K")
    if match.group(2) is not None and int(match.group(2)) < 1:
        raise ConfigError("train.recompute", t.recompute, "every:K needs K >= 1 (every:1 = full)")


LR_SCHEDULES = ("cosine", "wsd", "linear", "constant")
OPTIMIZERS = ("adamw", "muon")
MUON_ADJUST_LR = ("match_rms_adamw", "original")
MUON_NS_DTYPES = ("auto", "bf16", "fp32", "fp64")


def muon_coefficients(text: str) -> tuple[float, float, float] | None:
    """train.muon_ns_coefficients "a,b,c" as three floats; None when it is not that."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        return None
    return values if len(values) == 3 and all(math.isfinite(v) for v in values) else None


def _check_optimizer(t: TrainConfig) -> None:
    """train.optimizer and Muon's keys."""
    if t.optimizer not in OPTIMIZERS:
        raise ConfigError("train.optimizer", t.optimizer, f"choose one of {', '.join(OPTIMIZERS)}")
    positive("train.muon_lr", t.muon_lr, zero_ok=True)
    if not 0.0 <= t.muon_momentum < 1.0:
        raise ConfigError("train.muon_momentum", t.muon_momentum, "must be in [0, 1)")
    if not 1 <= t.muon_ns_steps < 100:
        raise ConfigError("train.muon_ns_steps", t.muon_ns_steps, "must be in [1, 100)")
    if muon_coefficients(t.muon_ns_coefficients) is None:
        raise ConfigError("train.muon_ns_coefficients", t.muon_ns_coefficients,
                          "expected three comma-separated numbers a,b,c (e.g. 3.4445,-4.7750,2.0315)")
    if t.muon_adjust_lr not in MUON_ADJUST_LR:
        raise ConfigError("train.muon_adjust_lr", t.muon_adjust_lr, f"choose one of {', '.join(MUON_ADJUST_LR)}")
    if t.muon_ns_dtype not in MUON_NS_DTYPES:
        raise ConfigError("train.muon_ns_dtype", t.muon_ns_dtype, f"choose one of {', '.join(MUON_NS_DTYPES)}")


def _check_schedule(t: TrainConfig) -> None:
    """train.schedule is known; wsd's decay fits after its warmup."""
    if t.schedule not in LR_SCHEDULES:
        raise ConfigError("train.schedule", t.schedule, f"choose one of {', '.join(LR_SCHEDULES)}")
    if not 0.0 < t.decay_fraction <= 1.0:
        raise ConfigError("train.decay_fraction", t.decay_fraction, "must be in (0, 1]")
    if t.schedule == "wsd" and t.warmup + round(t.decay_fraction * t.steps) > t.steps:
        raise ConfigError("train.decay_fraction", t.decay_fraction,
                          f"wsd: train.warmup ({t.warmup}) plus the decay ({round(t.decay_fraction * t.steps)} of "
                          f"{t.steps} steps) must fit in train.steps")


COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def check_compile(t: TrainConfig, p: ParallelConfig, device: str) -> None:
    """train.compile: a known backend; not with the zero-bubble schedule (a compiled block's
    backward is one node, which cannot be split into input and weight parts); Inductor on
    the CPU needs a C++ compiler."""
    if t.compile_backend not in COMPILE_BACKENDS:
        raise ConfigError("train.compile_backend", t.compile_backend, f"choose one of {', '.join(COMPILE_BACKENDS)}")
    if not t.compile:
        return
    if p.pp > 1 and p.pp_schedule == "zb":
        raise ConfigError("train.compile", True, "cannot compile under parallel.pp_schedule=zb: zero bubble "
                          "splits each backward into input and weight parts, which a compiled block computes "
                          "in one node; use 1f1b, afab or interleaved, or train.compile=false")
    if t.compile_backend == "inductor" and not uses_cuda(device):
        import shutil
        if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
            raise ConfigError("train.compile", True, "Inductor on the CPU needs a C++ compiler (g++, c++ or "
                              "clang++) on PATH; install one or set train.compile_backend=aot_eager")


def _check_fp8_keys(t: TrainConfig, device: str) -> None:
    """train.fp8_*: valid values, set only with train.precision = fp8 (the layouts fp8 refuses:
    layout.check_fp8)."""
    if t.fp8_recipe not in FP8_RECIPES:
        raise ConfigError("train.fp8_recipe", t.fp8_recipe, f"choose one of {', '.join(FP8_RECIPES)}")
    if t.fp8_base not in FP8_BASES:
        raise ConfigError("train.fp8_base", t.fp8_base, f"choose one of {', '.join(FP8_BASES)}")
    if t.precision != "fp8":
        for key, default in (("fp8_recipe", "tensorwise"), ("fp8_all_gather", False)):
            if getattr(t, key) != default:
                raise ConfigError(f"train.{key}", getattr(t, key), "applies only with train.precision=fp8")
    if t.precision != "nvfp4":
        for key, default in NVFP4_KEYS:
            if getattr(t, key) != default:
                raise ConfigError(f"train.{key}", getattr(t, key), "applies only with train.precision=nvfp4")
    if t.nvfp4_base_blocks < -1:
        raise ConfigError("train.nvfp4_base_blocks", t.nvfp4_base_blocks, "must be >= 0, or -1 for the last 15%")
    if t.precision not in ("fp8", "nvfp4"):
        if t.fp8_base != "bf16":
            raise ConfigError("train.fp8_base", t.fp8_base, "applies only with train.precision=fp8 or nvfp4")
    elif t.fp8_base == "fp64" and uses_cuda(device):
        raise ConfigError("train.fp8_base", "fp64", "fp64 is for the CPU layout proofs (run.device=cpu)")


def resolve_precision(t: TrainConfig, cuda: bool) -> None:
    """train.precision = auto: bf16 on CUDA (fp32 there trains ~10× slower), fp32 on the CPU
    (where bf16 has no fast matmul and the proofs want full precision)."""
    if t.precision == "auto":
        t.precision = "bf16" if cuda else "fp32"


def _check_precision(t: TrainConfig, device: str) -> None:
    """train.precision (auto resolved here) and the fp16 loss scaler."""
    resolve_precision(t, uses_cuda(device))
    if t.precision not in PRECISIONS:
        raise ConfigError("train.precision", t.precision, f"choose auto or one of {', '.join(PRECISIONS)}")
    if t.precision == "fp64" and uses_cuda(device):
        raise ConfigError("train.precision", t.precision, "fp64 is for the CPU layout proofs (run.device=cpu); "
                          "on a GPU use fp32, bf16 or fp16")
    _check_fp8_keys(t, device)
    if t.precision == "fp16" and not t.loss_scaler and not t.allow_unscaled_fp16:
        raise ConfigError("train.loss_scaler", False, "fp16 without loss scaling flushes small gradients "
                          "to zero; keep it on, or set train.allow_unscaled_fp16=true to insist")
    for key in ("loss_scale_init", "loss_scale_min"):
        value = getattr(t, key)
        positive(f"train.{key}", value)
        if not math.log2(value).is_integer():
            raise ConfigError(f"train.{key}", value, "must be a power of two (so scaling is exact)")
    positive("train.loss_scale_window", t.loss_scale_window)
    if t.loss_scale_init < t.loss_scale_min:
        raise ConfigError("train.loss_scale_init", t.loss_scale_init,
                          f"must be at least train.loss_scale_min = {t.loss_scale_min}")


WANDB_MODES = ("", "offline", "online")


def _check_dashboards(r: RunConfig) -> None:
    """run.wandb is a known mode; a dashboard asked for has its package (an optional extra),
    which imports; run.wandb = online has W&B credentials. All before anything is written."""
    import importlib
    import importlib.util
    if r.wandb not in WANDB_MODES:
        raise ConfigError("run.wandb", r.wandb, "choose \"\" (off), offline or online")
    for key, value, extra, module in (("run.tensorboard", r.tensorboard, "tensorboard", "torch.utils.tensorboard"),
                                      ("run.wandb", r.wandb, "wandb", "wandb")):
        if not value:
            continue
        if importlib.util.find_spec(extra) is None:
            raise ConfigError(key, value, f"needs the {extra} package, which is not installed: "
                                          f"pip install -e \".[{extra}]\" (or pip install {extra})")
        try:
            importlib.import_module(module)
        except Exception as e:  # installed but broken (a dependency's version, a damaged install)
            first = (str(e).strip().splitlines() or [""])[0]
            raise ConfigError(key, value, f"the {extra} package is installed but fails to import ({type(e).__name__}: "
                                          f"{first}); repair it (pip install -U {extra}) or turn {key} off") from None
    if r.wandb == "online" and not _wandb_credentials():
        raise ConfigError("run.wandb", r.wandb, "needs W&B credentials and none were found (WANDB_API_KEY, "
                                                "WANDB_IDENTITY_TOKEN_FILE or a netrc entry for "
                                                f"{_wandb_host()}): run `wandb login`, or set run.wandb=offline "
                                                "and `wandb sync` the run later")


def _wandb_host() -> str:
    from urllib.parse import urlparse
    return urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"


def _wandb_credentials() -> bool:
    """Where W&B looks for credentials, without asking its server: its environment variables,
    then the netrc file (`wandb login` writes there; $NETRC or ~/.netrc)."""
    import netrc
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc").expanduser()
    try:
        entry = netrc.netrc(str(path)).authenticators(_wandb_host())
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def check_run(r: RunConfig) -> None:
    if r.device not in ("auto", "cpu", "cuda"):
        raise ConfigError("run.device", r.device, "choose auto, cpu or cuda")
    if r.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ConfigError("run.device", r.device, "no CUDA device is available")
    if r.resume not in ("auto", "true", "false"):
        raise ConfigError("run.resume", r.resume, "choose auto, true or false")
    positive("run.nproc", r.nproc, zero_ok=True)
    positive("run.threads", r.threads, zero_ok=True)
    cores = os.cpu_count() or 1
    if r.threads > cores:
        raise ConfigError("run.threads", r.threads, f"must be at most this machine's {cores} CPU cores")
    positive("run.stop_after", r.stop_after, zero_ok=True)
    positive("run.stop_after_s", r.stop_after_s, zero_ok=True)
    positive("run.max_restarts", r.max_restarts, zero_ok=True)
    positive("run.heartbeat_s", r.heartbeat_s, zero_ok=True)
    if r.fault_tolerance not in ("restart", "replicas"):
        raise ConfigError("run.fault_tolerance", r.fault_tolerance, "choose restart or replicas")
    if r.lost_rows not in ("skip", "requeue"):
        raise ConfigError("run.lost_rows", r.lost_rows, "choose skip or requeue")
    positive("run.collective_timeout_s", r.collective_timeout_s)
    _check_dashboards(r)


def check_data(d: DataConfig) -> None:
    """The data keys' values (paths.py checks the paths they name)."""
    positive("data.vocab_size", d.vocab_size)
    positive("data.workers", d.workers, zero_ok=True)
    if not d.text_key.strip():
        raise ConfigError("data.text_key", d.text_key, "must name the JSONL field or parquet column holding the text")
    if d.vocab_size < 257:
        raise ConfigError("data.vocab_size", d.vocab_size, "must be at least 257 (256 bytes + end of text)")
    if not 0.0 < d.val_fraction <= 0.5:
        raise ConfigError("data.val_fraction", d.val_fraction, "must be in (0, 0.5]")
    for key, choices in (("packing", PACKINGS), ("truncate", TRUNCATIONS), ("on_bad_record", BAD_RECORD_POLICIES),
                         ("template", TEMPLATES)):
        if getattr(d, key) not in choices:
            raise ConfigError(f"data.{key}", getattr(d, key), f"choose one of {', '.join(choices)}")


def recompute_every(spec: str) -> int:
    """`every:K` → K; `full` → 1; `none`/`selective` → 0."""
    if spec == "full":
        return 1
    m = RECOMPUTE.match(spec)
    return int(m.group(2)) if m and m.group(2) else 0
