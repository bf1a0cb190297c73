"""LoRA (Hu et al. 2021, arXiv 2106.09685): a frozen linear layer plus a trainable low-rank
update, y = W·x + b + (α/r)·B·A·dropout(x), A [r, in], B [out, r].

The model builds `LoRALinear` in place of `nn.Linear` for the layers `ModelArgs.lora_targets`
names (wq wk wv wo of attention, w1 w2 w3 of a dense MLP; a mixture-of-experts block's
experts and shared experts keep plain weights), so every layout sees the adapters under the
same global names: `layers.3.attention.wq.lora.a` and `.lora.b`. Which parameters train is
the layout's business (parallel/parallelize.py freezes all the others); tensor parallelism
splits A or B with their base layer (parallel/tensor.py).

Token rows. A chat template that adds tokens to the vocabulary (data.template=builtin:
`<|end|>` and the role headers) needs their rows to train, or under a frozen embedding
they keep their initial values (one shared mean row after `model.init_from`). `TokenRows`
holds, for the ids `ModelArgs.lora_tokens` names, a trainable `rows` [n, dim] added to those
rows of the embedding (`tok_embeddings.lora.rows`) and of an untied head
(`output.lora.rows`; a tied head reads the embedding's). Only those n·dim values get
gradients and optimizer state, as PEFT's `trainable_token_indices`. They start at zero, so
training starts at the base model, and the effective row of id `ids[j]` is W[ids[j]] + rows[j].

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

from .args import linear_shapes, lora_layers

TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "wq_a", "wq_b", "wkv_a", "wkv_b")  # the last four: MLA's
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


class TokenRows(nn.Module):
    """A trainable `rows` [n, dim] added to rows `ids` of an embedding table or output head."""

    def __init__(self, ids: tuple[int, ...], dim: int):
        super().__init__()
        self.ids = tuple(ids)
        self.rows = nn.Parameter(torch.empty(len(self.ids), dim))
        self._on: dict[torch.device, Tensor] = {}  # the ids on each device, copied there once

    def _ids(self, device) -> Tensor:
        """The ids as a tensor on `device`: one host-to-device copy, not one per step."""
        if device not in self._on:
            self._on[device] = torch.tensor(self.ids, dtype=torch.long, device=device)
        return self._on[device]

    def embed(self, tokens: Tensor, h: Tensor) -> Tensor:
        """`h` (the table's rows of `tokens`) plus rows[j] where a token is ids[j]: a lookup
        into `rows` and one zero row for every other token (no FLOPs, exact elsewhere)."""
        hit = tokens.unsqueeze(-1) == self._ids(tokens.device)
        slot = torch.where(hit.any(-1), hit.int().argmax(-1), len(self.ids))
        table = torch.cat([self.rows, self.rows.new_zeros(1, self.rows.shape[1])])
        return h + F.embedding(slot, table).to(h.dtype)

    def head(self, x: Tensor, logits: Tensor) -> Tensor:
        """`logits` (x·Wᵀ, which nothing else holds) plus x·rowsᵀ in the columns `ids`, in
        place: no second tensor of the logits' size."""
        return logits.index_add_(-1, self._ids(x.device), F.linear(x, self.rows).to(logits.dtype))

    def extra_repr(self) -> str:
        return f"ids={list(self.ids)}"


class LoRAEmbedding(nn.Embedding):
    """`nn.Embedding` (its weight under the usual name) plus trainable `TokenRows`."""

    def __init__(self, vocab_size: int, dim: int, ids: tuple[int, ...]):
        super().__init__(vocab_size, dim)
        self.lora = TokenRows(ids, dim)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.lora.embed(tokens, super().forward(tokens))


def embedding(args) -> nn.Embedding:
    """The token embedding: with trainable rows when LoRA names tokens to train."""
    if args.lora_rank and args.lora_tokens:
        return LoRAEmbedding(args.vocab_size, args.dim, args.lora_tokens)
    return nn.Embedding(args.vocab_size, args.dim)


def head_rows(args, embed: nn.Module | None) -> TokenRows | None:
    """The output head's trainable rows: the embedding's own when tied (and held here)."""
    if not (args.lora_rank and args.lora_tokens):
        return None
    if args.tie_embeddings and embed is not None:
        return embed.lora
    return TokenRows(args.lora_tokens, args.dim)


def linear(args, name: str, in_features: int, out_features: int, bias: bool = False) -> nn.Linear:
    """The linear layer `name` of a block: with an adapter when LoRA targets it."""
    if args.lora_rank and name in lora_layers(args):
        return LoRALinear(in_features, out_features, bias, args.lora_rank, args.lora_alpha, args.lora_dropout)
    return nn.Linear(in_features, out_features, bias=bias)


def is_adapter(name: str) -> bool:
    """Whether a global parameter name is one of an adapter's two matrices or token rows."""
    return name.endswith((".lora.a", ".lora.b", ".lora.rows"))


def base_of(name: str) -> str:
    """`layers.0.attention.wq.lora.a` → `layers.0.attention.wq.weight`, the weight it adapts."""
    return name.rsplit(".lora.", 1)[0] + ".weight"


def a_std(name: str, args) -> float:
    """A's std: 1/√(3·in), the std of PEFT's Kaiming-uniform bound 1/√in."""
    layer = name.rsplit(".lora.", 1)[0].rsplit(".", 1)[1]
    return 1.0 / math.sqrt(3 * linear_shapes(args)[layer][0])


def freeze_base(model: nn.Module) -> int:
    """Leave only the adapters' parameters trainable; returns how many tensors train."""
    adapters = {id(p) for m in model.modules() if isinstance(m, (LoRA, TokenRows)) for p in m.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in adapters)
    return len(adapters)


@torch.no_grad()
def merged(state: dict[str, Tensor], scale: float, tokens: tuple[int, ...] = ()) -> dict[str, Tensor]:
    """A whole model's state with each adapter folded into its base weight, W + scale·B·A
    (in fp64, returned in W's dtype), token rows into theirs (W[tokens] + rows), and the
    adapters left out."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for name in state:
        if name.endswith(".lora.rows"):
            w = out[base_of(name)]
            out[base_of(name)] = with_rows(w, state[name], tokens).to(w.dtype)
        if name.endswith(".lora.a"):
            a, b = state[name].double(), state[name[:-1] + "b"].double()
            w = out[base_of(name)]
            out[base_of(name)] = (w.double() + scale * (b @ a)).to(w.dtype)
    return out


def with_rows(w: Tensor, rows: Tensor, ids: tuple[int, ...]) -> Tensor:
    """An embedding or head weight with its trained token rows added, W[ids] + rows (fp64)."""
    return w.double().index_add(0, torch.tensor(ids, dtype=torch.long), rows.double())

