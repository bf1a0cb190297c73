"""Validation of the [lora] section (model/lora.py) and the layouts it runs under."""

from __future__ import annotations

from ndtrain.config.schema import Config, ConfigError, lora_targets
from ndtrain.model.lora import INITS, TARGETS


ATTENTION, MLP = ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b"), ("w1", "w2", "w3")


def check_lora(cfg: Config, a=None) -> None:
    """The [lora] keys; `a`: the model's ModelArgs, to check that the targets select a layer,
    else the optimizer would get no parameter to train."""
    lora, t, p = cfg.lora, cfg.train, cfg.parallel
    if lora.rank < 0:
        raise ConfigError("lora.rank", lora.rank, "must be >= 0 (0 = no LoRA)")
    if not lora.rank:
        return
    if lora.alpha <= 0:
        raise ConfigError("lora.alpha", lora.alpha, "must be > 0 (the update is alpha / rank · B·A·x)")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError("lora.dropout", lora.dropout, "must be in [0, 1)")
    targets = lora_targets(lora.targets)
    unknown = [x for x in targets if x not in TARGETS]
    if not targets or unknown:
        raise ConfigError("lora.targets", lora.targets, f"expected a comma-separated list of {', '.join(TARGETS)}")
    if a is not None:
        _check_targets_select(cfg, a, targets)
    if lora.init not in INITS:
        raise ConfigError("lora.init", lora.init, f"expected one of {', '.join(INITS)}")
    if t.optimizer == "muon":
        raise ConfigError("train.optimizer", t.optimizer, "Muon orthogonalises whole weight matrices; a LoRA "
                          "adapter's low-rank factors are not that: use train.optimizer=adamw with lora.rank > 0")
    if t.precision in ("fp8", "nvfp4"):
        raise ConfigError("train.precision", t.precision, f"LoRA adapters have no {t.precision} product; use bf16 "
                          "with lora.rank > 0")
    if lora.dropout and (p.tp > 1 or p.cp > 1):
        key, value = ("parallel.tp", p.tp) if p.tp > 1 else ("parallel.cp", p.cp)
        raise ConfigError(key, value, "lora.dropout > 0 draws its mask on this rank's part of a layer's input, "
                          "which under tp or cp is not the mask one process draws; set lora.dropout = 0 here")


def check_lora_tokens(cfg: Config, added: tuple[int, ...]) -> None:
    """LoRA trains the rows a chat template adds to the vocabulary (model/lora.TokenRows);
    those rows are not split over tp or placed on pipeline stages yet."""
    p = cfg.parallel
    if not cfg.lora.rank or not added or (p.tp == 1 and p.pp == 1):
        return
    key, value = ("parallel.tp", p.tp) if p.tp > 1 else ("parallel.pp", p.pp)
    raise ConfigError(key, value, f"with lora.rank > 0 the {len(added)} tokens data.template=builtin adds to the "
                      "vocabulary train their embedding rows, which tensor and pipeline parallelism do not split yet; "
                      "use parallel.dp / parallel.zero, or a tokenizer that has its chat tokens (data.template=hf)")


def _check_targets_select(cfg: Config, a, targets: tuple[str, ...]) -> None:
    """An attention target selects a layer in every block; an MLP target only in the dense
    ones (a mixture of experts' experts keep plain weights, model/lora.py). (Each pipeline
    stage's share: plan/fit.check_lora_stages, which knows the engine's split.)"""
    from ndtrain.model.args import linear_shapes, lora_layers
    for x in targets:
        if x in ATTENTION and not lora_layers(a.with_(lora_targets=(x,))):
            kind = "latent attention (model.attention = 'mla')" if a.is_mla else "this model's attention"
            names = ", ".join(n for n in linear_shapes(a) if n not in MLP)
            raise ConfigError("lora.targets", cfg.lora.targets, f"{x} names no layer of {kind}: its projections are "
                              f"{names}")
    if any(x in ATTENTION for x in targets) or any(not a.is_moe_layer(i) for i in range(a.n_layers)):
        return
    raise ConfigError("lora.targets", cfg.lora.targets, f"selects no layer of model.preset = {cfg.model.preset!r}, "
                      "whose MLPs are all mixtures of experts (their experts keep plain weights): the optimizer "
                      f"would get no parameter; add an attention target ({', '.join(ATTENTION)})")
