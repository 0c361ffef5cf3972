"""The asynchronous production scheduler (METHOD.md §5): the budget of step N, K extra verify positions,
comes from the confidences of step N−2 by a global search over the whole cost table (no early stop, so
it crosses local dips of a staircase); the drafts of step N are then allocated by top-K on their prefix
survival, ties to the earlier position. The budget never reads the current drafts, and a later draft
never outranks an earlier one of its request, so no draft's inclusion depends on confidences computed
from it.

On a CPU the plan runs between the drafter and the verify forward of the same step; the two-step lag is
kept all the same, so the scheduler behaves as it would overlapped with the GPU.
"""
from __future__ import annotations

from collections import deque

import torch

from ..draft.base import Proposal
from .base import Scheduler
from .cost_table import CostTable
from .survival import prefix_survival, top_k_lengths


def global_budget(old_survival: torch.Tensor, R: int, slots: int, cost: CostTable) -> int:
    """K in 0..slots maximising (R + expected gain of the K best drafts) · SPS(R + K), the gain read off
    the sorted prefix survivals of an earlier step (stretched to `slots` candidates)."""
    old = old_survival.flatten().double().sort(descending=True).values
    if old.numel() == 0 or slots == 0:
        return 0
    idx = (torch.arange(slots) * old.numel()) // slots  # the earlier ranking, stretched to this step's slots
    gains = torch.cat([old.new_zeros(1), old[idx].cumsum(0)])  # expected gain of the K best, K = 0..slots
    theta = [(R + float(gains[k])) * cost.sps(R + k, R) for k in range(slots + 1)]
    return max(range(slots + 1), key=lambda k: (theta[k], -k))


class AsyncBudgetScheduler(Scheduler):
    name = "async"

    def __init__(self, cost: CostTable, lag: int = 2):
        self.cost = cost
        self.history: deque[torch.Tensor] = deque(maxlen=lag)  # prefix survivals of the last steps
        self.budget: int | None = None

    def plan(self, proposal: Proposal) -> torch.Tensor:
        if proposal.confidence is None:
            return proposal.lengths
        a = prefix_survival(proposal.confidence, proposal.lengths)
        R = a.shape[0]
        slots = int(proposal.lengths.sum())
        if len(self.history) == self.history.maxlen:
            self.budget = global_budget(self.history[0], R, slots, self.cost)
        else:  # no step N−2 yet: verify everything proposed
            self.budget = slots
        self.history.append(a)
        return top_k_lengths(a, self.budget)

    def observe(self, st) -> None:
        self.cost.observe(st.verify_tokens, st.num_requests, st.t_total - st.t_prefill)
