"""The configuration's schema: eight sections of plain dataclasses, every key with its type,
its default and what it means, and `from_dict`, which builds a `Config` from plain values,
each checked against its key's type.

Values come from the defaults, then a command's own defaults (`SFT_DEFAULTS`,
`RL_DEFAULTS`), then a TOML file, then command-line overrides (load.py). `validate()`
(validate.py) then checks the rules between them. Every mistake is a `ConfigError`: one line
naming the key, the value and the rule, which the CLI prints before exiting with status 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from ndtrain.model.args import PRESETS, ModelArgs


class ConfigError(ValueError):
    """A configuration mistake. `str(err)` is the one line shown to the user."""

    def __init__(self, key: str, value: Any, rule: str):
        self.key, self.value, self.rule = key, value, rule
        shown = f"{value!r}" if isinstance(value, str) else f"{value}"
        super().__init__(f"{key} = {shown}: {rule}")


@dataclass
class ModelConfig:
    preset: str = "small"
    # None means "take it from the preset"; vocab_size None means "from the tokenizer".
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    vocab_size: int | None = None
    max_seq_len: int | None = None
    rope_theta: float | None = None
    tie_embeddings: bool | None = None
    head_dim: int | None = None  # None = dim / n_heads
    norm_eps: float | None = None
    qkv_bias: bool | None = None  # biases on q, k, v (Qwen2)
    qk_norm: bool | None = None  # RMSNorm of each query and key head (Qwen3)
    qk_norm_all: bool | None = None  # the q and k norms over all heads together (OLMo 2)
    pre_norm: bool | None = None  # norms before attention and the MLP; false: only sandwich_norm's after them (OLMo 2)
    dropout: float = 0.0
    # Mixture of experts (model/moe.py): only on an MoE preset (tiny-moe, small-moe, olmoe-1b-7b).
    moe_experts: int | None = None
    moe_top_k: int | None = None
    moe_shared_experts: int | None = None
    moe_ffn_dim: int | None = None
    moe_every: int | None = None  # block i is MoE when (i + 1) % moe_every == 0
    moe_router: str | None = None  # softmax_topk | topk_softmax | sigmoid
    moe_norm_topk: bool | None = None
    moe_route_scale: float | None = None
    moe_capacity: float | None = None  # capacity factor; 0 = dropless
    # DeepSeek-V3 (model/args.py, model/mla.py; the deepseek-v3-* presets set them).
    attention: str | None = None  # gqa | mla (multi-head latent attention)
    q_lora_rank: int | None = None  # mla: query bottleneck; 0 = queries projected directly
    kv_lora_rank: int | None = None  # mla: the latent keys and values come from (what generation caches)
    qk_nope_head_dim: int | None = None  # mla: each head's key width without rotary
    qk_rope_head_dim: int | None = None  # mla: the rotary key width, shared by the heads
    v_head_dim: int | None = None  # mla: each head's value width
    rope_interleave: bool | None = None  # mla: rotary pairs (x0, x1), (x2, x3)... (DeepSeek's checkpoints)
    moe_groups: int | None = None  # routed experts in this many groups (group-limited routing)
    moe_topk_groups: int | None = None  # each token chooses among the experts of its best groups
    first_k_dense: int | None = None  # the first blocks keep a dense MLP
    mtp_depth: int | None = None  # multi-token prediction modules after the last block
    moe_router_bias: bool | None = None  # gpt-oss: a learned bias of the router's logits
    moe_expert_bias: bool | None = None  # gpt-oss: biases on the experts' projections
    moe_swiglu_limit: float | None = None  # gpt-oss: the experts' clamped SwiGLU at this limit; 0 = plain SwiGLU
    # Features of Hugging Face families (model/args.py; set from model.init_from=hf:DIR).
    rope_scaling: str | None = None  # JSON, e.g. {"rope_type": "linear", "factor": 2.0}; "" = none
    sliding_window: int | None = None  # 0 = none
    window_layers: str | None = None  # the layers with the window, e.g. "0,2,4"; none = every layer
    rope_local_theta: float | None = None  # Gemma 3: the windowed layers' rotary base (unscaled); 0 = rope_theta
    norm_offset: float | None = None  # Gemma 2: norms scale by (1 + weight)
    sandwich_norm: bool | None = None  # Gemma 2: a norm after attention and after the MLP too
    mlp_act: str | None = None  # silu | gelu_tanh
    embed_scale: float | None = None  # embeddings × this (Gemma 2: √dim)
    query_pre_attn_scalar: float | None = None  # attention scale^-2 instead of head_dim; 0 = head_dim
    attn_softcap: float | None = None  # Gemma 2: cap·tanh(score / cap); 0 = none
    logit_softcap: float | None = None  # Gemma 2: cap·tanh(logit / cap); 0 = none
    attn_sinks: bool | None = None  # gpt-oss: a learned logit per head in the softmax's denominator
    o_bias: bool | None = None  # gpt-oss: a bias on the attention's output projection
    # How attention keeps packed documents apart (ModelArgs.doc_attention): mask (a boolean
    # s × s mask, SDPA) | flex (flex_attention, no s × s mask) | auto: flex on CUDA, else mask.
    doc_attention: str = "auto"
    # "" = random init (ndtrain sft: the default pretraining run; "scratch" = random init);
    # run:DIR (an ndtrain run or checkpoint) or hf:DIR (a HF model folder)
    init_from: str = ""


@dataclass
class ParallelConfig:
    dp: int = 0  # total data-parallel size dp_replicate × dp_shard; 0 = every process left over
    dp_replicate: int = 1
    tp: int = 1
    sp: bool | None = None  # sequence parallelism; None = on whenever tp > 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    pp_split: str = ""  # blocks per pipeline chunk, e.g. "3,5,5,3"; "" = balanced by cost
    cp: int = 1
    cp_impl: str = "ring"  # context-parallel attention: ring | allgather | ulysses
    ep: int = 1  # experts split over ep ranks of dp_shard × cp
    zero: int = 0  # ZeRO stage over dp_shard: 0 (plain DP), 1 (optimizer), 2 (+ gradients), 3 (+ parameters)
    reshard_after_forward: bool = True  # zero=3: free each block after its forward (false: keep until backward)
    bucket_mb: float = 25.0

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp


@dataclass
class TrainConfig:
    steps: int = 400
    global_batch: int = 16  # sequences per optimizer step, over all data-parallel ranks
    micro_batch: int = 0  # sequences per forward/backward on one rank; 0 = no accumulation
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the rate the schedule decays to, as a fraction of train.lr
    warmup: int = 30  # steps of linear warmup from lr/warmup to lr (every schedule)
    schedule: str = "cosine"  # after warmup: cosine | wsd (stable, then linear decay) | linear | constant
    decay_fraction: float = 0.2  # wsd: the last fraction of train.steps over which the rate decays
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    optimizer: str = "adamw"  # adamw | muon (Muon on the blocks' matrices, AdamW on the rest: docs/muon.md)
    muon_lr: float = 0.0  # Muon's peak learning rate (the schedule scales it as train.lr); 0 = train.lr
    muon_momentum: float = 0.95  # Muon's momentum (Keller Jordan's, torch.optim.Muon's, Moonlight's)
    muon_nesterov: bool = True  # Nesterov momentum (the same recipes)
    muon_ns_steps: int = 5  # Newton-Schulz iterations (the same recipes)
    muon_ns_coefficients: str = "3.4445,-4.7750,2.0315"  # a,b,c of the quintic iteration (Keller Jordan's)
    muon_adjust_lr: str = "match_rms_adamw"  # match_rms_adamw (Moonlight: 0.2·sqrt(max(A,B))) | original (sqrt(max(1,A/B)))
    muon_ns_dtype: str = "auto"  # the iteration's dtype: auto (bf16, as torch.optim.Muon; fp64 in fp64 runs) | bf16 | fp32 | fp64
    grad_clip: float = 1.0  # 0 = no clipping
    seed: int = 0
    precision: str = "auto"  # compute dtype: auto (bf16 on CUDA, fp32 on the CPU) | fp32 | bf16 | fp16 (the optimizer keeps fp32 masters) | fp64 (CPU proofs) | fp8 (block matmuls in fp8, the rest in fp8_base) | nvfp4 (block matmuls in NVFP4, the rest in fp8_base)
    tf32: bool = True  # CUDA: matmuls that stay fp32 run on TF32 tensor cores (10-bit mantissa); false: full fp32
    fp8_recipe: str = "tensorwise"  # precision = fp8: tensorwise | rowwise | blockwise (DeepSeek-V3's 1×128 / 128×128) | mxfp8 (1×32 blocks, E8M0 scales)
    fp8_all_gather: bool = False  # precision = fp8, tensorwise, zero = 3: gather weights in fp8 (half of bf16's bytes)
    fp8_base: str = "bf16"  # precision = fp8 or nvfp4: the dtype of everything not in fp8/NVFP4: bf16 | fp32 | fp64 (CPU proofs)
    nvfp4_hadamard: bool = True  # precision = nvfp4: 16×16 random Hadamard transform of the weight gradient's inputs
    nvfp4_stochastic_rounding: bool = True  # precision = nvfp4: round gradients stochastically (keyed by seed, step, layer, element)
    nvfp4_2d_weights: bool = True  # precision = nvfp4: weights in 16×16 blocks (false: 1×16 along each matmul's reduction)
    nvfp4_base_blocks: int = -1  # precision = nvfp4: the last N blocks stay in fp8_base (-1: the last 15%, rounded)
    reduce_fp32: bool = True  # reduce gradients in fp32; false: in train.precision, half the bytes
    loss_scaler: bool = True  # fp16: dynamic loss scaling
    allow_unscaled_fp16: bool = False  # permit fp16 with loss_scaler = false
    loss_scale_init: float = 65536.0
    loss_scale_window: int = 1000  # good steps before the loss scale doubles
    loss_scale_min: float = 1.0  # an overflow at this scale stops the run
    recompute: str = "none"  # none | full | selective (attention core) | every:K (blocks 0, K, 2K, ...)
    compile: bool = False  # torch.compile each decoder block and the loss (parallel/compile.py)
    compile_backend: str = "inductor"  # inductor | aot_eager (no code generation: the proofs) | eager
    loss_chunk: int = 0  # positions per chunk of the output head and loss (no whole [b, s, vocab] logits); 0 = off
    moe_aux_loss: float = 0.01  # coefficient of the MoE load-balancing loss; 0 = none
    moe_bias_rate: float = 0.0  # aux-loss-free balancing: router bias step per optimizer step; 0 = off
    mtp_weight: float = 0.3  # multi-token prediction: weight of its loss (model.mtp_depth > 0; DeepSeek-V3's 0.3)
    eval_every: int = 100  # 0 = evaluate only at the end
    eval_batches: int = 8
    save_every: int = 0  # 0 = save only at the end
    keep_checkpoints: int = 0  # keep the newest N checkpoints (the one just written always); 0 = keep all
    log_every: int = 10
    diloco_inner_steps: int = 0  # DiLoCo (run.fault_tolerance = replicas): H local steps per replica group, then an outer step; 0 = off
    diloco_outer_lr: float = 0.7  # DiLoCo's outer Nesterov SGD: its learning rate on the replicas' averaged delta
    diloco_outer_momentum: float = 0.9  # DiLoCo's outer Nesterov momentum; 0 = plain SGD

    def accumulation(self, dp: int) -> int:
        return self.global_batch // (dp * self.micro_batch)


@dataclass
class DataConfig:
    path: str = "stdlib"  # "stdlib", a text/JSONL file or folder, or a prepared folder
    tokenizer: str = ""  # "" = train a byte-level BPE on the training split; a tokenizer.json; hf:DIR (a HF model folder's, with its BOS/EOS rules)
    vocab_size: int = 4096  # size of the BPE trained when no tokenizer is given
    val_fraction: float = 0.05
    text_key: str = "text"  # the JSONL field or parquet column holding each document's text (was data.jsonl_key)
    cache_dir: str = "~/.cache/ndtrain"
    workers: int = 0  # processes that tokenize in prepare; 0 = one per core (fewer for a small corpus)
    # A weighted mixture instead of data.path: [[data.sources]] tables of name, path, weight
    # (relative), text_key ("" = data.text_key) and repeat (config/data_sources.py, docs/data.md)
    sources: list[dict] = field(default_factory=list)
    # Supervised fine-tuning (ndtrain sft):
    packing: str = "bfd"  # bfd: several examples per row (best-fit decreasing); none: one per row, padded
    truncate: str = "keep_start"  # an example longer than train.seq_len: keep_start (cut its end) | drop
    on_bad_record: str = "error"  # a malformed record (prepare, sft): error (stop, naming file:line) | skip (count it)
    template: str = "auto"  # builtin (our special tokens) | hf (the tokenizer's chat_template) | auto


@dataclass
class SFTConfig:
    generate: int = 0  # held-out prompts answered greedily after training (0 = none)
    max_new_tokens: int = 128
    score: str = "exact"  # exact (answer == reference) | MODULE:FUNCTION(prompt, completion, reference) -> float


@dataclass
class RLConfig:
    # What is asked: a built-in verifiable task (data/verifiable.py), drawn on the fly
    task: str = "addition"  # addition | reverse | sort | countdown
    size: int = 2  # digits per operand (addition), letters (reverse), list length (sort), numbers (countdown)
    reverse_answer: bool = True  # addition: the sum's digits least significant first
    data: str = ""  # your prompts instead of rl.task: a JSONL or parquet file or folder of {prompt | messages, answer}
    reward: str = "builtin"  # builtin (rl.task's check; exact with rl.data) | exact | math | MODULE:FUNCTION(prompt, completion, answer) -> number
    format_reward: float = 0.0  # builtin: added for a well-formed answer (correctness scores 1)
    # Rollouts
    group_size: int = 8  # completions sampled per prompt
    max_new_tokens: int = 6
    temperature: float = 1.0
    top_k: int = 0  # 0 = the whole vocabulary
    top_p: float = 1.0
    long_tail: float = 0.0  # > 0: only this share of prompts may run to max_new_tokens, the others are cut at max_new_tokens // 8 (a workload with a long tail: bench rl)
    generate_tp: int = 0  # tensor parallelism of generation (0 = parallel.tp); the other ranks generate data-parallel
    # Asynchronous rollouts (train/rl/asynchronous.py): generator processes beside the training ranks
    generate_ranks: int = 0  # generator processes (one model each) that sample while the ranks train; 0 = generate on the training ranks, synchronously
    max_staleness: int = 0  # K: rollout t is sampled with the weights of rollout t - K (0 = the current weights; needs generate_ranks > 0 for K > 0)
    async_weights: str = "fixed"  # fixed: rollout t sampled with the weights of rollout t - K exactly | newest: the newest a generator holds (at least those)
    off_policy: str = "tis"  # stale rollouts: tis (importance weight π_old/π_behaviour truncated at tis_cap) | decoupled (untruncated)
    tis_cap: float = 2.0  # tis: the largest importance weight of a token
    exchange_timeout_s: float = 300.0  # the longest wait for a generator's rollout or weights (the weight bridge's timeout), then one line and exit
    partial_rollout: str = "finish"  # a generation that a weight update interrupts: finish (on the old weights) | continue (on the new ones, every partial_tokens tokens)
    partial_tokens: int = 8  # continue: the new tokens between two points where a generation may take newer weights
    # The update
    loss: str = "grpo"  # reinforce | grpo | dr_grpo | dapo
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float | None = None  # None = 0.28 for dapo (clip-higher), clip_low otherwise
    kl_coef: float = 0.0  # β of the k3 KL to the frozen reference (the starting policy)
    ppo_epochs: int = 1  # updates per rollout batch (old log-probs kept)
    max_refills: int = 4  # dapo: extra rollout rounds to replace groups whose rewards are all equal
    overlong_buffer: int | None = None  # length penalty over the last N of max_new_tokens; None = dapo: a quarter, else 0
    shuffle_rewards: bool = False  # a negative control: rewards permuted over the batch before use
    logprob_tol: float = 1e-3  # fp32/fp64: largest |rollout − training| log-prob gap before stopping
    # Evaluation on held-out prompts (every train.eval_every steps and at the end)
    eval_prompts: int = 200  # held-out prompts, answered greedily (pass@1) and pass_k times
    pass_k: int = 4  # samples per prompt for pass@k (0 = none)
    # The default job's warm-up (model.init_from empty): SFT on the task through the SFT task,
    # stopped at the first check whose held-out greedy pass@1 reaches warmup_target
    warmup_steps: int = 600  # at most (its cosine schedule spans them all)
    warmup_examples: int = 20000
    warmup_target: float = 0.35  # 0 = train all warmup_steps
    warmup_check_every: int = 5


@dataclass
class DPOConfig:
    beta: float = 0.1  # the sigmoid loss's β: how far the policy may move from the reference
    shuffle: bool = False  # a negative control: chosen and rejected swapped in exactly half of every training batch's pairs (seeded)
    warmup_steps: int = 100  # the default job (model.init_from unset): SFT steps on both answers of the training pairs, cached


@dataclass
class LoRAConfig:
    rank: int = 0  # rank r of the adapters; 0 = no LoRA (every weight trains)
    alpha: float = 16.0  # the update is (alpha / rank)·B·A·x
    dropout: float = 0.0  # dropout on the adapters' input (training only)
    targets: str = "wq,wk,wv,wo,w1,w2,w3"  # the linear layers that get adapters (attention wq wk wv wo, MLP w1 w2 w3)
    init: str = "zero_b"  # zero_b: B = 0, training starts at the base model | random: B drawn too (tests, PEFT's init_lora_weights=false)


@dataclass
class RunConfig:
    dir: str = ""  # "" = runs/<task>-<date>-<time>
    resume: str = "auto"  # auto: continue if run.dir holds a checkpoint; true: must; false: must not
    nproc: int = 0  # 0 = the product of the parallel sizes, or 2 CPU processes / every local GPU
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 0  # torch threads per rank on the CPU; 0 = OMP_NUM_THREADS if set, else cores / local ranks
    stop_after: int = 0  # stop (with a checkpoint) after this many steps in this invocation; 0 = never
    stop_after_s: float = 0.0  # stop (with a checkpoint) at the first step boundary after this many seconds of training in this invocation; 0 = never
    max_restarts: int = 0  # local launcher: restart every rank this often after one dies or hangs (last good checkpoint)
    heartbeat_s: float = 600.0  # local launcher: a rank that reports no progress for this long is hung; 0 = never
    fault_tolerance: str = "restart"  # restart: a lost rank restarts every rank from the last checkpoint | replicas: the dp_replicate groups survive each other (docs/faults.md)
    lost_rows: str = "skip"  # replicas: the rows of a lost replica group's missed steps are skipped | requeue: trained by a live group at a later step (docs/faults.md)
    collective_timeout_s: float = 600.0  # a collective not complete after this fails, naming it, its group and the rank
    deterministic: bool = False  # torch's deterministic algorithms (and cuBLAS's fixed workspace on CUDA): bit-identical reruns on a GPU, somewhat slower
    async_save: bool = False  # write checkpoints in a background thread; the step waits only for the copy to the host
    progress: bool = True
    plot: bool = True
    tensorboard: bool = False  # also write metrics.jsonl's scalars as TensorBoard events under run.dir/tensorboard/ (extra: .[tensorboard])
    wandb: str = ""  # "" = off | offline (a W&B run folder under run.dir/wandb/) | online (extra: .[wandb])
    wandb_project: str = "ndtrain"
    wandb_name: str = ""  # "" = the run directory's name


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    run: RunConfig = field(default_factory=RunConfig)

    # The dotted keys the user set (in the file or on the command line), filled by
    # `load_config`; not a field, so it stays out of `to_dict` and config.toml.
    explicit = frozenset()
    # Their values as given, before validation resolves run.nproc, parallel.dp and the like
    # (what idle_keys compares with the defaults and names).
    given = MappingProxyType({})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def copy(self) -> "Config":
        out = from_dict(self.to_dict())
        out.explicit, out.given = self.explicit, dict(self.given)
        return out

    def model_args(self, vocab_size: int | None = None) -> ModelArgs:
        """The model shape: the preset with this config's overrides applied."""
        m = self.model
        base = PRESETS[m.preset]
        changes = {f.name: getattr(m, f.name) for f in fields(m)
                   if f.name not in ("preset", "init_from") and getattr(m, f.name) is not None}
        if m.doc_attention == "auto":
            changes["doc_attention"] = "flex" if uses_cuda(self.run.device) else "mask"
        if vocab_size is not None and m.vocab_size is None:
            changes["vocab_size"] = vocab_size
        if "window_layers" in changes:
            changes["window_layers"] = window_layers_of(changes["window_layers"])
        if "max_seq_len" not in changes:
            changes["max_seq_len"] = max(base.max_seq_len, self.train.seq_len)
        lora = self.lora
        if lora.rank:
            changes.update(lora_rank=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                           lora_targets=lora_targets(lora.targets), lora_init=lora.init)
        return base.with_(**changes)


def uses_cuda(device: str) -> bool:
    """Whether run.device (auto | cpu | cuda) puts the ranks on CUDA devices."""
    if device == "cuda":
        return True
    if device != "auto":
        return False
    import torch
    return torch.cuda.is_available()


def lora_targets(text: str) -> tuple[str, ...]:
    """lora.targets ("wq,wv") as ModelArgs holds it."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


FAMILY_KEYS = ("rope_scaling", "sliding_window", "window_layers", "norm_offset", "sandwich_norm", "mlp_act",
               "embed_scale", "query_pre_attn_scalar", "attn_softcap", "logit_softcap", "attn_sinks", "o_bias",
               "rope_local_theta", "qk_norm_all", "pre_norm")


def window_layers_of(text: str) -> tuple[int, ...] | None:
    """model.window_layers ("0,2,4") as ModelArgs holds it (None: every layer)."""
    return tuple(int(x) for x in text.split(",")) if text.strip() else None


def model_key_value(args: ModelArgs, key: str):
    """The model.<key> config value that gives `args.<key>`."""
    value = getattr(args, key)
    if key == "window_layers":
        return None if value is None else ",".join(str(i) for i in value)
    return value


def rl_overlong_buffer(r: RLConfig) -> int:
    """rl.overlong_buffer, or its default: a quarter of max_new_tokens for dapo, else none."""
    if r.overlong_buffer is not None:
        return r.overlong_buffer
    return r.max_new_tokens // 4 if r.loss == "dapo" else 0


def rl_clip_high(r: RLConfig) -> float:
    """rl.clip_high, or its default: DAPO's clip-higher 0.28, else symmetric."""
    if r.clip_high is not None:
        return r.clip_high
    return 0.28 if r.loss == "dapo" else r.clip_low


# `ndtrain sft`'s own defaults, applied before --config and KEY=VALUE (configs/sft.toml
# lists them): the embedded instruction set, longer rows than pretraining, a lower rate.
SFT_DEFAULTS = ["data.path=stdlib-functions", "train.seq_len=256", "train.steps=200", "train.lr=1e-3",
                "train.warmup=10", "train.eval_every=50", "train.eval_batches=16", "sft.generate=4"]

# `ndtrain rl`'s own defaults (configs/rl.toml lists them): a batch of 64 prompts × 8
# completions, a constant learning rate, held-out evaluation every 25 updates; the rows'
# length (train.seq_len) follows from the task unless given.
RL_DEFAULTS = ["train.steps=500", "train.global_batch=512", "train.lr=1e-4", "train.warmup=0", "train.min_lr_ratio=1.0",
               "train.weight_decay=0.0", "train.eval_every=25", "train.eval_batches=0", "train.log_every=5"]

# `ndtrain dpo`'s own defaults (configs/dpo.toml lists them): the embedded preference pairs
# (a stdlib function's body with its quotes written as the prompt asks, " or ', against the
# same body written the other way), rows holding both answers
# of a pair, a fifth of the files held out, evaluation every 20 steps over every held-out pair.
DPO_DEFAULTS = ["data.path=stdlib-pairs", "data.val_fraction=0.2", "train.seq_len=256", "train.global_batch=16",
                "train.steps=200", "train.lr=3e-4", "train.warmup=5", "train.min_lr_ratio=1.0",
                "train.weight_decay=0.0", "train.eval_every=20", "train.eval_batches=64", "train.log_every=5"]

SECTIONS = {f.name: f.type for f in fields(Config)}
_SECTION_CLASSES = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig,
                    "data": DataConfig, "sft": SFTConfig, "rl": RLConfig, "dpo": DPOConfig,
                    "lora": LoRAConfig, "run": RunConfig}


def all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in _SECTION_CLASSES.items() for f in fields(cls)]


def _field_type(section: str, name: str):
    hints = typing.get_type_hints(_SECTION_CLASSES[section])
    return hints[name]


def _unknown_key(key: str, value: Any = "…") -> ConfigError:
    near = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
    if not near:  # a right name in the wrong section, or a typo of the name alone
        names = {k.split(".", 1)[1]: k for k in all_keys()}
        tail = key.split(".")[-1]
        close = difflib.get_close_matches(tail, list(names), n=1, cutoff=0.6)
        near = [names[close[0]]] if close else []
    hint = f"; did you mean {near[0]}?" if near else f"; valid sections are {', '.join(SECTIONS)}"
    return ConfigError(key, value, f"unknown key{hint}")


# --------------------------------------------------------------------------- coercion

_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _base_type(tp) -> tuple[type, bool]:
    """(the concrete type, whether None is allowed) for `int`, `int | None` and the like."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _coerce_text(key: str, text: str, tp) -> Any:
    """A command-line value (always text) to the key's type."""
    base, optional = _base_type(tp)
    low = text.strip().lower()
    if optional and low in ("none", "null", "preset", "auto", ""):
        return None
    try:
        if base is bool:
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if base is int:
            return int(text.replace("_", ""))
        if base is float:
            value = float(text)
            if not math.isfinite(value):
                raise ValueError
            return value
    except ValueError:
        raise ConfigError(key, text, f"expected {_TYPE_WORDS[base]}") from None
    return text


def _coerce_value(key: str, value: Any, tp) -> Any:
    """A TOML value (already typed) to the key's type, refusing silent conversions."""
    base, optional = _base_type(tp)
    if isinstance(value, str) and base is not str:
        if optional and value.strip().lower() in ("none", "preset", "auto", ""):
            return None
        raise ConfigError(key, value, f"expected {_TYPE_WORDS[base]}")
    if base is bool and not isinstance(value, bool):
        raise ConfigError(key, value, "expected true or false")
    if base is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(key, value, "expected an integer")
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, value, "expected a number")
        value = float(value)
        if not math.isfinite(value):  # TOML has nan and inf; no key means either
            raise ConfigError(key, value, "expected a finite number")
    if base is str:
        if isinstance(value, bool):  # resume = true in a file means the word "true"
            return "true" if value else "false"
        if not isinstance(value, str):
            raise ConfigError(key, value, "expected a string")
    return value


# --------------------------------------------------------------------------- data.sources

SOURCE_KEYS = {"name": str, "path": str, "weight": (int, float), "text_key": str, "repeat": bool}


def coerce_sources(value: Any, from_text: bool) -> list[dict]:
    """The sources as plain dicts with every key: name (default: the path's stem), path,
    weight (default 1), text_key ("" = data.text_key), repeat (default true)."""
    if from_text:
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError:
            raise ConfigError("data.sources", value, "on the command line, a JSON list of tables, e.g. "
                              "'[{\"path\": \"web/\", \"weight\": 0.7}, {\"path\": \"code.jsonl.zst\", "
                              "\"weight\": 0.3}]' (or [[data.sources]] tables in the TOML file)") from None
    if not isinstance(value, list):
        raise ConfigError("data.sources", value, "expected a list of tables ([[data.sources]] in TOML)")
    return [_coerce_source(i, item) for i, item in enumerate(value)]


def _coerce_source(i: int, item: Any) -> dict:
    key = f"data.sources[{i}]"
    if not isinstance(item, dict):
        raise ConfigError(key, item, "expected a table with path (and name, weight, text_key, repeat)")
    for k, v in item.items():
        if k not in SOURCE_KEYS:
            raise ConfigError(f"{key}.{k}", v, f"unknown key; a source has {', '.join(SOURCE_KEYS)}")
        kind = SOURCE_KEYS[k]
        if not isinstance(v, kind) or (kind != bool and isinstance(v, bool)):
            what = {str: "a string", bool: "true or false"}.get(kind, "a number")
            raise ConfigError(f"{key}.{k}", v, f"expected {what}")
    if "path" not in item:
        raise ConfigError(f"{key}.path", "", "every source needs a path")
    stem = item["path"].rstrip("/").rsplit("/", 1)[-1].split(".")[0]
    return {"name": item.get("name", re.sub(r"[^A-Za-z0-9_-]", "_", stem) or f"source{i}"),
            "path": item["path"], "weight": float(item.get("weight", 1.0)),
            "text_key": item.get("text_key", ""), "repeat": item.get("repeat", True)}


RENAMED = {"data.jsonl_key": "data.text_key"}  # old name → new; the old one keeps working
_renamed_said: set[str] = set()  # one deprecation line per process, not one per config read


def _say_renamed(key: str) -> None:
    if key not in _renamed_said:
        _renamed_said.add(key)
        print(f"ndtrain: {key} is now {RENAMED[key]} (it names a parquet column too); the old name still works",
              file=sys.stderr, flush=True)


def set_key(cfg: Config, key: str, value: Any, *, from_text: bool) -> None:
    """Set the dotted `key`, its value converted to the key's type (`from_text`: a command-line
    string; else a typed value, as from TOML) or refused with a ConfigError."""
    if key in RENAMED:
        _say_renamed(key)
        key = RENAMED[key]
    parts = key.split(".")
    if len(parts) != 2 or parts[0] not in _SECTION_CLASSES:
        raise _unknown_key(key, value)
    section, name = parts
    obj = getattr(cfg, section)
    if name not in {f.name for f in fields(obj)}:
        raise _unknown_key(key, value)
    if key == "data.sources":
        setattr(obj, name, coerce_sources(value, from_text))
        return
    tp = _field_type(section, name)
    value = _coerce_text(key, value, tp) if from_text else _coerce_value(key, value, tp)
    setattr(obj, name, value)


def from_dict(data: dict, base: list[str] | tuple = ()) -> Config:
    cfg = Config()
    for item in base:
        key, value = item.split("=", 1)
        set_key(cfg, key, value, from_text=True)
    for section, values in data.items():
        if section not in _SECTION_CLASSES:
            near = difflib.get_close_matches(section, list(_SECTION_CLASSES), n=1)
            hint = f"did you mean [{near[0]}]?" if near else f"valid sections are {', '.join(SECTIONS)}"
            raise ConfigError(f"[{section}]", "table", f"unknown section; {hint}")
        if not isinstance(values, dict):
            raise ConfigError(section, values, "expected a table of keys")
        for name, value in values.items():
            if value is None:
                continue
            set_key(cfg, f"{section}.{name}", value, from_text=False)
    return cfg
