"""`validate`: everything that can be checked before a process starts, in a fixed order, so
the mistake reported is always the first one found: each section's own keys (sections.py),
the layout across sections (layout.py), fault tolerance (faults.py), the Hugging Face families' features (family.py), the paths (paths.py), the task sections (tasks.py), LoRA (lora.py)."""

from __future__ import annotations

from ndtrain.config.data_sources import check_sources
from ndtrain.config.deepseek import check_deepseek
from ndtrain.config.faults import check_fault_tolerance
from ndtrain.config.family import check_family, check_family_keys
from ndtrain.config.layout import (check_context, check_fp8, check_heads, check_moe, check_pipeline,
                                   check_sequence, check_tensor, resolve_layout)
from ndtrain.config.lora import check_lora
from ndtrain.config.paths import check_files
from ndtrain.config.schema import Config
from ndtrain.config.sections import (check_compile, check_data, check_model, check_parallel, check_run, check_train,
                                     positive)
from ndtrain.config.tasks import check_dpo, check_rl, check_sft
from ndtrain.model.args import PRESETS


def validate(cfg: Config, *, world: int | None = None, check_paths: bool = True) -> Config:
    """Check everything that can be checked before a process starts; fills derived values
    (parallel.dp, run.nproc, train.micro_batch, parallel.sp). Raises the first ConfigError."""
    m = cfg.model
    check_model(m, check_paths, cfg.run.device)
    check_parallel(cfg.parallel)
    check_train(cfg.train, cfg.run.device)
    check_compile(cfg.train, cfg.parallel, cfg.run.device)
    check_run(cfg.run)
    positive("train.keep_checkpoints", cfg.train.keep_checkpoints, zero_ok=True)

    resolve_layout(cfg, world)
    check_fault_tolerance(cfg)
    check_family_keys(m)
    a = cfg.model_args(vocab_size=m.vocab_size or PRESETS[m.preset].vocab_size)
    check_heads(cfg, a)
    check_pipeline(cfg, a)
    check_tensor(cfg, a)
    check_sequence(cfg, a)
    check_moe(cfg, a)
    check_deepseek(cfg, a)
    check_context(cfg, a)
    check_family(cfg, a)
    check_fp8(cfg, a)
    check_lora(cfg, a)

    if check_paths:
        check_files(cfg)
    check_data(cfg.data)
    check_sources(cfg.data.sources, cfg.data.path, check_paths, cfg.explicit)
    check_sft(cfg.sft)
    check_rl(cfg.rl)
    check_dpo(cfg.dpo)
    return cfg
