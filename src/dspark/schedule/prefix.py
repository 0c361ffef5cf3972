"""Algorithm 1 (docs/method.md), exactly: add drafts in order of prefix survival while the expected output per
second Θ = τ · SPS(B) improves, and stop at the first candidate that does not improve it.

The early stop keeps the decision causal: whether draft x_j is verified is decided before any candidate
ranked after it is looked at, so a confidence computed from x_j (c_{j+1} reads x_j) cannot decide whether
x_j itself is verified (Appendix A's counterexample shows the bias a search past the stop causes).
"""
from __future__ import annotations

import torch

from ..proposal import Proposal
from .base import Scheduler
from .cost_table import CostTable
from .survival import prefix_survival, ranked_candidates


def algorithm1(a: torch.Tensor, cost: CostTable) -> tuple[torch.Tensor, int]:
    """(ℓ [R], number of candidates read) for prefix survival a [R, γ]."""
    R = a.shape[0]
    lengths, best_lengths = [0] * R, [0] * R
    B, tau = R, float(R)
    best = tau * cost.sps(B, R)
    rs, js, survival = ranked_candidates(a)
    read = 0
    for r, j, s in zip(rs.tolist(), js.tolist(), survival.tolist()):
        read += 1
        lengths[r] = j
        B += 1
        tau += s
        theta = tau * cost.sps(B, R)
        if theta > best:
            best, best_lengths[r] = theta, lengths[r]
        else:
            break
    return torch.tensor(best_lengths, dtype=torch.long), read


class PrefixScheduler(Scheduler):
    """Algorithm 1 on the drafter's (calibrated) confidences; without confidences, verify everything."""

    name = "algorithm1"

    def __init__(self, cost: CostTable):
        self.cost = cost

    def plan(self, proposal: Proposal) -> torch.Tensor:
        if proposal.confidence is None:
            return proposal.lengths
        return algorithm1(prefix_survival(proposal.confidence, proposal.lengths), self.cost)[0]

    def observe(self, st) -> None:
        self.cost.observe(st.verify_tokens, st.num_requests, st.t_total - st.t_prefill)
