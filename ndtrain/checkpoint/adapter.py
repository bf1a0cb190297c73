"""A LoRA run's adapters out of a checkpoint: merged into their base weights (`ndtrain convert
--to-hf`), or as a PEFT adapter folder (`--to-hf --adapter`) that `peft.PeftModel` loads onto
the base model in Hugging Face form.

The folder holds `adapter_config.json` (peft_type LORA, r, lora_alpha, lora_dropout, the
adapted modules by their full HF names, so no other module of the same short name is
touched) and `adapter_model.safetensors`, whose keys are PEFT's:
`base_model.model.<HF module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r], our A
and B unchanged (PEFT computes x·Aᵀ·Bᵀ·alpha/r, as we do). The base model is the one the
run started from: `base_model_name_or_path` names it when that was a Hugging Face folder
(`model.init_from=hf:DIR`); otherwise export the starting run with `--to-hf`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ndtrain.checkpoint.files import write_safetensors
from ndtrain.checkpoint.slices import Piece
from ndtrain.config import ConfigError
from ndtrain.model import hf
from ndtrain.model.args import ModelArgs
from ndtrain.model.lora import is_adapter, with_rows


def adapted(weight_name: str) -> str:
    """`layers.0.attention.wq.weight` → `layers.0.attention.wq`, the module an adapter sits on."""
    return weight_name.rsplit(".", 1)[0]


def _read(source, name: str, shape: tuple) -> torch.Tensor:
    data = torch.empty(int(torch.Size(shape).numel()), dtype=torch.float64)
    source.fill(f"weight/{name}", Piece.whole(shape), data)
    return data.view(shape)


def merged_fetch(source, name: str, weights: dict, args: ModelArgs, target: torch.dtype):
    """A function reading W + (alpha/r)·B·A of base weight `name`, in fp64, cast to `target`."""
    module = adapted(name)

    def read():
        w = _read(source, name, tuple(weights[name]["shape"]))
        a = _read(source, f"{module}.lora.a", tuple(weights[f"{module}.lora.a"]["shape"]))
        b = _read(source, f"{module}.lora.b", tuple(weights[f"{module}.lora.b"]["shape"]))
        return (w + (args.lora_alpha / args.lora_rank) * (b @ a)).to(target)
    return read


def rows_fetch(source, name: str, weights: dict, args: ModelArgs, target: torch.dtype):
    """A function reading embedding or head weight `name` with its trained token rows added,
    W[lora_tokens] + rows, in fp64, cast to `target`."""
    rows = f"{adapted(name)}.lora.rows"

    def read():
        w = _read(source, name, tuple(weights[name]["shape"]))
        return with_rows(w, _read(source, rows, tuple(weights[rows]["shape"])), args.lora_tokens).to(target)
    return read


def token_values_fetch(source, name: str, weights: dict, args: ModelArgs):
    """A function reading the trained rows' values alone, (W[lora_tokens] + rows) in fp32:
    what PEFT's `trainable_tokens_delta` holds (it replaces those rows)."""
    base, shape = adapted(adapted(name)) + ".weight", tuple(weights[name]["shape"])
    ids = torch.tensor(args.lora_tokens, dtype=torch.long)

    def read():
        w = _read(source, base, tuple(weights[base]["shape"]))
        return (w[ids] + _read(source, name, shape)).float()
    return read


def check_adapter(args: ModelArgs, family, run) -> None:
    """--adapter needs a LoRA run whose adapted weights are whole tensors in the family's
    checkpoint (not rows of a fused projection, as Phi-3's qkv_proj)."""
    if not args.lora_rank:
        raise ConfigError("--adapter", str(run), "the run has no LoRA adapters (lora.rank = 0); export it without "
                          "--adapter")
    for target in args.lora_targets:
        probe = {"wq": "attention.wq", "wk": "attention.wk", "wv": "attention.wv", "wo": "attention.wo"}.get(
            target, f"feed_forward.{target}")
        parts = hf.hf_parts(f"layers.0.{probe}.weight", args, family)
        if len(parts) != 1 or parts[0].rows is not None:
            raise ConfigError("--adapter", str(run), f"{family.model_type} fuses {target} into {parts[0].hf}; a PEFT "
                              "adapter cannot address part of it: export merged weights (without --adapter)")


def base_model_path(meta: dict) -> str | None:
    """The Hugging Face folder the run started from, if it did."""
    init = ((meta.get("config") or {}).get("model") or {}).get("init_from") or ""
    return str(Path(init[3:]).expanduser().resolve()) if init.startswith("hf:") else None


def write_adapter(source, weights: dict, args: ModelArgs, family, base: str | None, out: Path) -> Path:
    """adapter_model.safetensors and adapter_config.json into `out` (fp32 tensors)."""
    entries, modules, tokens = [], set(), {}
    for name in sorted(weights):
        if not is_adapter(name):
            continue
        if name.endswith(".lora.rows"):  # PEFT's trainable tokens: the rows' values, W[ids] + rows
            hf_module = adapted(hf.hf_name(adapted(adapted(name)) + ".weight", family))
            tokens[hf_module.rsplit(".", 1)[-1]] = list(args.lora_tokens)
            key = f"base_model.model.{hf_module}.token_adapter.trainable_tokens_delta"
            entries.append((key, torch.float32, tuple(weights[name]["shape"]),
                            token_values_fetch(source, name, weights, args)))
            continue
        module = adapted(adapted(name))  # layers.0.attention.wq
        hf_module = adapted(hf.hf_name(f"{module}.weight", family))
        modules.add(hf_module)
        shape = tuple(weights[name]["shape"])
        key = f"base_model.model.{hf_module}.{'lora_A' if name.endswith('.a') else 'lora_B'}.weight"
        entries.append((key, torch.float32, shape, lambda n=name, s=shape: _read(source, n, s).float()))
    write_safetensors(out / "adapter_model.safetensors", sorted(entries, key=lambda e: e[0]), {"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": args.lora_rank, "lora_alpha": args.lora_alpha,
              "lora_dropout": args.lora_dropout, "target_modules": sorted(modules), "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
              "modules_to_save": None, "inference_mode": True, "base_model_name_or_path": base,
              "trainable_token_indices": tokens or None}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out
