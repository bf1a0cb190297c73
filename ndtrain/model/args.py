"""Model shapes: the presets, the parameter count and the FLOPs per token.

Everything here is arithmetic on a `ModelArgs`; nothing builds a tensor, so the planner,
the config validator and MFU can use it for models far too large for this machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dropout: float = 0.0
    # None: dim // n_heads. Qwen3 sets it explicitly (n_heads · head_dim need not be dim).
    head_dim: int | None = None
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm of each query and key head before the rotary (Qwen3)
    qk_norm_all: bool = False  # ... of all query heads together and all key heads together (OLMo 2)
    pre_norm: bool = True  # a norm before attention and before the MLP; False: none (OLMo 2: sandwich_norm's only)
    # gpt-oss (docs/hf.md): a learned logit per query head in the softmax's
    # denominator (attention sinks); a bias on the output projection too; a bias on the router's
    # logits; biases on the experts' projections; the experts' clamped SwiGLU,
    # (clamp(up, ±limit) + 1)·g·σ(1.702·g), g = min(gate, limit) (0: the plain SwiGLU).
    attn_sinks: bool = False
    o_bias: bool = False
    moe_router_bias: bool = False
    moe_expert_bias: bool = False
    moe_swiglu_limit: float = 0.0
    # Mixture of experts (model/moe.py); moe_experts = 0: every block is dense.
    moe_experts: int = 0  # routed experts per MoE block
    moe_top_k: int = 2  # experts each token is routed to
    moe_shared_experts: int = 0  # experts every token also runs through (DeepSeek, Qwen2-MoE)
    moe_ffn_dim: int = 0  # hidden size of one expert; 0 = ffn_dim
    moe_every: int = 1  # block i is MoE when (i + 1) % moe_every == 0 (1: all; 2: 1, 3, 5, ...)
    moe_router: str = "softmax_topk"  # softmax_topk | topk_softmax | sigmoid
    moe_norm_topk: bool = False  # renormalise the k chosen weights to sum to 1
    moe_route_scale: float = 1.0  # multiplies the k weights
    moe_capacity: float = 0.0  # capacity factor; 0 = dropless
    # Rotary scaling as Hugging Face's config.json spells it (model/rope.py), JSON text so the
    # args stay hashable and print as they are stored: "" (none) or e.g.
    # '{"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
    #   "original_max_position_embeddings": 8192, "rope_type": "llama3"}'.
    rope_scaling: str = ""
    # Sliding-window attention (Mistral, Qwen2 with use_sliding_window, Gemma 2): a query sees
    # itself and the window − 1 keys before it. 0: no window. window_layers: the layers that
    # have it (None: every layer).
    sliding_window: int = 0
    window_layers: tuple[int, ...] | None = None
    # Gemma 3: the windowed (local) layers rotate with this base, unscaled; 0: as the others.
    rope_local_theta: float = 0.0
    # How attention keeps the documents of a packed row apart (model/llama.py AttentionCore):
    # "mask", a boolean [b, 1, s, s] mask for SDPA (what the CPU proofs run); "flex",
    # flex_attention with a block mask, no s × s mask (what CUDA runs: config model.doc_attention).
    doc_attention: str = "mask"
    # Gemma 2: norms scale by (norm_offset + weight), weights stored as Gemma stores them;
    # extra norms after attention and after the MLP (sandwich_norm); GeLU (tanh) gate;
    # embeddings multiplied by embed_scale; attention scores scaled by
    # query_pre_attn_scalar^-1/2 instead of head_dim^-1/2 (0: head_dim); attention scores and
    # logits soft-capped, cap·tanh(x / cap) (0: not capped).
    norm_offset: float = 0.0
    sandwich_norm: bool = False
    mlp_act: str = "silu"  # silu | gelu_tanh
    embed_scale: float = 1.0
    query_pre_attn_scalar: float = 0.0
    attn_softcap: float = 0.0
    logit_softcap: float = 0.0
    # LoRA adapters (model/lora.py, config [lora]): rank 0 = none. Each linear layer named in
    # lora_targets adds scale·B·A·x, scale = lora_alpha / lora_rank, and only A and B train.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ()
    lora_init: str = "zero_b"  # zero_b: B starts at 0 (the base model's output) | random: B too (tests)
    # Token ids whose embedding rows (and head rows, untied) train under LoRA: the chat
    # template's added tokens (PEFT's trainable_token_indices; model/lora.TokenRows).
    lora_tokens: tuple[int, ...] = ()
    # Multi-head latent attention (DeepSeek-V2/V3, model/mla.py), attention = "mla": queries
    # through a rank-q_lora_rank bottleneck (0: projected directly), keys and values from one
    # latent of kv_lora_rank per token, each head's key qk_nope_head_dim wide plus a rotary
    # part of qk_rope_head_dim shared by the heads, values v_head_dim wide. head_dim is then
    # the query·key width, qk_nope_head_dim + qk_rope_head_dim. rope_interleave: the rotary
    # pairs are (x0, x1), (x2, x3), ... as DeepSeek's checkpoints lay them out.
    attention: str = "gqa"  # gqa | mla
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # DeepSeek-V3 routing (model/moe.py): experts in moe_groups groups, each token choosing among
    # the experts of its moe_topk_groups best groups (a group scores the sum of its two best
    # experts); the first first_k_dense blocks keep a dense MLP.
    moe_groups: int = 1
    moe_topk_groups: int = 1
    first_k_dense: int = 0
    # Multi-token prediction (DeepSeek-V3, model/mtp.py): mtp_depth sequential modules after
    # the last block, module d predicting the token d + 1 positions after the next one.
    mtp_depth: int = 0

    def __post_init__(self):
        if self.head_dim is None:  # no heads: 0, which shape_problem names
            if self.attention == "mla":
                object.__setattr__(self, "head_dim", self.qk_nope_head_dim + self.qk_rope_head_dim)
            else:
                object.__setattr__(self, "head_dim", self.dim // self.n_heads if self.n_heads else 0)
        if self.window_layers is not None:  # a list from JSON (a checkpoint's meta) or the config
            object.__setattr__(self, "window_layers", tuple(int(i) for i in self.window_layers))
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        object.__setattr__(self, "lora_tokens", tuple(int(i) for i in self.lora_tokens))

    def window_of(self, layer: int) -> int:
        """The sliding window of block `layer` (0: it sees every earlier key)."""
        if not self.sliding_window or (self.window_layers is not None and layer not in self.window_layers):
            return 0
        return self.sliding_window

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def rope_dim(self) -> int:
        """The width each head rotates: the decoupled rotary key under MLA, else the head."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def value_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.moe_experts > 0

    @property
    def expert_dim(self) -> int:
        return self.moe_ffn_dim or self.ffn_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.first_k_dense and (layer + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    def with_(self, **changes) -> "ModelArgs":
        """A copy with `changes`. A head_dim that was derived from dim / n_heads is derived
        again when those change."""
        derived = self.head_dim == (self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla
                                    else self.dim // self.n_heads)
        shape_keys = {"dim", "n_heads", "qk_nope_head_dim", "qk_rope_head_dim", "attention"}
        if "head_dim" not in changes and derived and (shape_keys & set(changes)):
            changes["head_dim"] = None
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)


COUNTS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len", "head_dim")


def shape_problem(a: ModelArgs) -> tuple[str, object, str] | None:
    """(field, value, rule) of the first thing that makes these args no model (None: they
    are one): counts that are not positive integers, heads that do not divide the width (or
    query heads the key/value heads), an expert count, top-k or MoE spacing out of range,
    a norm epsilon or rotary base that is not a positive finite number."""
    for key in COUNTS:
        value = getattr(a, key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            return key, value, "must be a positive integer"
    if a.n_heads % a.n_kv_heads:
        return "n_kv_heads", a.n_kv_heads, f"must divide n_heads = {a.n_heads}"
    for key in ("norm_eps", "rope_theta"):
        value = getattr(a, key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
            return key, value, "must be a positive finite number"
    if a.moe_experts:
        for key in ("moe_experts", "moe_top_k", "moe_every"):
            value = getattr(a, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                return key, value, "must be a positive integer"
        if a.moe_top_k > a.moe_experts:
            return "moe_top_k", a.moe_top_k, f"must be at most moe_experts = {a.moe_experts}"
        if a.moe_every > a.n_layers:
            return "moe_every", a.moe_every, f"must be at most n_layers = {a.n_layers} (no block would have experts)"
        for key in ("moe_groups", "moe_topk_groups"):
            value = getattr(a, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                return key, value, "must be a positive integer"
        if a.moe_experts % a.moe_groups:
            return "moe_groups", a.moe_groups, f"must divide moe_experts = {a.moe_experts}"
        if a.moe_topk_groups > a.moe_groups:
            return "moe_topk_groups", a.moe_topk_groups, f"must be at most moe_groups = {a.moe_groups}"
        if a.moe_groups > 1 and a.moe_experts // a.moe_groups < 2:
            return "moe_groups", a.moe_groups, "leaves fewer than 2 experts per group (a group scores its two best)"
        if a.moe_top_k > a.moe_topk_groups * (a.moe_experts // a.moe_groups):
            return "moe_top_k", a.moe_top_k, (f"must be at most the experts of moe_topk_groups = {a.moe_topk_groups} "
                                              "groups")
        if not 0 <= a.first_k_dense < a.n_layers:
            return "first_k_dense", a.first_k_dense, f"must be in 0..{a.n_layers - 1} (some block must have experts)"
    if a.attention not in ATTENTIONS:
        return "attention", a.attention, f"choose one of {', '.join(ATTENTIONS)}"
    if a.is_mla:
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(a, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                return key, value, "must be a positive integer with attention = mla"
        if a.v_head_dim > a.qk_nope_head_dim + a.qk_rope_head_dim:
            return "v_head_dim", a.v_head_dim, (f"must be at most qk_nope_head_dim + qk_rope_head_dim = "
                                                f"{a.qk_nope_head_dim + a.qk_rope_head_dim} (values are padded to the "
                                                "query·key width for the fused attention ops)")
        if a.qk_rope_head_dim % 2:
            return "qk_rope_head_dim", a.qk_rope_head_dim, "must be even (rotary pairs)"
        if a.head_dim != a.qk_nope_head_dim + a.qk_rope_head_dim:
            return "head_dim", a.head_dim, (f"must be qk_nope_head_dim + qk_rope_head_dim = "
                                            f"{a.qk_nope_head_dim + a.qk_rope_head_dim} with attention = mla")
        if a.n_kv_heads != a.n_heads:
            return "n_kv_heads", a.n_kv_heads, f"must equal n_heads = {a.n_heads} with attention = mla (every head "
            "has its own key and value, from the shared latent)"
    if not isinstance(a.mtp_depth, int) or isinstance(a.mtp_depth, bool) or a.mtp_depth < 0:
        return "mtp_depth", a.mtp_depth, "must be a non-negative integer"
    return None


ATTENTIONS = ("gqa", "mla")
def _yarn_json(factor: float, original: int) -> str:
    """gpt-oss's YaRN (beta_fast 32, beta_slow 1, no truncation of the ramp) as rope_scaling."""
    return (f'{{"beta_fast": 32.0, "beta_slow": 1.0, "factor": {factor}, "original_max_position_embeddings": '
            f'{original}, "rope_type": "yarn", "truncate": false}}')


def _gpt_oss(n_layers: int, **shape) -> ModelArgs:
    """A gpt-oss shape: every block MoE with the expert width ffn_dim, the window on the even layers."""
    return ModelArgs(n_layers=n_layers, moe_ffn_dim=shape["ffn_dim"], window_layers=tuple(range(0, n_layers, 2)),
                     qkv_bias=True, o_bias=True, attn_sinks=True, moe_router="topk_softmax", moe_router_bias=True,
                     moe_expert_bias=True, moe_swiglu_limit=7.0, **shape)


# vocab_size in a preset is the size the shape was published with. A run on our own data
# replaces it with the tokenizer's size unless model.vocab_size is set (left out, the
# default, means "from the tokenizer"; a value must be at least the tokenizer's).
PRESETS: dict[str, ModelArgs] = {
    # For tests: every later layout (tp 2/4, pp 2/4, GQA with kv_heads < tp) can split it.
    "tiny": ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512,
                      max_seq_len=256),
    # The embedded default job: learns visibly in three CPU minutes.
    "small": ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=4096,
                       max_seq_len=512, tie_embeddings=True),
    "125M": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048,
                      vocab_size=32000, max_seq_len=2048, tie_embeddings=True),
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                    vocab_size=128256, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                    vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
    # For tests: tiny with 8 experts of half the MLP's width in every block, top-2.
    "tiny-moe": ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512,
                          max_seq_len=256, moe_experts=8, moe_top_k=2, moe_ffn_dim=64),
    # The default RL job's model as a mixture of experts: small with 8 experts of half its MLP's
    # width in every block, top-2 (as many active MLP weights per token as small's).
    "small-moe": ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=4096,
                           max_seq_len=512, tie_embeddings=True, moe_experts=8, moe_top_k=2, moe_ffn_dim=192),
    # OLMoE-1B-7B's proportions (arXiv 2409.02060): 64 experts of 1024, 8 per token, softmax
    # router without renormalisation; 6.9 B parameters, 1.3 B active. (OLMoE also normalises q
    # and k, which this decoder does not.)
    "olmoe-1b-7b": ModelArgs(dim=2048, n_layers=16, n_heads=16, n_kv_heads=16, ffn_dim=1024,
                             vocab_size=50304, max_seq_len=4096, moe_experts=64, moe_top_k=8,
                             moe_ffn_dim=1024),
    # For tests: DeepSeek-V3's architecture at tiny's width. MLA with a low-rank query (the
    # query·key width 24 ≠ the value width 16), sigmoid routing over 8 experts in 4 groups
    # (2 chosen) with a bias and a scale, a shared expert, the first block dense, one MTP module.
    "deepseek-v3-tiny": ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=512,
                                  max_seq_len=256, attention="mla", q_lora_rank=32, kv_lora_rank=32,
                                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_experts=8,
                                  moe_top_k=2, moe_ffn_dim=32, moe_shared_experts=1, moe_router="sigmoid",
                                  moe_norm_topk=True, moe_route_scale=2.5, moe_groups=4, moe_topk_groups=2,
                                  first_k_dense=1, mtp_depth=1),
    # DeepSeek-V3 (arXiv 2412.19437; its config.json): 61 blocks, the first 3 dense, 256 routed
    # experts of 2048 + 1 shared, 8 per token from 4 of 8 groups, MLA with 128 heads, one MTP
    # module; 671 B parameters, 37 B active (the main model, without the MTP module).
    "deepseek-v3-671B": ModelArgs(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, ffn_dim=18432,
                                  vocab_size=129280, max_seq_len=4096, norm_eps=1e-6, attention="mla",
                                  q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                  v_head_dim=128, rope_interleave=True, moe_experts=256, moe_top_k=8,
                                  moe_ffn_dim=2048, moe_shared_experts=1, moe_router="sigmoid", moe_norm_topk=True,
                                  moe_route_scale=2.5, moe_groups=8, moe_topk_groups=4, first_k_dense=3,
                                  mtp_depth=1),
    # For tests: gpt-oss's pieces at tiny-moe's size (attention sinks, q/k/v/o biases, a window
    # of 8 on every other layer from 0, YaRN, a biased top-k-then-softmax router, biased
    # experts with the clamped SwiGLU).
    "gpt-oss-tiny": _gpt_oss(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=64, vocab_size=512,
                             max_seq_len=256, moe_experts=8, moe_top_k=2, sliding_window=8,
                             rope_scaling=_yarn_json(4.0, 32)),
    # gpt-oss-20b and gpt-oss-120b as published (their config.json, OpenAI 2025): 21 B and 117 B
    # parameters, 3.6 B and 5.1 B active; YaRN x32 over 4096 to 131072 positions.
    "gpt-oss-20b": _gpt_oss(dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64, ffn_dim=2880,
                            vocab_size=201088, max_seq_len=131072, rope_theta=150000.0, moe_experts=32,
                            moe_top_k=4, sliding_window=128, rope_scaling=_yarn_json(32.0, 4096)),
    "gpt-oss-120b": _gpt_oss(dim=2880, n_layers=36, n_heads=64, n_kv_heads=8, head_dim=64, ffn_dim=2880,
                             vocab_size=201088, max_seq_len=131072, rope_theta=150000.0, moe_experts=128,
                             moe_top_k=4, sliding_window=128, rope_scaling=_yarn_json(32.0, 4096)),
}

ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid")


def block_params(a: ModelArgs, layer: int = 0, *, active: bool = False) -> int:
    """Parameters of decoder block `layer`: attention (with q/k/v biases and q/k norms where
    the family has them), two RMSNorm weights (four with sandwich norms), and a SwiGLU MLP or an MoE feed-forward
    (router, routed and shared experts). `active=True` counts what one token uses: the
    router, its top-k experts and the shared ones."""
    q_dim, kv_dim = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    attention = a.dim * q_dim * 2 + a.dim * kv_dim * 2  # wq, wo, wk, wv
    if a.is_mla:
        attention = mla_params(a)
    if a.qkv_bias:
        attention += q_dim + 2 * kv_dim
    if a.qk_norm:
        attention += q_dim + kv_dim if a.qk_norm_all else 2 * a.head_dim
    attention += a.dim * a.o_bias + a.n_heads * a.attn_sinks  # gpt-oss
    norms = 2 * a.sandwich_norm + 2 * a.pre_norm
    if a.is_moe_layer(layer):
        experts = (a.moe_top_k if active else a.moe_experts) + a.moe_shared_experts
        mlp = a.dim * a.moe_experts + experts * 3 * a.dim * a.expert_dim  # router + experts
        mlp += a.moe_experts * a.moe_router_bias  # gpt-oss: the router's bias, the routed experts' biases
        mlp += (a.moe_top_k if active else a.moe_experts) * (2 * a.expert_dim + a.dim) * a.moe_expert_bias
    else:
        mlp = 3 * a.dim * a.ffn_dim  # gate, up, down
    return attention + mlp + norms * a.dim


def mla_params(a: ModelArgs) -> int:
    """Latent attention's weights: the query's down- and up-projection and norm (or its one
    projection), the key/value down-projection with the rotary key, its norm, the up-projection
    to each head's key and value, and the output projection."""
    heads = a.n_heads
    if a.q_lora_rank:
        query = a.dim * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * heads * a.head_dim
    else:
        query = a.dim * heads * a.head_dim
    latent = a.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
    up = a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim)
    return query + latent + up + heads * a.v_head_dim * a.dim


def mtp_params(a: ModelArgs) -> int:
    """One multi-token prediction module (model/mtp.py): two norms of its inputs, the
    projection of their concatenation, a decoder block (the last block's kind) and its
    output norm; the embedding and the head are the model's."""
    return 3 * a.dim + 2 * a.dim * a.dim + block_params(a, a.n_layers - 1)


def expert_params(a: ModelArgs) -> int:
    """Parameters of the routed experts (what expert parallelism splits)."""
    return len(a.moe_layers) * a.moe_experts * 3 * a.dim * a.expert_dim


def param_count(a: ModelArgs, *, embedding: bool = True, active: bool = False, mtp: bool = True) -> int:
    """Number of parameters. `embedding=False` drops the input lookup table, which costs no
    FLOPs; the output head stays (it is a matmul), tied or not. `active=True`: what one
    token uses (an MoE block counts its router, top-k and shared experts only). `mtp=False`
    leaves out the multi-token prediction modules (DeepSeek-V3's 671 B is without its MTP
    module; its 685 B checkpoint adds the module with its own copy of the embedding and head)."""
    n = sum(block_params(a, i, active=active) for i in range(a.n_layers)) + a.dim  # blocks + final norm
    n += a.vocab_size * a.dim  # output head
    if mtp:
        n += a.mtp_depth * mtp_params(a) if not active else a.mtp_depth * (mtp_params(a) - block_params(a, a.n_layers - 1)
                                                                           + block_params(a, a.n_layers - 1, active=True))
    if embedding and not a.tie_embeddings:
        n += a.vocab_size * a.dim
    return n


def visible_keys_per_query(seq_len: int, window: int = 0) -> float:
    """The keys a query attends to, averaged over a causal sequence, as the area of the
    visible part of the s×s score matrix over s: s/2 for the causal triangle (the masked half
    is skipped by the fused kernels), w − w²/(2s) for a band of width w < s (a sliding window:
    the kernels skip what lies outside it). The exact count of visible pairs is larger by
    1/2 per query (w/2s for a window): the diagonal's half, which this convention (Llama 3,
    FlashAttention) leaves out."""
    if 0 < window < seq_len:
        return window - window * window / (2.0 * seq_len)
    return seq_len / 2.0


def attention_flops_per_token(a: ModelArgs, seq_len: int, layer: int) -> float:
    """Forward FLOPs per token of block `layer`'s attention scores QKᵀ and weighted sum AV:
    2·d each per visible key, d = n_heads·head_dim (QKᵀ; AV: n_heads·value width, which MLA
    makes narrower than the query·key width); its window when it has one."""
    return 2.0 * a.n_heads * (a.head_dim + a.value_dim) * visible_keys_per_query(seq_len, a.window_of(layer))


def kv_cache_elements_per_token(a: ModelArgs) -> int:
    """Numbers generation's cache keeps per token over all blocks (model/llama.py KVCache):
    each block's keys and values, n_kv_heads·head_dim each; under MLA the normed latent and
    the rotated rotary key, kv_lora_rank + qk_rope_head_dim (model/mla.py)."""
    per_block = a.kv_lora_rank + a.qk_rope_head_dim if a.is_mla else 2 * a.n_kv_heads * a.head_dim
    return a.n_layers * per_block


MLA_LORA = {"wq": ("wq_a", "wq_b", "wq"), "wk": ("wkv_a", "wkv_b"), "wv": ("wkv_a", "wkv_b")}


def linear_shapes(a: ModelArgs) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear layer of a block that LoRA can adapt, by its name."""
    q_dim, kv_dim = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    mlp = {"w1": (a.dim, a.ffn_dim), "w3": (a.dim, a.ffn_dim), "w2": (a.ffn_dim, a.dim)}
    if not a.is_mla:
        return {"wq": (a.dim, q_dim), "wk": (a.dim, kv_dim), "wv": (a.dim, kv_dim), "wo": (q_dim, a.dim), **mlp}
    attention = {"wq_a": (a.dim, a.q_lora_rank), "wq_b": (a.q_lora_rank, q_dim)} if a.q_lora_rank else {
        "wq": (a.dim, q_dim)}
    attention.update(wkv_a=(a.dim, a.kv_lora_rank + a.qk_rope_head_dim),
                     wkv_b=(a.kv_lora_rank, a.n_heads * (a.qk_nope_head_dim + a.v_head_dim)),
                     wo=(a.n_heads * a.v_head_dim, a.dim))
    return {**attention, **mlp}


def lora_layers(a: ModelArgs) -> tuple[str, ...]:
    """The names of a block's linear layers that get adapters: `lora_targets`, where latent
    attention (model/mla.py) reads wq as its query projections (wq_a and wq_b, or wq) and wk,
    wv as its key-value projections wkv_a and wkv_b; its own names select themselves."""
    shapes = linear_shapes(a)
    names = [n for t in a.lora_targets for n in ((MLA_LORA.get(t, (t,)) if a.is_mla else (t,)))]
    return tuple(n for n in dict.fromkeys(names) if n in shapes)


def adapter_params(a: ModelArgs, layer: int | None = None) -> int:
    """LoRA's A and B, r·(in + out) per adapted matrix, of block `layer` (default: all, and
    the multi-token prediction modules' blocks, of the last block's kind). An MoE block's
    experts have none (model/lora.py)."""
    if not a.lora_rank:
        return 0
    shapes = linear_shapes(a)
    n = 0
    for i in [*range(a.n_layers), *[a.n_layers - 1] * a.mtp_depth] if layer is None else (layer,):
        for t in lora_layers(a):
            if t in ("w1", "w2", "w3") and a.is_moe_layer(i):
                continue
            n += a.lora_rank * sum(shapes[t])
    return n


def flops_per_token(a: ModelArgs, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token: what the matmuls that run compute.

    6·N for the matmuls, with N the parameters that take part in a matmul (everything but
    the embedding lookup and the norms; we keep the norms, they are 0.01% of N): forward 2,
    and backward 4 (the input's gradient and the weight's). Plus the attention scores: per
    layer QKᵀ and AV cost 2·d FLOPs per visible key each, forward, and backward twice that,
    12·d·k per token, with k the keys a query sees (`visible_keys_per_query`): s/2 for
    causal attention, the masked half skipped by the fused kernels, so 6·L·s·d in all (the
    convention of the Llama-3 and FlashAttention papers; PaLM's 12·L·s·d counts the masked
    half too and gives MFU figures higher by that amount); w − w²/(2s) for a sliding-window
    layer of window w < s, whose kernels skip the keys outside the window.

    LoRA (lora_rank > 0): the frozen base computes no weight gradient, so 4·N for its
    matmuls, plus 6 per adapter parameter (A and B, r·(in + out) per adapted matrix) and
    6·n·dim for n trained token rows of the head (lora_tokens; the embedding's are a
    lookup). With no trained rows nothing before the first block trains, so its input needs
    no gradient and autograd skips the matmuls reading it: 2·dim·(q + 2·kv) for wq, wk, wv
    and 2·r·dim for each of their adapters.

    Mixture of experts: N counts the *active* parameters (router, top-k and shared experts),
    the matmuls a token really goes through; the dispatch (permutations, all-to-all) does no
    FLOPs.
    """
    n = param_count(a, embedding=False, active=True) + a.mtp_depth * a.vocab_size * a.dim  # MTP: the head again
    # an MTP module runs one more block per depth (its attention too) and the head again
    layers = list(range(a.n_layers)) + [a.n_layers - 1] * a.mtp_depth
    attention = 3.0 * sum(attention_flops_per_token(a, seq_len, i) for i in layers)
    if not a.lora_rank:
        return 6.0 * n + attention
    flops = 4.0 * n + 6.0 * adapter_params(a) + 6.0 * len(a.lora_tokens) * a.dim + attention
    if not a.lora_tokens:  # the first block's input is constant: no gradient for the layers reading it
        shapes = linear_shapes(a)
        reading = [t for t in ("wq", "wk", "wv", "wq_a", "wkv_a") if t in shapes and shapes[t][0] == a.dim]
        first = [t for t in reading if t in lora_layers(a)]
        flops -= 2.0 * a.dim * sum(shapes[t][1] for t in reading) + 2.0 * a.lora_rank * a.dim * len(first)
    return flops
