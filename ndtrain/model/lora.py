"""LoRA (Hu et al. 2021, arXiv 2106.09685): a frozen linear layer plus a trainable low-rank
update, y = W·x + b + (α/r)·B·A·dropout(x), A [r, in], B [out, r].

The model builds `LoRALinear` in place of `nn.Linear` for the layers `ModelArgs.lora_targets`
names (wq wk wv wo of attention, w1 w2 w3 of a dense MLP; a mixture-of-experts block's
experts and shared experts keep plain weights), so every layout sees the adapters under the
same global names: `layers.3.attention.wq.lora.a` and `.lora.b`. Which parameters train is
the layout's business (parallel/parallelize.py freezes all the others); tensor parallelism
splits A or B with their base layer (parallel/tensor.py).

Initial values (model/init.py): A normal with std 1/√(3·in), the spread of PEFT's default
Kaiming-uniform A; B zero, so training starts from the base model's output exactly. With
`lora_init = "random"` B is drawn too (std 0.02), PEFT's `init_lora_weights=False`: a model
whose adapters already act, which the layout proofs need (with B = 0 the first step's
gradient of A is zero and a defect in it could not show).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
INITS = ("zero_b", "random")
# Our layer names → the module names PEFT's target_modules use on a Hugging Face Llama.
HF_MODULES = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "w1": "gate_proj", "w3": "up_proj",
              "w2": "down_proj"}


class LoRA(nn.Module):
    """scale · B·A·dropout(x). `rows`: only these rows of B (the tensor-parallel K or V
    projection of a rank that computes one KV head of a replicated weight)."""

    def __init__(self, a: nn.Parameter, b: nn.Parameter, scale: float, dropout: float = 0.0,
                 rows: slice | None = None):
        super().__init__()
        self.a, self.b, self.scale, self.dropout, self.rows = a, b, scale, dropout, rows

    def forward(self, x: Tensor) -> Tensor:
        if self.dropout and self.training:  # functional: no module a layout's dropout swap could match
            x = F.dropout(x, self.dropout)
        b = self.b if self.rows is None else self.b[self.rows]
        return F.linear(F.linear(x, self.a), b) * self.scale

    def extra_repr(self) -> str:
        return f"rank={self.a.shape[0]}, scale={self.scale:g}, dropout={self.dropout:g}"


class LoRALinear(nn.Linear):
    """`nn.Linear` (its weight and bias under their usual names) plus a `LoRA` adapter."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int, alpha: float,
                 dropout: float = 0.0):
        super().__init__(in_features, out_features, bias=bias)
        a = nn.Parameter(torch.empty(rank, in_features))
        b = nn.Parameter(torch.empty(out_features, rank))
        self.lora = LoRA(a, b, alpha / rank, dropout)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + self.lora(x)


def linear(args, name: str, in_features: int, out_features: int, bias: bool = False) -> nn.Linear:
    """The linear layer `name` of a block: with an adapter when LoRA targets it."""
    if args.lora_rank and name in args.lora_targets:
        return LoRALinear(in_features, out_features, bias, args.lora_rank, args.lora_alpha, args.lora_dropout)
    return nn.Linear(in_features, out_features, bias=bias)


def is_adapter(name: str) -> bool:
    """Whether a global parameter name is one of an adapter's two matrices."""
    return name.endswith((".lora.a", ".lora.b"))


def base_of(name: str) -> str:
    """`layers.0.attention.wq.lora.a` → `layers.0.attention.wq.weight`, the weight it adapts."""
    return name.rsplit(".lora.", 1)[0] + ".weight"


def a_std(name: str, args) -> float:
    """A's std: 1/√(3·in), the std of PEFT's Kaiming-uniform bound 1/√in."""
    layer = name.rsplit(".lora.", 1)[0].rsplit(".", 1)[1]
    fan_in = {"wo": args.n_heads * args.head_dim, "w2": args.ffn_dim}.get(layer, args.dim)
    return 1.0 / math.sqrt(3 * fan_in)


def freeze_base(model: nn.Module) -> int:
    """Leave only the adapters' parameters trainable; returns how many tensors train."""
    adapters = {id(p) for m in model.modules() if isinstance(m, LoRA) for p in m.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in adapters)
    return len(adapters)


@torch.no_grad()
def merged(state: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
    """A whole model's state with each adapter folded into its base weight, W + scale·B·A
    (in fp64, returned in W's dtype), and the adapters left out."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for name in state:
        if name.endswith(".lora.a"):
            a, b = state[name].double(), state[name[:-1] + "b"].double()
            w = out[base_of(name)]
            out[base_of(name)] = (w.double() + scale * (b @ a)).to(w.dtype)
    return out

