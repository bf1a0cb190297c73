"""Typed configuration: TOML file + dotted KEY=VALUE overrides, checked before any process starts.

A config is nine sections (model, parallel, train, data, sft, rl, dpo, lora, run) of plain dataclasses
(schema.py). Values come from the defaults, then a TOML file, then command-line overrides
(load.py). `validate()` (validate.py, one function per section in sections.py, layout.py,
paths.py and tasks.py) turns every mistake we can see up front into a `ConfigError`: one line
naming the key, the value and the rule. The CLI prints it and exits with status 2 before
writing anything.

Every name is importable from `ndtrain.config` itself.
"""

from ndtrain.config.layout import MOE_KEYS, default_local_processes, parse_split, resolve_world, split_error
from ndtrain.config.load import load_config, to_toml
from ndtrain.config.paths import (EMBEDDED_DATA, check_out_folder, check_run_folder, check_writable_dir,
                                  is_prepared_folder)
from ndtrain.config.schema import (DPO_DEFAULTS, FAMILY_KEYS, RL_DEFAULTS, SECTIONS, SFT_DEFAULTS, Config,
                                   ConfigError, DataConfig, DPOConfig, LoRAConfig, ModelConfig, ParallelConfig,
                                   RLConfig, RunConfig, SFTConfig, TrainConfig, all_keys, from_dict, model_key_value,
                                   rl_clip_high, rl_overlong_buffer, window_layers_of)
from ndtrain.config.sections import (BAD_RECORD_POLICIES, CP_IMPLS, NOT_YET, PACKINGS, PP_SCHEDULES, PRECISIONS,
                                     TEMPLATES, TRUNCATIONS, recompute_every)
from ndtrain.config.tasks import RL_LOSSES, RL_SIZES, RL_TASKS, check_dpo_job, check_rl_job
from ndtrain.config.validate import validate

__all__ = [
    "FAMILY_KEYS", "model_key_value", "window_layers_of", "DPO_DEFAULTS", "DPOConfig", "check_dpo_job",
    "BAD_RECORD_POLICIES", "CP_IMPLS", "EMBEDDED_DATA", "MOE_KEYS", "NOT_YET", "PACKINGS", "PP_SCHEDULES", "PRECISIONS",
    "RL_DEFAULTS", "RL_LOSSES", "RL_SIZES", "RL_TASKS", "SECTIONS", "SFT_DEFAULTS", "TEMPLATES", "TRUNCATIONS",
    "Config", "ConfigError", "DataConfig", "LoRAConfig", "ModelConfig", "ParallelConfig", "RLConfig", "RunConfig", "SFTConfig",
    "TrainConfig", "all_keys", "check_out_folder", "check_rl_job", "check_run_folder", "check_writable_dir",
    "default_local_processes",
    "from_dict", "is_prepared_folder", "load_config", "parse_split", "recompute_every", "resolve_world", "rl_clip_high",
    "rl_overlong_buffer", "split_error", "to_toml", "validate",
]
