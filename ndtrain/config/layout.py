"""Validation across sections: the layout. First the process count and how the batch splits
over it (`resolve_world`, `resolve_layout`, which also fill the derived values), then the
model's shape against each dimension that splits it: heads, pipeline chunks, tensor and
sequence parallelism, experts, context."""

from __future__ import annotations

from dataclasses import fields

from ndtrain.config.schema import Config, ConfigError, ModelConfig
from ndtrain.config.sections import V_SCHEDULES, positive
from ndtrain.model.args import PRESETS, ROUTERS, ModelArgs

MOE_KEYS = tuple(f.name for f in fields(ModelConfig) if f.name.startswith("moe_") or f.name == "first_k_dense")


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


def default_local_processes(device: str) -> int:
    import torch
    if device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2


def resolve_layout(cfg: Config, world: int | None) -> None:
    """The process count, the batch split over data-parallel ranks and micro-batches, and
    ZeRO's shard group; fills parallel.dp, run.nproc, train.micro_batch and parallel.sp."""
    p, t = cfg.parallel, cfg.train
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


def check_heads(cfg: Config, a: ModelArgs) -> None:
    """The attention heads of the model's shape `a`: head dim, RoPE, grouped KV heads."""
    m = cfg.model
    if m.head_dim is None and not a.is_mla and a.dim % a.n_heads:
        raise ConfigError("model.n_heads", a.n_heads, f"must divide model.dim = {a.dim} (or set model.head_dim)")
    if a.head_dim % 2:
        key, value = ("model.head_dim", a.head_dim) if m.head_dim else ("model.n_heads", a.n_heads)
        raise ConfigError(key, value, f"head dim {a.head_dim} must be even for RoPE")
    if a.qkv_bias and a.qk_norm:
        raise ConfigError("model.qk_norm", True, "with model.qkv_bias as well is no known model family; choose one")
    if a.n_kv_heads > a.n_heads or a.n_heads % a.n_kv_heads:
        raise ConfigError("model.n_kv_heads", a.n_kv_heads, f"must divide model.n_heads = {a.n_heads}")


def check_pipeline(cfg: Config, a: ModelArgs) -> None:
    """The pipeline's layout: chunks, split, micro-batches per schedule."""
    p, t = cfg.parallel, cfg.train
    n_chunks = p.pp * p.pp_virtual
    if p.pp == 1:
        for key, value, default in (("pp_virtual", p.pp_virtual, 1), ("pp_split", p.pp_split, "")):
            if value != default:
                raise ConfigError(f"parallel.{key}", value, "needs parallel.pp > 1")
        return
    if p.pp_schedule in V_SCHEDULES and p.pp_virtual != 2:
        raise ConfigError("parallel.pp_virtual", p.pp_virtual, f"parallel.pp_schedule = {p.pp_schedule!r} runs "
                          "two chunks per rank (a V): set parallel.pp_virtual = 2")
    if p.pp_virtual > 1 and p.pp_schedule not in ("interleaved", *V_SCHEDULES):
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
    if p.pp_schedule == "dualpipev" and m < 2 * p.pp:
        raise ConfigError("parallel.pp_schedule", p.pp_schedule,
                          f"needs at least 2 × parallel.pp = {2 * p.pp} micro-batches; global_batch / (dp × "
                          f"micro_batch) = {t.global_batch} / ({p.dp} × {t.micro_batch}) = {m}")
    if p.pp_schedule == "interleaved" and m % p.pp:
        raise ConfigError("parallel.pp_schedule", p.pp_schedule,
                          f"needs the micro-batch count global_batch / (dp × micro_batch) = {t.global_batch} / "
                          f"({p.dp} × {t.micro_batch}) = {m} to be a multiple of parallel.pp = {p.pp}")


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


def check_tensor(cfg: Config, a: ModelArgs) -> None:
    """Tensor parallelism splits the heads and the feed-forward width."""
    p = cfg.parallel
    if p.tp > a.n_heads:
        raise ConfigError("parallel.tp", p.tp, f"must be at most model.n_heads = {a.n_heads} (tensor parallelism splits heads)")
    if a.n_heads % p.tp:
        raise ConfigError("model.n_heads", a.n_heads, f"must be divisible by parallel.tp = {p.tp}")
    if a.n_kv_heads % p.tp and p.tp % a.n_kv_heads:
        raise ConfigError("model.n_kv_heads", a.n_kv_heads,
                          f"must divide or be divisible by parallel.tp = {p.tp}")
    if a.ffn_dim % p.tp:
        raise ConfigError("model.ffn_dim", a.ffn_dim, f"must be divisible by parallel.tp = {p.tp}")


def check_sequence(cfg: Config, a: ModelArgs) -> None:
    """train.seq_len against the rotary tables and sequence parallelism's split."""
    p, t = cfg.parallel, cfg.train
    if a.max_seq_len < t.seq_len:
        raise ConfigError("model.max_seq_len", a.max_seq_len, f"must be at least train.seq_len = {t.seq_len} "
                          "(the rotary tables cover max_seq_len positions)")
    if p.sp and p.tp > 1 and t.seq_len % p.tp:
        raise ConfigError("train.seq_len", t.seq_len,
                          f"must be divisible by parallel.tp = {p.tp} with sequence parallelism (parallel.sp) on")


def check_moe(cfg: Config, a: ModelArgs) -> None:
    """Mixture-of-experts keys and expert parallelism."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if not PRESETS[m.preset].is_moe and not m.init_from:  # (an MoE source sets them: checkpoint/sources.py)
        for key in MOE_KEYS:
            if getattr(m, key) is not None:
                moe = ", ".join(n for n, pa in PRESETS.items() if pa.is_moe)
                raise ConfigError(f"model.{key}", getattr(m, key), f"model.preset = {m.preset!r} is a dense model "
                                  f"(no experts); choose an MoE preset ({moe})")
    for key in ("moe_aux_loss", "moe_bias_rate"):
        positive(f"train.{key}", getattr(t, key), zero_ok=True)
    if m.moe_experts is not None and m.moe_experts <= 0 and (PRESETS[m.preset].is_moe or m.init_from):
        dense = ", ".join(n for n, pa in PRESETS.items() if not pa.is_moe)
        raise ConfigError("model.moe_experts", m.moe_experts, f"must be > 0: model.preset = {m.preset!r} is a "
                          f"mixture of experts; for a dense model choose a dense preset ({dense})")
    if not a.is_moe:
        if p.ep != 1:
            raise ConfigError("parallel.ep", p.ep, f"model.preset = {m.preset!r} has no experts to split; use 1")
        if t.moe_bias_rate:
            raise ConfigError("train.moe_bias_rate", t.moe_bias_rate, f"model.preset = {m.preset!r} has no routers")
        return
    for key in ("moe_experts", "moe_top_k", "moe_every", "moe_route_scale"):
        positive(f"model.{key}", getattr(a, key))
    for key in ("moe_shared_experts", "moe_ffn_dim", "moe_capacity"):
        positive(f"model.{key}", getattr(a, key), zero_ok=True)
    if a.moe_top_k > a.moe_experts:
        raise ConfigError("model.moe_top_k", a.moe_top_k, f"must be at most model.moe_experts = {a.moe_experts}")
    if a.moe_every > a.n_layers:
        raise ConfigError("model.moe_every", a.moe_every, f"must be at most model.n_layers = {a.n_layers}: "
                          "block i has experts when (i + 1) is a multiple of it, so no block would")
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


def check_context(cfg: Config, a: ModelArgs) -> None:
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


def check_micro(cfg: Config, a: ModelArgs) -> None:
    """MXFP8 and NVFP4 (parallel/fp8.py): a block spans 32 (16) elements along a reduction, so
    a tensor-parallel shard must be whole blocks; NVFP4's Hadamard runs of 16 tokens must lie
    on one context-parallel rank; its stochastic rounding is keyed by the micro-batch that a
    forward runs, which a compiled block or a pipeline's recomputed forward cannot follow."""
    t, p = cfg.train, cfg.parallel
    nv = t.precision == "nvfp4"
    if not nv and t.fp8_recipe != "mxfp8":
        return
    name, block = ("nvfp4", 16) if nv else ("mxfp8", 32)
    if p.tp > 1:
        widths = {"attention heads × head_dim": a.n_heads * a.head_dim, "KV heads × head_dim": a.n_kv_heads * a.head_dim,
                  "ffn_dim": a.ffn_dim}
        for what, full in widths.items():
            if full % p.tp or (full // p.tp) % block:
                raise ConfigError("parallel.tp", p.tp, f"{name} needs every tensor-parallel shard to be whole {block}-"
                                  f"element blocks: {what} = {full} gives {full / p.tp:g} per rank")
    if not nv:
        return
    if p.cp > 1 and t.nvfp4_hadamard and (t.seq_len // (2 * p.cp)) % block:
        raise ConfigError("parallel.cp", p.cp, f"nvfp4's Hadamard transform mixes runs of 16 tokens: seq_len / (2·cp) "
                          f"= {t.seq_len / (2 * p.cp):g} tokens per chunk must be a multiple of 16")
    if t.nvfp4_stochastic_rounding and t.compile:
        raise ConfigError("train.compile", True, "nvfp4's stochastic rounding is keyed by step and micro-batch, "
                          "which a compiled block would guard on; set train.nvfp4_stochastic_rounding=false")
    if t.nvfp4_stochastic_rounding and p.pp > 1 and t.recompute != "none":
        raise ConfigError("train.recompute", t.recompute, "nvfp4's stochastic rounding under pipeline parallelism "
                          "needs the forward's micro-batch in backward, which recomputation runs later; use none")


def check_fp8(cfg: Config, a: ModelArgs) -> None:
    """train.precision = fp8: the fp8 all-gather's needs, and the layouts fp8 cannot make equal
    to one process (parallel/fp8.py says why)."""
    t, p = cfg.train, cfg.parallel
    if t.precision not in ("fp8", "nvfp4"):
        return
    check_micro(cfg, a)
    if t.fp8_all_gather and (t.fp8_recipe != "tensorwise" or p.zero != 3):
        raise ConfigError("train.fp8_all_gather", True, "gathers tensorwise fp8 weights under ZeRO-3: needs "
                          f"train.fp8_recipe=tensorwise and parallel.zero=3 (got {t.fp8_recipe}, zero={p.zero})")
    if p.tp > 1 and a.n_kv_heads % p.tp:
        raise ConfigError("parallel.tp", p.tp, f"fp8 needs tp to divide the {a.n_kv_heads} KV heads: with fewer, "
                          "ranks hold partial sums of a KV head's output gradient, which fp8 would quantize unsummed")
    if a.is_moe and (p.tp > 1 or p.cp > 1):
        key, value = ("parallel.tp", p.tp) if p.tp > 1 else ("parallel.cp", p.cp)
        raise ConfigError(key, value, "fp8 with MoE blocks runs with tp = cp = 1: an expert's tokens of one "
                          "micro-batch would be spread over ranks, and their fp8 scales with them (use ep, dp, pp)")
