"""FP8 training (`train.precision = "fp8"`): which matmuls run in fp8, and how each layout's
shards agree on their scales.

The linear layers inside the blocks (attention wq wk wv wo, the MLP's w1 w2 w3, the shared
and routed experts) run their forward, input-gradient and weight-gradient matmuls on fp8
operands (kernels/fp8_linear.py, recipe `train.fp8_recipe`). Everything else keeps the
compute dtype `train.fp8_base` (bf16 by default): the embedding, the output head, the norms,
the attention core and the router; master weights, gradients and optimizer state are
those of that dtype (fp32 masters under bf16).

`apply(model, mesh, cfg)` swaps them in, after tensor/context/expert parallelism have laid
the model out and before recomputation wraps it:
- a plain `nn.Linear` becomes `Float8Linear` (same parameters, same names);
- a tensor-parallel `ColumnParallelLinear` / `RowParallelLinear` keeps its module and gets an
  fp8 product (`linear`);
- routed experts get fp8 grouped products (`Experts.matmuls`).

One process in fp8 is the reference every layout equals. A scale belongs to a cell of the
whole tensor one process would quantize (kernels/fp8.py), so where a layout splits that
tensor over ranks, a cell that spans them takes its amax reduced (all-reduce MAX) over them:
- tensor parallelism splits the weight's output features (column-parallel: W and dy) or its
  input features (row-parallel: W and x). Tensorwise scales of those reduce over tp; rowwise
  ones where tp splits the reduction dimension; blockwise ones where a 128-block straddles
  two ranks' shards (never when every shard is a multiple of 128, the usual case).
- context parallelism splits the tokens: a micro-batch's tokens are the token dimension one
  process sees, so tensorwise activation and gradient scales, the rowwise weight-gradient
  scales (per feature, along the tokens) and the blockwise 128-token tiles of the weight
  gradient reduce over cp. Tiles are cut on each token's global index b·S + position, as
  one process cuts the flattened micro-batch.
- data and pipeline parallelism, and ZeRO, do not split a micro-batch (ZeRO-3 gathers the
  whole weight before the matmul): the reference is one process with the same
  `train.micro_batch` (tensorwise scales see a whole micro-batch).
- expert parallelism brings an expert the rows of several ranks' micro-batches: each
  source's rows are quantized on their own, as one process quantizes each micro-batch.
Two layouts are refused (config.py), because the reference's tensor is never whole on any
rank and the scale would need more than an amax reduction: tp not dividing the KV heads
(ranks hold partial sums of a KV head's output gradient) and MoE with tp or cp > 1 (a
micro-batch's tokens of one expert are spread over ranks in an order no rank knows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ndtrain.comm import ops
from ndtrain.kernels.fp8 import Dim
from ndtrain.kernels.fp8_linear import (RECIPES, ROUNDING, LinearPlan, Nvfp4, Rounding, expert_keys,
                                       fp8_expert_matmul, fp8_linear, predict_backends)
from ndtrain.mesh import Group, ParallelMesh
from ndtrain.model.args import ModelArgs
from ndtrain.model.moe import Experts
from ndtrain.parallel.context.layout import zigzag_index
from ndtrain.parallel.tensor import ColumnParallelLinear, RowParallelLinear

# Latent attention's up-projections too (model/mla.py); its down-projections wq_a and wkv_a stay
# in the base dtype on every layout: under tp they are whole on every rank and their output's
# gradient is a partial sum over tp, which fp8 would quantize per rank (Σ Q(part) ≠ Q(Σ part)),
# so one process must not quantize them either. The multi-token prediction modules' blocks stay
# in the base dtype.
LINEARS = ("layers.*.attention.w[qkvo]", "layers.*.attention.wq_b", "layers.*.attention.wkv_b",
           "layers.*.feed_forward.w[123]", "layers.*.feed_forward.shared.w[123]")
EXPERTS = "layers.*.feed_forward.experts"
STAY = ("embedding, output head, norms, attention core, router (norm statistics, softmax and routing "
        "in fp32)")
SCALES = {"tensorwise": "x and W in E4M3, gradients in E5M2, one scale per tensor",
          "rowwise": "E4M3, one power-of-two scale per row along each matmul's reduction",
          "blockwise": "E4M3, 1×128 tiles of activations and gradients, 128×128 weight blocks, fp32 every 128",
          "mxfp8": "MXFP8: E4M3 in 1×32 blocks along each matmul's reduction, E8M0 power-of-two scales (RCEIL)",
          "nvfp4": "NVFP4: E2M1 in 1×16 blocks, E4M3 block scales and an fp32 tensor scale, 16×16 weight blocks",
          "nvfp4-1d": "NVFP4: E2M1 in 1×16 blocks, E4M3 block scales and an fp32 tensor scale"}


@dataclass(frozen=True)
class MaxOver:
    """Elementwise maximum over a mesh group, in place (an amax that spans its ranks)."""

    group: Group

    def max_(self, t: Tensor) -> None:
        ops.all_reduce(t, self.group, op=dist.ReduceOp.MAX)


def split_dim(local: int, group: Group) -> Dim:
    """A feature dimension of which this rank holds the contiguous chunk `group.rank` of
    `group.size` (a tensor-parallel split; padding, if any, is zeros at the end)."""
    if not group.active:
        return Dim.whole(local)
    return Dim(local, local * group.size, group.rank * local, split=MaxOver(group), aligned=local)


class Tokens:
    """The token dimension of a linear layer's input [..., K] on this rank: the flattened
    micro-batch, or under context parallelism this rank's zigzag share of each row, at
    global index b·S + position (cached per shape)."""

    def __init__(self, cp: Group | None = None):
        self.cp = cp if cp is not None and cp.active else None
        self._cache: dict[tuple, Dim] = {}

    def __call__(self, shape: tuple[int, ...]) -> Dim:
        if shape not in self._cache:
            self._cache[shape] = self._dim(shape)
        return self._cache[shape]

    def _dim(self, shape: tuple[int, ...]) -> Dim:
        n = math.prod(shape)
        if self.cp is None:
            return Dim.whole(n)
        b, s = shape  # [b, s/cp] under context parallelism
        cp = self.cp.size
        full_s = s * cp
        index = (torch.arange(b)[:, None] * full_s + zigzag_index(full_s, cp, self.cp.rank)[None, :]).flatten()
        return Dim(n, b * full_s, index=index, split=MaxOver(self.cp),
                   aligned=full_s // (2 * cp) if full_s % (2 * cp) == 0 else 0)


class Float8Linear(nn.Module):
    """`nn.Linear` with its matmuls in fp8: the same `weight` and `bias`."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, plan: LinearPlan, layer: str = ""):
        super().__init__()
        self.weight, self.bias, self.plan, self.layer = weight, bias, plan, layer

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.bias, self.plan, self.layer)

    def extra_repr(self) -> str:
        return f"in={self.plan.k.full}, out={self.plan.n.full}, fp8 {self.plan.recipe.name}"


class _Product:
    """An fp8 `linear(x, weight, bias)` bound to its plan (a tensor-parallel layer's)."""

    def __init__(self, plan: LinearPlan, layer: str = ""):
        self.plan, self.layer = plan, layer

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return fp8_linear(x, weight, bias, self.plan, self.layer)


class _ExpertProduct:
    """The fp8 product of one routed-expert weight (`layer`: its name; `first_expert`: the
    global index of this rank's first expert; `sources`: how many data-parallel ranks away
    each ep rank is, whose micro-batches' rows arrive here: NVFP4's rounding keys)."""

    def __init__(self, plan: LinearPlan, layer: str = "", first_expert: int = 0, sources: tuple[int, ...] = (0,)):
        self.plan, self.layer, self.first_expert, self.sources = plan, layer, first_expert, sources

    def __call__(self, x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
        return fp8_expert_matmul(x, w, counts, self.plan,
                                 expert_keys(counts, self.plan, self.layer, self.first_expert, self.sources))


def ep_sources(mesh: ParallelMesh) -> tuple[int, ...]:
    """For each rank of this rank's ep group, in its order: its data-parallel index minus this
    rank's (an ep group lies within the data-parallel ranks: MoE with fp8 has cp = 1)."""
    ep, dp = mesh.group("ep"), mesh.group("dp")
    if not ep.active:
        return (0,)
    return tuple(dp.ranks.index(r) - dp.rank for r in ep.ranks)


def _swap(module: nn.Module, plan_for, tp: Group, name: str):
    """The fp8 version of one linear layer (or None to keep the module, given a product).
    `plan_for(k, n)`: the plan of a weight [n, k] as this rank holds it."""
    if isinstance(module, ColumnParallelLinear):
        out_local, k = module.weight.shape
        module.linear = _Product(plan_for(Dim.whole(k), split_dim(out_local, tp)), name)
        return None
    if isinstance(module, RowParallelLinear):
        n, in_local = module.weight.shape
        module.linear = _Product(plan_for(split_dim(in_local, tp), Dim.whole(n)), name)
        return None
    if type(module) is nn.Linear:
        return Float8Linear(module.weight, module.bias,
                            plan_for(Dim.whole(module.in_features), Dim.whole(module.out_features)), name)
    raise ValueError(f"fp8 has no plan for a {type(module).__name__} "
                     "(tensor parallelism with fewer KV heads than tp ranks is refused in config)")


def apply(model: nn.Module, mesh: ParallelMesh, recipe: str, backend: str | None = None,
          nv: Nvfp4 | None = None, base_blocks: frozenset[int] = frozenset()) -> list[str]:
    """Swap the block linears and experts of `model` (a decoder or a pipeline chunk, laid
    out by the other dimensions) for fp8 ones, in place; returns the names swapped. `nv`:
    NVFP4's options; `base_blocks`: blocks left in the base dtype (NVFP4's tail)."""
    r = RECIPES[recipe]
    if nv is not None and nv.rounding is not None:
        setattr(model, ROUNDING, nv.rounding)  # the schedules set its micro-batch (set_micro)
    tokens, tp, expert_tokens = Tokens(mesh.group("cp")), mesh.group("tp"), Tokens()
    # One plan per shape, shared by every block: torch.compile guards on the plan object a
    # block reads, so a plan per block made it compile every block anew (8 graphs for 8
    # blocks, 99 s against 4 s for the same model in fp32 on the CPU; > 120 s for the 1B
    # preset on an H200). Layers of one shape record the same back ends anyway.
    shared: dict[tuple, LinearPlan] = {}

    def plan_for(k: Dim, n: Dim, experts: bool = False) -> LinearPlan:
        key = (k, n, experts)  # a Dim compares by its sizes and offset
        if key not in shared:
            shared[key] = LinearPlan(r, k, n, expert_tokens if experts else tokens, backend, nv=nv)
        return shared[key]

    done = []
    for name, module in list(model.named_modules()):
        if name.startswith("layers.") and int(name.split(".")[1]) in base_blocks:
            continue
        if any(fnmatchcase(name, p) for p in LINEARS):
            new = _swap(module, plan_for, tp, name)
            if new is not None:
                model.set_submodule(name, new)
            done.append(name)
        elif fnmatchcase(name, EXPERTS) and isinstance(module, Experts):
            for w in ("w1", "w2", "w3"):
                local, n, k = getattr(module, w).shape
                module.matmuls[w] = _ExpertProduct(plan_for(Dim.whole(k), Dim.whole(n), experts=True), f"{name}.{w}",
                                                   mesh.group("ep").rank * local, ep_sources(mesh))
            done.append(name)
    return done


def recipe_of(t) -> str | None:
    """The recipe a train section runs (None: no fp8 or micro-scaled matmuls)."""
    if t.precision == "nvfp4":
        return "nvfp4" if t.nvfp4_2d_weights else "nvfp4-1d"
    return t.fp8_recipe if t.precision == "fp8" else None


def options(t, n_layers: int, dp_size: int = 1) -> tuple[Nvfp4 | None, frozenset[int]]:
    """NVFP4's options and tail for a train section (None and no tail otherwise); `dp_size`
    gives the micro-batches per data-parallel rank (routed experts' rounding keys)."""
    if t.precision != "nvfp4":
        return None, frozenset()
    per_rank = t.global_batch // dp_size // t.micro_batch if t.micro_batch else 1
    rounding = Rounding(t.seed, per_rank=per_rank) if t.nvfp4_stochastic_rounding else None
    return Nvfp4(t.nvfp4_hadamard, rounding, t.seed), base_blocks(n_layers, t.nvfp4_base_blocks)


def summary(t, args: ModelArgs) -> str:
    """The dry run's and the run summary's line on what runs in which format."""
    nv, tail = options(t, args.n_layers)
    extra = ""
    if nv is not None:
        extra = (f"; weight-gradient inputs {'through' if nv.hadamard else 'without'} the 16×16 random Hadamard "
                 f"transform; gradients rounded {'stochastically' if nv.rounding else 'to nearest'}")
    return describe(args, recipe_of(t), t.fp8_base, tail, extra)["text"]


def base_blocks(n_layers: int, keep: int) -> frozenset[int]:
    """NVFP4's tail: the last `keep` blocks (-1: the last 15%, rounded, as torchtitan's
    nvfp4.md keeps; arXiv 2509.25149 keeps about 16% of a 12B model's)."""
    n = round(0.15 * n_layers) if keep < 0 else keep
    return frozenset(range(n_layers - n, n_layers))


def begin_step(model: nn.Module, step: int, first_micro: int) -> None:
    """Before a step: its number, and the index in the global batch of this data-parallel
    rank's first micro-batch, for NVFP4's stochastic rounding (every plan's, one object)."""
    for plan in plans(model):
        if plan.nv is not None and plan.nv.rounding is not None:
            plan.nv.rounding.step, plan.nv.rounding.first = step, first_micro


def plans(model: nn.Module) -> list[LinearPlan]:
    """Every fp8 plan in `model`, each once (layers of one shape share theirs)."""
    found = {}
    for m in model.modules():
        plan = getattr(m, "plan", None) or getattr(getattr(m, "linear", None), "plan", None)
        if isinstance(plan, LinearPlan):
            found[id(plan)] = plan
        if isinstance(m, Experts):
            found.update((id(p.plan), p.plan) for p in m.matmuls.values() if isinstance(p, _ExpertProduct))
    return list(found.values())


def _label(backends: dict[str, str]) -> str:
    """One back end, or each matmul's where they differ."""
    if len(set(backends.values())) == 1:
        return next(iter(backends.values()))
    return ", ".join(f"{what.replace('_', ' ')} {b}" for what, b in backends.items())


def backend_counts(model: nn.Module, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    """{back end: number of this rank's fp8 linear layers that run on it} for inputs whose
    leading dimensions are `shape` (a micro-batch as this rank holds it), from each layer's own
    code on fake tensors (kernels/fp8_linear.predict_backends), so it holds compiled or not;
    it warns once per reason, as the run does. Routed experts (one layer per expert): their
    recorded back ends once a step has run, else "experts (not run yet)"."""
    counts: dict[str, int] = {}
    seen: dict[tuple, str] = {}
    for m in model.modules():
        if isinstance(m, Experts):
            for p in m.matmuls.values():
                if isinstance(p, _ExpertProduct):
                    label = "experts: " + (_label(p.plan.backends) if p.plan.backends else "not run yet")
                    counts[label] = counts.get(label, 0) + m.w1.shape[0]
            continue
        plan = m.plan if isinstance(m, Float8Linear) else getattr(getattr(m, "linear", None), "plan", None)
        if not isinstance(plan, LinearPlan):
            continue
        tokens = plan.tokens(tuple(shape))
        key = (plan.recipe.name, plan.k, plan.n, plan.backend, tokens)
        if key not in seen:
            seen[key] = _label(predict_backends(plan, tokens, dtype, device))
        counts[seen[key]] = counts.get(seen[key], 0) + 1
    return counts


def saved_fp8_bytes(model: nn.Module, reset: bool = False) -> int:
    """Bytes of fp8 tensors that forwards have kept for backward since the last reset."""
    total = 0
    for plan in plans(model):
        total += plan.saved_fp8[0]
        if reset:
            plan.saved_fp8[0] = 0
    return total


def describe(args: ModelArgs, recipe: str, base: str, tail: frozenset[int] = frozenset(), extra: str = "") -> dict:
    """Which matmuls run in fp8 (or a micro-scaled format) and which stay in the base dtype
    (the dry run and the run summary print it). `tail`: blocks kept whole in the base dtype."""
    blocks = [i for i in range(args.n_layers) if i not in tail]
    moe = [i for i in blocks if args.is_moe_layer(i)]
    dense = len(blocks) - len(moe)
    parts = [f"attention wq wk wv wo ({len(blocks)} blocks)"]
    if dense:
        parts.append(f"MLP w1 w2 w3 ({dense} blocks)")
    if moe:
        parts.append(f"routed experts w1 w2 w3 ({args.moe_experts} per block, {len(moe)} blocks)")
        if args.moe_shared_experts:
            parts.append("shared experts w1 w2 w3")
    linears = 4 * len(blocks) + 3 * dense + 3 * len(moe) * (args.moe_experts + (1 if args.moe_shared_experts else 0))
    fmt = RECIPES[recipe].kind if RECIPES[recipe].micro else "fp8"
    stay = STAY + (f", blocks {min(tail)}-{max(tail)} (the last {len(tail)})" if tail else "")
    name = recipe if fmt == "fp8" else fmt
    return {"recipe": recipe, "scales": SCALES[recipe], "fp8": parts, "fp8_linears": linears, "base": base,
            "stay": stay,
            "text": (f"{'fp8 ' if fmt == 'fp8' else ''}{name} ({SCALES[recipe]}{extra}): forward, input- and "
                     f"weight-gradient matmuls of {linears} linear layers: {'; '.join(parts)}. In {base}: {stay}.")}


def weights(model: nn.Module) -> set[int]:
    """ids of the weights whose matmuls run in fp8 (not the routed experts'): what ZeRO-3's
    fp8 all-gather may gather in fp8 (parallel/fp8_gather.py)."""
    found = set()
    for m in model.modules():
        if isinstance(m, Float8Linear) or isinstance(getattr(m, "linear", None), _Product):
            found.add(id(m.weight))
    return found
