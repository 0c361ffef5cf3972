"""The asynchronous production scheduler (METHOD.md §5): the budget of step N, K extra verify positions,
comes from the confidences of step N−2 by a global search over the whole cost table (no early stop, so
it crosses local dips of a staircase); the drafts of step N are then allocated by top-K on their prefix
survival, ties to the earlier position. The budget never reads the current drafts, and a later draft
never outranks an earlier one of its request, so no draft's inclusion depends on confidences computed
from it.

Before the drafter runs, the same search decides whether drafting pays at all: plain decoding saves the
drafter call, so where no budget's gain covers it (a CPU whose verify cost grows with every token, a
drafter nearly as costly as the target) the step skips the drafter and verifies nothing. The decision reads
only earlier steps, like the budget; after `probe_every` skipped steps in a row one step drafts anyway, so the
survivals stay current. Each probe after which drafting still does not pay doubles the wait before the next
(up to `max_probe_every`), so where the drafter never pays the probes cost almost nothing; the first step where
drafting pays again resets it.

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


def budget_search(old_survival: torch.Tensor, R: int, slots: int, cost: CostTable) -> tuple[int, float]:
    """(K, Θ_K): K in 0..slots maximising Θ_K = (R + expected gain of the K best drafts) · SPS(R + K), the
    gain read off the sorted prefix survivals of an earlier step (stretched to `slots` candidates)."""
    old = old_survival.flatten().double().sort(descending=True).values
    if old.numel() == 0 or slots == 0:
        return 0, R * cost.sps(R, R)
    idx = (torch.arange(slots) * old.numel()) // slots  # the earlier ranking, stretched to this step's slots
    gains = torch.cat([old.new_zeros(1), old[idx].cumsum(0)])  # expected gain of the K best, K = 0..slots
    theta = [(R + float(gains[k])) * cost.sps(R + k, R) for k in range(slots + 1)]
    k = max(range(slots + 1), key=lambda k: (theta[k], -k))
    return k, theta[k]


def global_budget(old_survival: torch.Tensor, R: int, slots: int, cost: CostTable) -> int:
    return budget_search(old_survival, R, slots, cost)[0]


def drafting_pays(old_survival: torch.Tensor, R: int, slots: int, cost: CostTable) -> bool:
    """Whether the best budget (drafter call included) beats plain decoding, which has no drafter call."""
    return slots > 0 and budget_search(old_survival, R, slots, cost)[1] > R * cost.sps(R, R, drafted=False)


class AsyncBudgetScheduler(Scheduler):
    name = "async"

    def __init__(self, cost: CostTable, lag: int = 2, probe_every: int = 32, max_probe_every: int = 512):
        self.cost = cost
        self.history: deque[torch.Tensor] = deque(maxlen=lag)  # prefix survivals of the last drafting steps
        self.budget: int | None = None
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.wait = probe_every  # skipped steps before the next probe
        self.skipped = 0  # steps in a row that skipped the drafter

    def skip_drafting(self, num_requests: int, slots: int) -> bool:
        if len(self.history) < self.history.maxlen:  # no step N−2 yet: draft
            skip = False
        elif drafting_pays(self.history[0], num_requests, slots, self.cost):
            skip, self.wait = False, self.probe_every
        elif self.skipped >= self.wait:  # probe
            skip, self.wait = False, min(2 * self.wait, self.max_probe_every)
        else:
            skip = True
        self.skipped = self.skipped + 1 if skip else 0
        return skip

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
        self.cost.observe(st.verify_tokens, st.num_requests, st.t_total - st.t_prefill, drafted=not st.draft_skipped)
