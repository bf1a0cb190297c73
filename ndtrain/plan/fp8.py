"""fp8 training in the plan: `train.precision=fp8` with `train.fp8_recipe` and
`train.fp8_all_gather`, priced from formulas.

The engine's fp8 (issue 21) is being built; the planner plans it from what the recipe does,
not from measurements:
- the linear layers inside the blocks (attention projections, MLP, routed and shared experts)
  run their three matmuls (forward, input gradient, weight gradient) on fp8 operands at the
  cluster's dense fp8 peak; the embedding, the head, the attention core and the router stay
  in bf16, as do master weights, gradients and optimizer states (bf16 model states);
- memory: each such weight's fp8 copy (one byte per parameter, plus its scales: one fp32 per
  tensor (tensorwise), per row (rowwise) or per 128×128 block (blockwise)), made at the
  step's first forward and kept to its end; activations are counted in bf16 (a recipe that
  keeps its inputs in fp8 for the weight gradient holds less);
- ZeRO-3 with `train.fp8_all_gather=true` (tensorwise only): those weights travel and stay
  gathered in one byte each, half of bf16's, plus one all-reduce of their amaxes per step.
A cluster without an fp8 peak (the A100, this machine) cannot plan fp8.

The micro-scaled formats (issue 38) need Blackwell's block-scaled tensor cores (a cluster with
an fp4 peak: B200, GB200): `train.fp8_recipe=mxfp8` runs those matmuls at the fp8 peak with one
byte per value and one E8M0 byte per 32 values; `train.precision=nvfp4` at the fp4 peak with
half a byte per value, one E4M3 byte per 16×16 weight block and a 4-byte tensor scale, except
its tail (`train.nvfp4_base_blocks`, the last 15% by default), whose linears stay in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

from ndtrain.config import ConfigError
from ndtrain.model.args import ModelArgs

RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")
KEYS = ("train.precision", "train.fp8_recipe", "train.fp8_all_gather")
BLOCK = 128


@dataclass(frozen=True)
class Fp8:
    recipe: str = "tensorwise"  # or "mxfp8", or "nvfp4" (train.precision = nvfp4)
    all_gather: bool = False
    base_blocks: int = -1  # NVFP4's tail (train.nvfp4_base_blocks)

    @property
    def gathered_bytes(self) -> float:
        return 1.0

    @property
    def precision(self) -> str:
        return "nvfp4" if self.recipe == "nvfp4" else "fp8"

    @property
    def peak_key(self) -> str:
        """The cluster peak its low-precision matmuls run at."""
        return "fp4" if self.recipe == "nvfp4" else "fp8"

    @property
    def label(self) -> str:
        if self.recipe == "nvfp4":
            return "nvfp4 (E2M1, 1×16 blocks, 16×16 weight blocks)"
        return f"fp8 ({self.recipe}{', fp8 all-gathers' if self.all_gather else ''})"

    def tail(self, args: ModelArgs) -> frozenset[int]:
        """Blocks whose linears stay in bf16 (NVFP4's last 15%, or train.nvfp4_base_blocks)."""
        if self.recipe != "nvfp4":
            return frozenset()
        n = round(0.15 * args.n_layers) if self.base_blocks < 0 else self.base_blocks
        return frozenset(range(args.n_layers - n, args.n_layers))

    def scale_count(self, rows: int, cols: int) -> float:
        """Scales of one weight of rows × cols under the recipe."""
        if self.recipe == "tensorwise":
            return 1.0
        if self.recipe == "rowwise":
            return float(rows)
        if self.recipe == "mxfp8":  # 1×32 along K for the forward, 32×1 for the input gradient's copy
            return float(rows * -(-cols // 32))
        if self.recipe == "nvfp4":
            return float(-(-rows // 16) * -(-cols // 16))
        return float(-(-rows // BLOCK) * -(-cols // BLOCK))

    def value_bytes(self) -> float:
        return 0.5 if self.recipe == "nvfp4" else 1.0

    def scale_bytes(self) -> float:
        """Bytes per scale: fp32, or one byte (E8M0 for MXFP8, E4M3 for NVFP4)."""
        return 1.0 if self.recipe in ("mxfp8", "nvfp4") else 4.0

    def scales(self, args: ModelArgs, chunks) -> float:
        """Scales of the fp8 weights of `chunks`' blocks (one amax each, all-reduced per step)."""
        return sum(len(linear_shapes(args, i)) for ch in chunks for i in ch.layer_ids)

    def copy_bytes(self, args: ModelArgs, layers, tp: int, ep: int) -> float:
        """The fp8 copies of the linear weights of `layers` on one rank, with their scales."""
        total, tail = 0.0, self.tail(args)
        for i in layers:
            if i in tail:
                continue
            for rows, cols, times, split in linear_shapes(args, i, ep):
                rows_local = rows // tp if split else rows
                total += times * (self.value_bytes() * rows_local * cols
                                  + self.scale_bytes() * self.scale_count(rows_local, cols)
                                  + (4 if self.recipe == "nvfp4" else 0))
        return total


def linear_shapes(args: ModelArgs, layer: int, ep: int = 1) -> list[tuple[int, int, int, bool]]:
    """Block `layer`'s linear weights that run in fp8: (output rows, input columns, how many,
    split by tensor parallelism), the split dimension given whole."""
    h, q, kv, f = args.dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.ffn_dim
    out = [(q, h, 1, True), (kv, h, 2, True), (h, q, 1, True)]
    if not args.is_moe_layer(layer):
        return out + [(f, h, 2, True), (h, f, 1, True)]
    fe, local = args.expert_dim, args.moe_experts // ep
    out += [(fe, h, 2 * local, False), (h, fe, local, False)]
    if args.moe_shared_experts:
        s = args.moe_shared_experts * fe
        out += [(s, h, 2, False), (h, s, 1, False)]
    return out


def _bool(key: str, text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise ConfigError(key, text, "expected true or false")


def take_fp8(overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """Split `train.precision=fp8`, `train.fp8_recipe=…` and `train.fp8_all_gather=…` from the
    overrides while the configuration does not know fp8 yet (the engine's keys, issue 21)."""
    from ndtrain.config import TrainConfig

    known = "fp8_recipe" in TrainConfig.__dataclass_fields__
    rest, fp8 = [], {}
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.strip()
        if not known and key in KEYS and (key != "train.precision" or value.strip() == "fp8"):
            fp8[key] = value.strip()
        else:
            rest.append(item)
    return rest, fp8


def fp8_settings(cfg, given: dict[str, str], cluster) -> Fp8 | None:
    """The fp8 settings of a plan, validated (None: not fp8). `given`: what `take_fp8` took;
    once the configuration knows the keys, they come from `cfg` itself."""
    t = cfg.train
    if t.precision == "nvfp4":
        if not cluster.peak.get("fp4"):
            raise ConfigError("train.precision", "nvfp4", f"{cluster.name} has no block-scaled fp4 tensor cores to "
                              "plan with (Blackwell: B200, GB200)")
        return Fp8("nvfp4", base_blocks=t.nvfp4_base_blocks)
    if t.precision == "fp8":
        given = {"train.precision": "fp8", "train.fp8_recipe": t.fp8_recipe,
                 "train.fp8_all_gather": str(t.fp8_all_gather)}
    if given.get("train.precision") != "fp8":
        for key in ("train.fp8_recipe", "train.fp8_all_gather"):
            if key in given:
                raise ConfigError(key, given[key], "applies only with train.precision=fp8")
        return None
    recipe = given.get("train.fp8_recipe", "tensorwise")
    if recipe not in RECIPES:
        raise ConfigError("train.fp8_recipe", recipe, f"choose one of {', '.join(RECIPES)}")
    gather = _bool("train.fp8_all_gather", given.get("train.fp8_all_gather", "false"))
    if gather and recipe != "tensorwise":
        raise ConfigError("train.fp8_all_gather", "true", f"needs train.fp8_recipe=tensorwise (one scale per "
                          f"weight), not {recipe}")
    if gather and cfg.parallel.zero != 3:
        raise ConfigError("train.fp8_all_gather", "true", f"gathers ZeRO-3's parameters: needs parallel.zero=3, "
                          f"not {cfg.parallel.zero}")
    if not cluster.peak.get("fp8"):
        raise ConfigError("train.precision", "fp8", f"{cluster.name} has no fp8 matmul rate to plan with "
                          "(the A100 has no fp8 tensor cores; H100, H200 and B200 do)")
    if recipe == "mxfp8" and not cluster.peak.get("fp4"):
        raise ConfigError("train.fp8_recipe", "mxfp8", f"{cluster.name} has no block-scaled (MX) tensor cores to "
                          "plan with (Blackwell: B200, GB200)")
    return Fp8(recipe, gather)
