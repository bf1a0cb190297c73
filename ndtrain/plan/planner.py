"""One layout on one cluster: memory per rank, step time, throughput, days.

`plan_config(cfg, cluster, gpus)` validates the layout with the rules `train` enforces
(config.validate) for that many GPUs, then `make_plan` puts the memory model
(plan/memory.py) and the time model (plan/steptime.py) together. Throughput follows from
the step time: tokens/s = global batch × sequence / step time; MFU = the model FLOPs of the
step (`flops_per_token`, no recomputation) over step time × GPUs × peak; HFU = the hardware
FLOPs (recomputation included, plan/flops.py) over the same. An achieved rate given in
either convention (`Rate`: MFU or model TFLOP/s per GPU, as PaLM and Llama 3 publish; HFU or
hardware TFLOP/s, as Megatron's papers publish) replaces the model's estimate end to end (a
published throughput already includes its communication and bubble), and the modelled
breakdown is kept for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

from ndtrain.config import Config, ConfigError, validate
from ndtrain.config.sections import resolve_precision
from ndtrain.model.args import ModelArgs, param_count
from ndtrain.plan.cluster import THIS_MACHINE, Cluster
from ndtrain.plan.flops import hardware_flops_per_step, model_flops_per_step
from ndtrain.plan.formulas import mfu
from ndtrain.plan.fp8 import Fp8
from ndtrain.plan.memory import RankMemory, per_rank
from ndtrain.plan.steptime import StepTime, step_time

SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True)
class Rate:
    """An achieved rate: `value` is a fraction of the peak (`utilization`) or TFLOP/s per GPU,
    counting model FLOPs (`hardware=False`: MFU, `--tflops`) or hardware FLOPs (HFU,
    `--hfu-tflops`)."""

    value: float
    utilization: bool
    hardware: bool

    @property
    def flag(self) -> str:
        return {(False, False): "--tflops", (True, False): "--mfu", (False, True): "--hfu-tflops",
                (True, True): "--hfu"}[(self.utilization, self.hardware)]

    def flops_per_s(self, peak: float) -> float:
        return self.value * peak if self.utilization else self.value * 1e12


@dataclass
class Plan:
    cfg: Config
    args: ModelArgs
    cluster: Cluster  # per device (a shared CPU node divided among its processes)
    memory: list[RankMemory]  # per pipeline stage
    step: StepTime  # the modelled step (busiest stage)
    stages: list[StepTime]
    step_time_s: float
    rate_source: str
    tokens: float | None = None
    fp8: Fp8 | None = None
    imbalance: float = 1.0  # MoE: the busiest rank's routed slots over the average

    @property
    def world(self) -> int:
        return self.cfg.parallel.world

    @property
    def worst(self) -> RankMemory:
        return max(self.memory, key=lambda m: m.total)

    @property
    def fits(self) -> bool:
        return self.worst.total <= self.cluster.usable_memory

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch * self.cfg.train.seq_len

    @property
    def flops_per_step(self) -> float:
        return model_flops_per_step(self.cfg, self.args)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def hardware_flops_per_step(self) -> float:
        return hardware_flops_per_step(self.cfg, self.args)

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU (the MFU convention)."""
        return self.flops_per_step / self.step_time_s / self.world / 1e12

    @property
    def hfu_tflops_per_gpu(self) -> float:
        """Hardware TFLOP/s per GPU, recomputation included (Megatron's convention)."""
        return self.hardware_flops_per_step / self.step_time_s / self.world / 1e12

    @property
    def peak(self) -> float:
        return self.cluster.peak_flops(self.cfg.train.precision)

    @property
    def mfu(self) -> float:
        return mfu(self.flops_per_step, self.step_time_s, self.world, self.peak)

    @property
    def hfu(self) -> float:
        return mfu(self.hardware_flops_per_step, self.step_time_s, self.world, self.peak)

    @property
    def days(self) -> float | None:
        return None if self.tokens is None else self.tokens / self.tokens_per_s / SECONDS_PER_DAY

    def as_json(self) -> dict:
        """The object `ndtrain plan --json` prints; scripts depend on these keys."""
        p, t = self.cfg.parallel, self.cfg.train
        w = self.worst
        out = {
            "cluster": self.cluster.name, "gpus": self.world,
            "layout": {"pp": p.pp, "dp": p.dp, "dp_replicate": p.dp_replicate, "cp": p.cp, "tp": p.tp,
                       "sp": p.sp, "ep": p.ep, "zero": p.zero, "pp_schedule": p.pp_schedule,
                       "pp_virtual": p.pp_virtual},
            "model": {"preset": self.cfg.model.preset, "params": param_count(self.args),
                      "active_params": param_count(self.args, active=True), **self.args.to_dict()},
            "params": param_count(self.args),
            "active_params": param_count(self.args, active=True),
            "train": {"global_batch": t.global_batch, "micro_batch": t.micro_batch, "seq_len": t.seq_len,
                      "precision": self.fp8.precision if self.fp8 else t.precision, "recompute": t.recompute,
                      **({"fp8_recipe": self.fp8.recipe, "fp8_all_gather": self.fp8.all_gather} if self.fp8 else {})},
            "moe_imbalance": self.imbalance,
            "memory_per_rank": {k: int(v) for k, v in w.as_dict().items()},
            "memory_at_peak": {k: int(v) for k, v in w.at_peak.items()},
            "memory_per_stage": [{"stage": m.stage, "params_count": m.params_count,
                                  **{k: int(v) for k, v in m.as_dict().items()}} for m in self.memory],
            "device_memory": int(self.cluster.memory),
            "usable_memory": int(self.cluster.usable_memory),
            "fits": self.fits,
            "step_time_s": self.step_time_s,
            "step_time_model_s": {k: v for k, v in self.step.as_dict().items()},
            "bubble_fraction": self.step.detail.get("bubble_fraction", 0.0),
            "rate": self.rate_source,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "hfu_tflops_per_gpu": self.hfu_tflops_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "model_flops_per_step": self.flops_per_step,
            "hardware_flops_per_step": self.hardware_flops_per_step,
        }
        if self.tokens is not None:
            out["tokens"] = self.tokens
            out["days"] = self.days
        return out


def plan_config(cfg: Config, cluster: Cluster, gpus: int | None) -> tuple[Config, Cluster]:
    """Validate `cfg` for `gpus` GPUs as `train` would (a copy), and the cluster per device."""
    cfg = cfg.copy()
    p = cfg.parallel
    fixed = p.pp * p.cp * p.tp
    if gpus is None:  # the layout's product, else one node (this machine: 2 processes), at least pp×cp×tp
        node = 2 if cluster.name == THIS_MACHINE else cluster.gpus_per_node
        gpus = cfg.run.nproc or (p.world if p.dp else max(node // fixed, 1) * fixed)
    if gpus < 1:
        raise ConfigError("--gpus", gpus, "must be > 0")
    if p.dp and p.world != gpus:
        raise ConfigError("parallel", f"pp×dp×cp×tp = {p.pp}×{p.dp}×{p.cp}×{p.tp} = {p.world}",
                          f"must equal the GPU count, {gpus} (--gpus)")
    if not p.dp and gpus % fixed:
        raise ConfigError("--gpus", gpus, f"must be a multiple of pp×cp×tp = {p.pp}×{p.cp}×{p.tp} = {fixed}")
    resolve_precision(cfg.train, cuda=cluster.name != THIS_MACHINE)  # auto: what `train` would pick there
    if cfg.train.precision == "fp64" and cluster.name != THIS_MACHINE:
        raise ConfigError("train.precision", "fp64", "fp64 is for the CPU layout proofs; on GPUs use fp32, bf16 or fp16")
    cfg.run.device, cfg.run.nproc = "cpu", 0  # the planner never touches a device
    validate(cfg, world=gpus, check_paths=False)
    return cfg, cluster.per_device(gpus)  # this machine: every process is local


def priced_in_bf16(cfg: Config) -> Config:
    """An fp8 config as the planner prices it, once validated as fp8 (the rules `train`
    enforces): bf16 for everything but the blocks' fp8 matmul operands, which `Fp8` holds."""
    if cfg.train.precision not in ("fp8", "nvfp4"):
        return cfg
    cfg = cfg.copy()
    t = cfg.train
    t.precision = "bf16"
    for key in ("fp8_recipe", "fp8_base", "fp8_all_gather", "nvfp4_hadamard", "nvfp4_stochastic_rounding",
                "nvfp4_2d_weights", "nvfp4_base_blocks"):
        setattr(t, key, type(t).__dataclass_fields__[key].default)
    return cfg


def make_plan(cfg: Config, args: ModelArgs, cluster: Cluster, *, rate: Rate | None = None,
              tokens: float | None = None, fp8: Fp8 | None = None, imbalance: float = 1.0) -> Plan:
    """`cfg` validated (as fp8 under fp8: its bf16 pricing is made here), `cluster` per device
    (plan_config). A given rate above the peak is refused (ConfigError)."""
    cfg = priced_in_bf16(cfg)
    step, stages = step_time(cfg, args, cluster, fp8, imbalance)
    peak = cluster.peak_flops(cfg.train.precision)
    if rate is not None:
        flops = (hardware_flops_per_step if rate.hardware else model_flops_per_step)(cfg, args)
        per_gpu = rate.flops_per_s(peak)
        limit = cluster.peak_flops(fp8.peak_key) if fp8 is not None else peak
        if per_gpu > limit:
            raise ConfigError(rate.flag, rate.value, f"is above the {fp8.peak_key if fp8 is not None else cfg.train.precision}"
                              f" peak of {cluster.name}, {limit / 1e12:,.4g} TFLOP/s per GPU: no run achieves more "
                              "than the peak")
        kind = "hardware" if rate.hardware else "model"
        source = (f"given: {per_gpu / 1e12:,.4g} {kind} TFLOP/s per GPU"
                  + (f" ({'HFU' if rate.hardware else 'MFU'} {rate.value:.1%})" if rate.utilization else ""))
        seconds = flops / (per_gpu * cfg.parallel.world)
    else:
        how = ("measured kernel by kernel (bench plan)" if cluster.compute is not None
               else f"at {cluster.efficiency:.0%} of peak")
        source = f"modelled: compute {how}, plus communication and bubble"
        seconds = step.total
    return Plan(cfg, args, cluster, per_rank(cfg, args, fp8), step, stages, seconds, source, tokens, fp8, imbalance)
