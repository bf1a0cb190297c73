"""What Muon costs (train.optimizer = muon, train/muon.py), by formula: its matrices, the
Newton–Schulz FLOPs of a step, the bytes its matrix owners move (parallel/muon.py), and how
many of a rank's parameters keep one momentum buffer instead of AdamW's two moments.

The owners' traffic per rank, for a pipeline stage of N ranks whose Muon matrices hold Ψ
elements and a rank that holds h of them (its TP shards, its ZeRO slices, its experts): the
owner of a matrix receives what it does not hold, (Ψ/N)(1 − h/Ψ) on average, and returns
every holder its elements, h(1 − 1/N): h + Ψ/N − 2h/N elements sent per rank. Plain DP
(h = Ψ): Ψ(1 − 1/N), an all-gather's worth; ZeRO-3 over N (h = Ψ/N): 2Ψ/N(1 − 1/N).
"""

from __future__ import annotations

from ndtrain.model.args import ModelArgs
from ndtrain.parallel.muon import ns_flops


def muon_matrices(args: ModelArgs, layers=None) -> list[tuple[int, int]]:
    """(A, B) of every matrix Muon orthogonalises in `layers` (default: every block): q, k, v,
    o; the MLP's gate, up, down, or each routed expert's three and the shared experts'."""
    h, q, kv = args.dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    out = []
    for layer in range(args.n_layers) if layers is None else layers:
        out += [(q, h), (kv, h), (kv, h), (h, q)]
        if args.is_moe_layer(layer):
            d = args.expert_dim
            out += [(d, h), (d, h), (h, d)] * args.moe_experts
            s = args.moe_shared_experts * d
            out += [(s, h), (s, h), (h, s)] if s else []
        else:
            out += [(args.ffn_dim, h), (args.ffn_dim, h), (h, args.ffn_dim)]
    return out


def muon_costs(args: ModelArgs, world: int, pp: int, held: float, ns_steps: int, element_bytes: int) -> dict:
    """Per rank and step, on average over a balanced stage: Newton–Schulz FLOPs, bytes sent by
    the owners' two all-to-alls (`held`: Muon elements this rank holds), Muon's elements."""
    mats = muon_matrices(args)
    psi = sum(a * b for a, b in mats) / pp
    n = world // pp
    return {"matrices": len(mats), "ns_flops": sum(ns_flops(a, b, ns_steps) for a, b in mats) / world,
            "bytes": element_bytes * (held + psi / n - 2 * held / n) if n > 1 else 0.0, "psi_stage": psi}
