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

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)

    def with_(self, **changes) -> "ModelArgs":
        """A copy with `changes`. A head_dim that was derived from dim / n_heads is derived
        again when those change."""
        derived = self.head_dim == self.dim // self.n_heads
        if "head_dim" not in changes and derived and ({"dim", "n_heads"} & set(changes)):
            changes["head_dim"] = None
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)


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
}


def block_params(a: ModelArgs) -> int:
    """Parameters of one decoder block: attention (with q/k/v biases and q/k norms where the
    family has them), SwiGLU MLP and two RMSNorm weights."""
    q_dim, kv_dim = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    attention = a.dim * q_dim * 2 + a.dim * kv_dim * 2  # wq, wo, wk, wv
    if a.qkv_bias:
        attention += q_dim + 2 * kv_dim
    if a.qk_norm:
        attention += 2 * a.head_dim
    mlp = 3 * a.dim * a.ffn_dim  # gate, up, down
    return attention + mlp + 2 * a.dim


def param_count(a: ModelArgs, *, embedding: bool = True) -> int:
    """Number of parameters. `embedding=False` drops the input lookup table, which costs no
    FLOPs; the output head stays (it is a matmul), tied or not."""
    n = a.n_layers * block_params(a) + a.dim  # blocks + final norm
    n += a.vocab_size * a.dim  # output head
    if embedding and not a.tie_embeddings:
        n += a.vocab_size * a.dim
    return n


def flops_per_token(a: ModelArgs, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token.

    6·N for the matmuls, with N the parameters that take part in a matmul (everything but
    the embedding lookup and the norms; we keep the norms, they are 0.01% of N), plus the
    attention term: per layer the scores QKᵀ and the weighted sum AV each cost 2·s·d
    FLOPs per token forward, 4·s·d in all, and backward costs twice forward, so 12·L·s·d.
    Causal masking: half of the score matrix is masked, and the fused attention kernels
    skip it, so we count half: 6·L·s·d. This is the convention of the Llama-3 and
    FlashAttention papers; PaLM's 12·L·s·d counts the masked half too and gives MFU figures
    that are higher by that amount.
    """
    n = param_count(a, embedding=False)
    return 6.0 * n + 6.0 * a.n_layers * seq_len * a.n_heads * a.head_dim  # n_heads·head_dim = d
