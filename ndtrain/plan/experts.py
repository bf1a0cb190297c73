"""Mixtures of experts in the plan: whose parameters a rank holds, and the all-to-all.

What the engine does (parallel/expert.py, parallel/tensor.py, parallel/zero.py):
- an MoE block's routed experts are split over the `ep` ranks of an expert group (E/ep each),
  drawn from dp_shard × cp; tensor parallelism splits none of the MoE weights: every tp rank
  keeps the router, its experts and the shared experts whole and routes 1/t of the positions;
- dense states (attention, norms, router, shared experts, embedding, head) are sharded by
  ZeRO over dp_shard × cp and their gradients reduced over dp × cp; the experts' over the
  ranks that hold the same experts, dp_shard·cp/ep (`edp_shard`), reduced over dp·cp/ep;
- per MoE block and micro-batch, forward: an all-to-all of the counts (E/ep int64 per peer)
  and two of the routed rows (dispatch and combine, T·k rows of h values from a rank that
  routes T tokens, (ep−1)/ep of them leaving it); backward: the two row exchanges again.
A router never balances perfectly: `imbalance` (the busiest rank's slots over the average;
1 = perfect) scales the rows its experts run and the rows it receives.
"""

from __future__ import annotations

from ndtrain.model.args import ModelArgs


def moe_dense_weights(args: ModelArgs) -> list[tuple[int, bool]]:
    """An MoE block's dense feed-forward weights on every tp rank, as (elements, is a matrix):
    the router (and its bias: gpt-oss) and the shared experts (gate, up, down), all whole."""
    h = args.dim
    shared = args.moe_shared_experts * args.expert_dim
    router = [(args.moe_experts * h, True)] + ([(args.moe_experts, False)] if args.moe_router_bias else [])
    return router + ([(h * shared, True)] * 3 if shared else [])


def expert_weights(args: ModelArgs, ep: int) -> list[tuple[int, bool]]:
    """The routed experts one rank holds in one MoE block: three stacked matrices of E/ep
    (and gpt-oss's biases of gate, up and down)."""
    n = args.moe_experts // ep
    biases = [(n * args.expert_dim, False)] * 2 + [(n * args.dim, False)] if args.moe_expert_bias else []
    return [(n * args.dim * args.expert_dim, True)] * 3 + biases


def routed_tokens(tokens: float, tp: int) -> float:
    """Tokens a rank routes: its 1/t share of the positions of a micro-batch."""
    return tokens / tp


def a2a_bytes(args: ModelArgs, tokens: float, tp: int, c: int, imbalance: float) -> float:
    """One row exchange of one MoE block: the whole buffer a rank sends (its own share
    included), k rows of h values per routed token, on the busiest rank."""
    return routed_tokens(tokens, tp) * args.moe_top_k * args.dim * c * imbalance


def counts_bytes(args: ModelArgs) -> float:
    """The count exchange: E int64 counts, E/ep to each peer."""
    return 8.0 * args.moe_experts
