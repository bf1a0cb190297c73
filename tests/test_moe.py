"""The mixture-of-experts block on one device (model/moe.py): every router against a
per-token loop written from the definitions, ties, the selection bias, capacity, the
per-sequence balance loss and its gradient, the grouped expert matmul, parameter and FLOP
counts, and recomputation reporting each forward once. All in fp64, so a wrong index or a
wrong sum cannot hide in round-off."""

import copy

import pytest
import torch
import torch.nn.functional as F

from ndtrain.model import PRESETS, Transformer, flops_per_token, param_count
from ndtrain.model.args import block_params, expert_params
from ndtrain.model.moe import MoE, RoutingLog, expert_matmul, top_k

TINY_MOE = PRESETS["tiny-moe"]


def moe_block(args=TINY_MOE, seed=0) -> MoE:
    torch.manual_seed(seed)
    block = MoE(args).double()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


def reference(block: MoE, x: torch.Tensor) -> torch.Tensor:
    """The block's output from the definitions, one token and one slot at a time."""
    r, d = block.router, x.shape[-1]
    flat = x.reshape(-1, d)
    logits = flat @ r.weight.t()
    scores = logits.sigmoid() if r.kind == "sigmoid" else logits.softmax(-1)
    choice = (logits if r.kind == "topk_softmax" else scores) + r.expert_bias
    chosen = torch.topk(choice, r.k).indices
    w = logits.gather(-1, chosen).softmax(-1) if r.kind == "topk_softmax" else scores.gather(-1, chosen)
    if r.normalise:
        w = w / w.sum(-1, keepdim=True)
    w = w * r.scale
    e = block.experts
    rows = []
    for t in range(flat.shape[0]):
        y = torch.zeros(d, dtype=x.dtype)
        for j in range(r.k):
            i = int(chosen[t, j])
            h = F.silu(e.w1[i] @ flat[t]) * (e.w3[i] @ flat[t])
            y = y + w[t, j] * (e.w2[i] @ h)
        rows.append(y)
    out = torch.stack(rows)
    if block.shared is not None:
        out = out + block.shared(flat)
    return out.view_as(x)


VARIANTS = {
    "softmax_topk": {},
    "softmax_topk-norm-scale": {"moe_norm_topk": True, "moe_route_scale": 2.5},
    "topk_softmax": {"moe_router": "topk_softmax"},
    "sigmoid-norm-shared": {"moe_router": "sigmoid", "moe_norm_topk": True, "moe_shared_experts": 2},
    "top1": {"moe_top_k": 1},
}


@pytest.mark.parametrize("changes", VARIANTS.values(), ids=VARIANTS.keys())
def test_block_equals_the_per_token_definition(changes):
    """Output and every gradient (input, router, experts, shared experts) at 1e-12."""
    block = moe_block(TINY_MOE.with_(**changes))
    ref_block = copy.deepcopy(block)
    x = torch.randn(2, 7, TINY_MOE.dim, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, ref = block(x), reference(ref_block, x_ref)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(block.named_parameters(), ref_block.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_ties_go_to_the_lower_expert_and_order_is_best_first():
    scores = torch.tensor([[0.1, 0.5, 0.5, 0.2, 0.5], [3.0, 1.0, 2.0, 2.0, 0.0]])
    assert top_k(scores, 3).tolist() == [[1, 2, 4], [0, 2, 3]]


def test_the_bias_moves_the_choice_but_not_the_weights():
    block = moe_block()
    x = torch.randn(9, TINY_MOE.dim, dtype=torch.float64)
    before = block.router(x)
    with torch.no_grad():
        block.router.expert_bias[3] = 10.0  # expert 3 now wins every choice
    after = block.router(x)
    assert (after.experts[:, 0] == 3).all()
    scores = (x @ block.router.weight.t()).softmax(-1)
    torch.testing.assert_close(after.weights, scores.gather(-1, after.experts))
    torch.testing.assert_close(after.probs, before.probs)  # the balance loss sees no bias


def test_capacity_keeps_the_first_slots_of_each_expert_in_token_order():
    """All 6 tokens prefer expert 0 then 1 (top-2 of 4): capacity ceil(1.0·6·2/4) = 3, so
    tokens 0-2 keep both slots, tokens 3-5 lose both and pass through with output 0."""
    args = TINY_MOE.with_(moe_experts=4, moe_capacity=1.0)
    block = moe_block(args)
    with torch.no_grad():
        block.router.weight.zero_()
        block.router.weight[0, 0], block.router.weight[1, 0] = 2.0, 1.0
    x = torch.randn(1, 6, args.dim, dtype=torch.float64)
    x[..., 0] = 1.0
    log = RoutingLog()
    out = block(x, log, "0")
    full = reference(block, x)
    torch.testing.assert_close(out[0, :3], full[0, :3])
    assert out[0, 3:].abs().max() == 0
    assert log.counts["0"].tolist() == [6, 6, 0, 0] and float(log.dropped["0"]) == 6


def test_balance_loss_is_the_per_sequence_switch_loss_and_differentiable():
    """balance = Σ_rows T·E·Σ_e f_e·P_e with f from the row's slots and P the row's mean
    router probability; the reported loss is coefficient × it, and its gradient reaches
    the router through P (f is a count)."""
    block = moe_block(TINY_MOE.with_(moe_router="sigmoid"))
    x = torch.randn(3, 5, TINY_MOE.dim, dtype=torch.float64)
    log = RoutingLog(aux_coef=0.01)
    block(x, log, "2")
    loss = log.take_loss()
    E, k = TINY_MOE.moe_experts, TINY_MOE.moe_top_k
    expected = 0.0
    for row in x:
        routes = block.router(row)
        f = torch.bincount(routes.experts.flatten(), minlength=E).double() / (k * row.shape[0])
        expected = expected + row.shape[0] * E * (f * routes.probs.mean(0)).sum()
    torch.testing.assert_close(log.balance["2"], expected.detach())
    torch.testing.assert_close(loss, 0.01 * expected)
    assert log.take_loss() is None  # taken once
    (g_loss,) = torch.autograd.grad(loss, block.router.weight)
    (g_ref,) = torch.autograd.grad(0.01 * expected, block.router.weight)
    torch.testing.assert_close(g_loss, g_ref, rtol=1e-12, atol=1e-14)
    assert g_loss.abs().sum() > 0


def test_expert_matmul_and_its_gradient_with_empty_groups():
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    counts = torch.tensor([2, 0, 5, 0])
    torch.autograd.gradcheck(lambda a, b: expert_matmul(a, b, counts), (x, w))
    out = expert_matmul(x, w, counts)
    torch.testing.assert_close(out, torch.cat([x[:2] @ w[0].t(), x[2:] @ w[2].t()]))


@pytest.mark.slow  # heavy and not a layout proof: the slow tier (issue 19 suite budget)
def test_recomputation_reports_each_forward_once():
    """A recomputed block runs its forward twice; the log records the first run only, and
    the gradients are those without recomputation."""
    from ndtrain.parallel.recompute import apply_recompute

    def run(recompute: str):
        model = Transformer(TINY_MOE).double()
        model.init_weights(0)
        apply_recompute(model, recompute)
        log = RoutingLog(aux_coef=0.1)
        tokens = torch.randint(0, TINY_MOE.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
        out = model(tokens, routing=log)
        (out.square().mean() + log.take_loss()).backward()
        return log, {n: p.grad for n, p in model.named_parameters()}

    (log_a, grads_a), (log_b, grads_b) = run("none"), run("full")
    for key in log_a.counts:
        assert torch.equal(log_a.counts[key], log_b.counts[key])
        torch.testing.assert_close(log_a.balance[key], log_b.balance[key])
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-12, atol=1e-15, msg=name)


# -- counts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("changes", [{}, {"moe_shared_experts": 1, "moe_every": 2}, {"moe_ffn_dim": 0}])
def test_num_params_matches_param_count(changes):
    args = TINY_MOE.with_(**changes)
    model = Transformer(args)
    assert model.num_params() == param_count(args)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == expert_params(args)
    assert [i for i in range(args.n_layers) if isinstance(model.layers[str(i)].feed_forward, MoE)] == args.moe_layers


def test_olmoe_shape_total_and_active_parameters():
    """OLMoE-1B-7B: 6.9 B parameters, 1.3 B active per token (arXiv 2409.02060)."""
    a = PRESETS["olmoe-1b-7b"]
    assert param_count(a) == pytest.approx(6.92e9, rel=0.01)
    assert param_count(a, active=True) == pytest.approx(1.28e9, rel=0.01)


def test_flops_count_the_active_parameters():
    a = TINY_MOE.with_(moe_shared_experts=1, moe_every=2)
    dense_block, moe_block_ = block_params(a, 0), block_params(a, 1, active=True)
    attention = 2 * a.dim * a.dim + 2 * a.dim * a.n_kv_heads * a.head_dim
    assert dense_block == attention + 3 * a.dim * a.ffn_dim + 2 * a.dim
    assert moe_block_ == attention + a.dim * a.moe_experts + 3 * 3 * a.dim * a.expert_dim + 2 * a.dim
    s = 64
    active = param_count(a, embedding=False, active=True)
    assert flops_per_token(a, s) == 6 * active + 6 * a.n_layers * s * a.dim
    assert active < param_count(a, embedding=False)
