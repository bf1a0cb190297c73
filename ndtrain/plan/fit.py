"""Before `ndtrain train` starts a process: can the model states fit at all?

The planner's memory model gives the parameters, gradients and optimizer states of the
fullest rank (parallel/zero.model_state_bytes on its tensor-parallel shards of its
pipeline stage, routed experts split by expert parallelism and sharded over the ranks
holding the same experts). If those alone exceed the device (a GPU's memory; on the CPU the physical
RAM, which the local processes share), no run of this layout can succeed, so `train`
refuses it in one line, naming the model key, the bytes needed and the bytes there are.
"""

from __future__ import annotations

from ndtrain.config import Config, ConfigError
from ndtrain.model.args import kv_cache_elements_per_token
from ndtrain.plan.params import stage_chunks, stage_states

MODEL_KEYS = ("dim", "n_layers", "ffn_dim", "vocab_size", "n_heads", "n_kv_heads", "moe_experts", "moe_ffn_dim")


def device_memory(cfg: Config) -> tuple[float, str, bool]:
    """(bytes, what they are, whether the local processes share them)."""
    import torch

    from ndtrain.plan.cluster import physical_memory
    if cfg.run.device in ("auto", "cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"{props.name}'s memory", False
    return float(physical_memory()), "physical RAM", True


def model_states_per_rank(cfg: Config, vocab_size: int) -> float:
    """The fullest pipeline stage's model states, bytes per rank (cfg validated)."""
    args = cfg.model_args(vocab_size=vocab_size)
    return max(sum(stage_states(cfg, args, chunks).values()) for chunks in stage_chunks(cfg, args))


def check_lora_stages(cfg: Config) -> None:
    """Under LoRA with MLP targets only, every pipeline rank needs a dense block among its
    chunks: a rank of expert blocks only would train nothing (its optimizer gets no
    parameter). config/lora.py checks the whole model; the split is the engine's."""
    from ndtrain.config.lora import ATTENTION
    from ndtrain.config.schema import lora_targets
    if not cfg.lora.rank or cfg.parallel.pp == 1 or any(x in ATTENTION for x in lora_targets(cfg.lora.targets)):
        return
    args = cfg.model_args()
    for rank, chunks in enumerate(stage_chunks(cfg, args)):
        layers = [i for ch in chunks for i in ch.layer_ids]
        if all(args.is_moe_layer(i) for i in layers):
            raise ConfigError("lora.targets", cfg.lora.targets, f"selects no layer of pipeline rank {rank} (its block"
                              f"{'s' * (len(layers) > 1)} {', '.join(map(str, layers))}: only mixtures of experts, "
                              "whose experts keep plain weights): that rank would train nothing; add an attention "
                              f"target ({', '.join(ATTENTION)})")


def check_model_states_fit(cfg: Config, vocab_size: int, local_processes: int) -> None:
    need = model_states_per_rank(cfg, vocab_size)
    have, what, shared = device_memory(cfg)
    total = need * (local_processes if shared else 1)
    if total <= have:
        return
    key = next((f"model.{k}" for k in MODEL_KEYS if getattr(cfg.model, k) is not None), "model.preset")
    value = getattr(cfg.model, key.split(".")[1])
    gib = 2**30
    share = f" × {local_processes} local processes = {total / gib:,.1f} GiB" if shared and local_processes > 1 else ""
    raise ConfigError(key, value, f"the model states alone (parameters, gradients, optimizer) need "
                      f"{need / gib:,.1f} GiB per rank{share}, more than the {have / gib:,.1f} GiB of {what} "
                      "(see `ndtrain plan --search` for a layout that fits)")


def sequence_floor(cfg: Config, vocab_size: int, rollout_rows: int = 0) -> float:
    """Bytes one rank needs for one sequence whatever the layout: its fp32 logits and their
    gradient, the rotary tables (cos and sin of max_seq_len positions, and the angles they
    are computed from), and for RL the key/value cache of the rollout's `rollout_rows` rows."""
    a = cfg.model_args(vocab_size=vocab_size)
    s = cfg.train.seq_len
    logits = 2 * 4 * s * vocab_size
    rope = 6 * a.max_seq_len * a.rope_dim
    cache = 4 * rollout_rows * kv_cache_elements_per_token(a) * s  # MLA: the latent and rotary key
    return float(logits + rope + cache)


def check_sequence_fits(cfg: Config, vocab_size: int, local_processes: int, key: str, value,
                        rollout_rows: int = 0) -> None:
    """Refuse a sequence length whose logits, rotary tables (and RL's key/value cache) alone,
    beside the model states, exceed the device: such a run would only allocate for minutes
    and die. `key`, `value`: the setting that made the sequence this long."""
    floor = sequence_floor(cfg, vocab_size, rollout_rows)
    states = model_states_per_rank(cfg, vocab_size)
    have, what, shared = device_memory(cfg)
    if (floor + states) * (local_processes if shared else 1) <= have:
        return
    gib = 2**30
    parts = "its logits and rotary tables" + (", the rollout's key/value cache" if rollout_rows else "")
    raise ConfigError(key, value, f"a sequence of {cfg.train.seq_len:,} positions needs {floor / gib:,.1f} GiB per rank "
                      f"for {parts} alone, beside {states / gib:,.1f} GiB of model states: more than the "
                      f"{have / gib:,.1f} GiB of {what}" + (f" shared by {local_processes} processes"
                                                             if shared and local_processes > 1 else ""))
