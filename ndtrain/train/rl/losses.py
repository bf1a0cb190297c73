"""RL's arithmetic: advantages, the policy-gradient objectives, dynamic sampling and
overlong shaping. Pure functions of tensors (tests check each against numbers worked out
by hand); docs/rl.md has the formulas.

Notation: a batch holds N sampled completions o_i in groups of G per prompt, with rewards
r_i; completion i has |o_i| tokens. Per token t of o_i the policy's log-probability is
log π(o_i,t), the old policy's (before this update) log π_old and the frozen reference's
log π_ref. ρ = exp(log π − log π_old) is the importance ratio.

| `rl.loss` | advantage A_i | per-token term | normalisation |
|---|---|---|---|
| reinforce | r_i − mean of the batch's r | −A_i · log π | Σ over a completion's tokens, mean over completions |
| grpo | (r_i − mean_g) / (std_g + ε) | −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A) + β·k3 | mean over a completion's tokens, mean over completions |
| dr_grpo | r_i − mean_g | the same | Σ over tokens / (N · max_new_tokens) |
| dapo | (r_i − mean_g) / (std_g + ε) | the same, ε_high > ε_low (clip-higher) | Σ over tokens / the batch's tokens (token level) |

k3 = exp(log π_ref − log π) − (log π_ref − log π) − 1 ≥ 0, an unbiased estimate of
KL(π ‖ π_ref) (Schulman, "Approximating KL divergence"). std_g is the sample standard
deviation of the group's rewards (n − 1 in the denominator).

The normalisations fit the trainer's rule (the step divides every loss sum by the global
count T of trained tokens): each token's term is multiplied by its `weight`, T/(N·|o_i|)
(grpo), T/(N·max_new_tokens) (dr_grpo), 1 (dapo), T/N (reinforce).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ndtrain.config import RL_LOSSES as LOSSES  # noqa: F401 - the names, for readers
from ndtrain.data.batch import MicroBatch
from ndtrain.model.loss import IGNORE

STD_EPS = 1e-6


def advantages(rewards: Tensor, loss: str) -> Tensor:
    """A [groups, G] from rewards [groups, G], as the table above says."""
    r = rewards.double()
    if loss == "reinforce":
        return r - r.mean()
    centred = r - r.mean(dim=1, keepdim=True)
    if loss == "dr_grpo":
        return centred
    std = r.std(dim=1, keepdim=True) if r.shape[1] > 1 else torch.zeros_like(r[:, :1])
    return centred / (std + STD_EPS)


def token_weight(loss: str, lengths: Tensor, max_new_tokens: int) -> Tensor:
    """Each completion's per-token weight [N] given the completions' lengths [N] (0 for a
    row that trains nothing), relative to the trainer's division by T = Σ lengths."""
    lengths = lengths.double()
    total, n = lengths.sum(), (lengths > 0).sum().clamp_min(1)
    if loss == "dapo":
        return torch.ones_like(lengths)
    if loss == "dr_grpo":
        return torch.full_like(lengths, float(total / (n * max_new_tokens)))
    if loss == "reinforce":
        return torch.full_like(lengths, float(total / n))
    return torch.where(lengths > 0, total / (n * lengths.clamp_min(1)), 0.0)  # grpo


def informative(rewards: Tensor) -> Tensor:
    """[groups] bool: the group's rewards are not all equal (its advantages are not all 0)."""
    return (rewards != rewards[:, :1]).any(dim=1)


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int) -> Tensor:
    """DAPO's soft overlong punishment [N]: 0 up to max_new_tokens − buffer tokens, then
    falling linearly to −1 at max_new_tokens ((max − buffer − |o|) / buffer); −1 beyond
    (a completion cut at max_new_tokens that did not stop). buffer = 0: no shaping."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float64)
    lengths = lengths.double()
    start = max_new_tokens - buffer
    ramp = ((start - lengths) / buffer).clamp(-1.0, 0.0)
    return torch.where(lengths > max_new_tokens, -1.0, ramp)


class PolicyObjective:
    """The task's half of the loss under RL (model/loss.TokenLoss): the sum over the
    micro-batch's trained tokens of weight · (policy-gradient term + β·k3), from each
    token's negative log-likelihood under the current weights. Counts, as it goes, the
    tokens whose ratio was clipped (the clipped term was the smaller, so the token had no
    gradient), for the step's `clip_fraction`."""

    def __init__(self, loss: str, clip_low: float, clip_high: float, kl_coef: float):
        self.loss, self.clip_low, self.clip_high, self.kl_coef = loss, clip_low, clip_high, kl_coef
        self.clipped = 0.0
        self.tokens = 0.0

    def __call__(self, nll: Tensor, mb: MicroBatch) -> Tensor:
        logp = -nll
        valid = (mb.targets.flatten() != IGNORE).to(nll.dtype)
        adv = mb.advantages.flatten().to(nll.dtype)
        if self.loss == "reinforce":
            term = -adv * logp
        else:
            ratio = torch.exp(logp - mb.old_logprobs.flatten().to(nll.dtype))
            plain = ratio * adv
            clipped = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high) * adv
            term = -torch.minimum(plain, clipped)
            self.clipped = self.clipped + ((clipped < plain) * valid).sum().detach().double()
        if mb.is_weights is not None:  # a stale rollout: from the behaviour policy to π_old (behaviour_weights)
            term = mb.is_weights.flatten().to(nll.dtype) * term
        if self.kl_coef:
            term = term + self.kl_coef * k3(logp, mb.ref_logprobs.flatten().to(nll.dtype))
        self.tokens = self.tokens + valid.sum().detach().double()
        return (mb.weights.flatten().to(nll.dtype) * term * valid).sum()

    def take_counts(self) -> tuple[float, float]:
        """(clipped tokens, tokens) since the last call."""
        out = (float(self.clipped), float(self.tokens))
        self.clipped = self.tokens = 0.0
        return out


def behaviour_weights(old_logprobs: Tensor, behaviour_logprobs: Tensor, trained: Tensor, off_policy: str,
                      cap: float) -> Tensor:
    """Each token's importance weight from the behaviour policy that sampled it to π_old
    (the proximal policy: the weights before this update, recomputed by the training
    forward): w = π_old / π_behaviour = exp(log π_old − log π_behaviour), truncated at `cap`
    under `tis`, whole under `decoupled`; 1 where nothing is trained. Constants of the loss
    (no gradient)."""
    w = torch.exp(old_logprobs - behaviour_logprobs)
    if off_policy == "tis":
        w = w.clamp_max(cap)
    return torch.where(trained, w, torch.ones_like(w))


def k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """The k3 estimate of KL(π ‖ π_ref) at each token."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0
