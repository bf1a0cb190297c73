"""Muon (train.optimizer = muon): momentum orthogonalised by a Newton–Schulz iteration on
each weight matrix of the blocks, AdamW on the rest (embeddings, output head, norms,
biases, routers: parallel/states.muon_matrix), as Keller Jordan's Muon, Moonlight / Kimi K2
and torch.optim.Muon's documentation do.

The update of one matrix W with gradient G (torch.optim.Muon's, step for step):
    B ← μ·B + (1 − μ)·G            (B.lerp_(G, 1 − μ))
    U ← Nesterov ? G + μ·(B − G) : B
    O ← newton_schulz(U)
    W ← W·(1 − lr·wd) − lr·ratio(A, B)·O
The momentum and the update are element-wise, so they stay wherever the layout keeps the
matrix's elements (a ZeRO slice, a TP shard); only O needs the whole matrix, which
parallel/muon.MatrixOwners assembles on one owning rank per matrix. On one process that is
the identity, and this optimizer equals torch.optim.Muon plus torch.optim.AdamW
(tests/test_muon.py); every layout equals one process (the fp64 proofs).

The iteration runs in the compute dtype (train.precision): bf16, as torch.optim.Muon and
Keller Jordan's code always do, under bf16; fp32 under fp32; fp64 in the layout proofs.
"""

from __future__ import annotations

import math

import torch

from ndtrain.config.sections import muon_coefficients
from ndtrain.parallel.muon import MatrixOwners

NS_EPS = 1e-7  # torch.optim.Muon's (Keller Jordan's) guard of the first normalisation


def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """The quintic Newton–Schulz iteration towards the orthogonal factor of `g` (2-D), in
    `dtype`: X ← a·X + (b·XXᵀ + c·(XXᵀ)²)·X on the wide orientation, after X = g/‖g‖_F.
    torch.optim.Muon's `_zeropower_via_newtonschulz` with dtype = bf16, op for op."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def lr_ratio(shape: tuple[int, int], adjust: str) -> float:
    """How Muon scales the learning rate of an A×B matrix: `original` (Keller Jordan:
    sqrt(max(1, A/B))) or `match_rms_adamw` (Moonlight: 0.2·sqrt(max(A, B)), an update of
    AdamW's RMS, so AdamW's learning rate and weight decay carry over)."""
    a, b = shape
    return math.sqrt(max(1, a / b)) if adjust == "original" else 0.2 * math.sqrt(max(a, b))


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer over every group: AdamW (`adamw`, built by the caller) on the groups
    without "muon", Muon on those with it. One state dict, so checkpoints see AdamW's
    `exp_avg`/`exp_avg_sq` and Muon's `momentum_buffer` side by side, each with its `step`.

    `slices`: what each Muon holder holds (states.optim_slices()); `group`: the ranks among
    which matrices are owned (mesh.stage_group()); `ns_dtype`: the iteration's dtype."""

    def __init__(self, groups: list[dict], adamw: torch.optim.Optimizer | None, t, slices, group,
                 ns_dtype: torch.dtype):
        muon_groups = [g for g in groups if g.get("muon")]
        # train.muon_lr: Muon's peak, scheduled as train.lr is (set_lr sets every group's "lr")
        defaults = {"lr": t.lr, "weight_decay": t.weight_decay, "momentum": t.muon_momentum,
                    "nesterov": t.muon_nesterov, "muon_lr": t.muon_lr, "base_lr": t.lr}
        super().__init__(muon_groups or [{"params": []}], defaults)
        self.muon_groups = list(self.param_groups)
        self.adamw = adamw
        self.coefficients = muon_coefficients(t.muon_ns_coefficients)
        self.ns_steps, self.adjust, self.ns_dtype = t.muon_ns_steps, t.muon_adjust_lr, ns_dtype
        holders = [p for g in self.muon_groups for p in g["params"]]
        held = {id(h) for h in holders}
        mine = [s for s in slices if id(s.holder) in held]
        self.owners = MatrixOwners(holders, mine, group, self.ns_steps)
        self._share()

    def _share(self) -> None:
        """AdamW's groups and state are this optimizer's (set_lr, checkpoints, memory)."""
        if self.adamw is not None:
            self.param_groups = [*self.adamw.param_groups, *self.muon_groups]
            self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # new group dicts and a new state
        if self.adamw is not None:
            n = len(self.adamw.param_groups)
            self.adamw.param_groups, self.muon_groups = self.param_groups[:n], self.param_groups[n:]
            self.adamw.state = self.state
        else:
            self.muon_groups = self.param_groups

    def ns(self, m: torch.Tensor) -> torch.Tensor:
        return newton_schulz(m, self.coefficients, self.ns_steps, self.ns_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        """Muon's momentum, then the owners' iteration (parallel/muon.MatrixOwners), with
        AdamW's step and the weight decay run while the results travel back; each holder's
        part of a result is added as it is handed over."""
        params, inputs = [], []
        needed = self.owners.needed
        for group in self.muon_groups:
            mu = group["momentum"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["momentum_buffer"] = torch.zeros_like(p)
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - mu)
                i = len(params)
                if not needed[i]:  # neither owned nor sent from here: only its momentum moves on
                    inputs.append(None)
                elif group["nesterov"]:
                    inputs.append(grad.lerp(buf, mu))
                else:
                    inputs.append(buf)
                state["step"] += 1
                params.append((p, group))
        if not params:
            if self.adamw is not None:
                self.adamw.step()
            return None
        rates = [group["muon_lr"] * (group["lr"] / group["base_lr"]) if group["muon_lr"] else group["lr"]
                 for _, group in params]
        flats = [p.view(-1) for p, _ in params]

        def during():  # AdamW's tensors, and the decay of every Muon holder before its update
            if self.adamw is not None:
                self.adamw.step()
            for (p, group), lr in zip(params, rates):
                p.mul_(1 - lr * group["weight_decay"])

        def apply(i, positions, values, shape):
            alpha = -(rates[i] * lr_ratio(shape, self.adjust))
            if isinstance(positions, slice):
                flats[i][positions].view(values.shape).add_(values, alpha=alpha)
            else:
                flats[i][positions] = flats[i][positions].add(values, alpha=alpha)
        self.owners.orthogonalize(inputs, self.ns, apply, during)
        return None
