"""The asynchronous production scheduler (docs/method.md): the budget of step N, K extra verify positions,
comes from the confidences of step N−2 by a global search over the whole cost table (no early stop, so
it crosses local dips of a staircase); the drafts of step N are then allocated by top-K on their prefix
survival, ties to the earlier position. The budget never reads the current drafts, and a later draft
never outranks an earlier one of its request, so no draft's inclusion depends on confidences computed
from it.

The budget is chosen before the drafter runs, with the drafter call in each candidate's cost: K = 0 is plain
decoding (no drafter call), and a budget of K needs at most K positions per request, so the drafter samples
no deeper (a shallower call is cheaper: its LM head and sequential head run once per position). Where no
budget's gain covers its cost (a CPU whose verify cost grows with every token, a drafter nearly as costly as
the target) the step skips the drafter and verifies nothing. The decision reads only earlier steps; after
`probe_every` steps in a row short of the whole block (skipped or shallow) one step drafts the whole block, so
the survivals of every position stay current (unseen positions count as no gain, so between probes the depth can
only shrink). Each probe after which drafting still does not pay doubles the wait before the next (up to
`max_probe_every`), so where the drafter never pays the probes cost almost nothing; the first step where drafting
pays again resets it, and so does a step whose requests are at least half newly admitted (a prompt where the drafter
does well must not wait out the long pause a previous one earned; under steady traffic into a large batch the
pause still grows).

On a CPU the plan runs between the drafter and the verify forward of the same step; the two-step lag is
kept all the same, so the scheduler behaves as it would overlapped with the GPU.
"""
from __future__ import annotations

from collections import deque

import torch

from ..proposal import Proposal
from .base import Scheduler
from .cost_table import CostTable
from .survival import prefix_survival, top_k_lengths


def budget_search(old_survival: torch.Tensor, R: int, slots: int, cost: CostTable,
                  sunk: bool = False) -> tuple[int, int, float]:
    """(K, depth, Θ_K): K in 0..slots maximising Θ_K = (R + expected gain of the K best drafts) · SPS(R + K),
    the gain read off the prefix survivals of an earlier step, ranked (ties to the earlier position) and
    stretched to `slots` candidates; depth: the deepest position among the K best, which the drafter must
    reach. The step time of K includes a drafter call that deep (none for K = 0); sunk: the drafter has
    already drafted its whole block, so every K pays for all of it."""
    if old_survival.numel() == 0 or slots == 0:
        return 0, 0, R * cost.sps(R, R, drafted=sunk)
    R_old = old_survival.shape[0]
    flat = old_survival.double().t().flatten()  # position-major, so a stable sort puts earlier positions first
    values, order = torch.sort(flat, descending=True, stable=True)
    idx = (torch.arange(slots) * flat.numel()) // slots  # the earlier ranking, stretched to this step's slots
    gains = [0.0] + values[idx].cumsum(0).tolist()  # expected gain of the K best, K = 0..slots
    depths = [0] + (order[idx] // R_old + 1).cummax(0).values.tolist()  # deepest position among the K best
    theta = [(R + gains[k]) * cost.sps(R + k, R, drafted=sunk or k > 0, depth=None if sunk else depths[k])
             for k in range(slots + 1)]
    k = max(range(slots + 1), key=lambda k: (theta[k], -k))
    return k, depths[k], theta[k]


def global_budget(old_survival: torch.Tensor, R: int, slots: int, cost: CostTable) -> int:
    """The budget for drafts already made (the drafter's whole block, its cost paid whatever K)."""
    return budget_search(old_survival, R, slots, cost, sunk=True)[0]


class AsyncBudgetScheduler(Scheduler):
    name = "async"

    def __init__(self, cost: CostTable, lag: int = 2, probe_every: int = 32, max_probe_every: int = 512):
        self.cost = cost
        self.lag = lag
        self.steps = 0  # steps planned so far, skipped ones included
        self.history: deque[tuple[int, torch.Tensor]] = deque(maxlen=lag)  # (step, prefix survivals) of drafting steps
        self.width = 0  # the widest block drafted so far: shallower survivals are padded with zeros to it
        self.planned: int | None = None  # the budget chosen before drafting (None: plan chooses it)
        self.budget: int | None = None  # the budget of the last plan
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.wait = probe_every  # steps short of the whole block before the next probe
        self.shallow = 0  # steps in a row that skipped the drafter or drafted short of the whole block

    def old_survival(self) -> torch.Tensor | None:
        """The prefix survivals of the latest drafting step at least `lag` steps before this one (skipped steps
        count, so a probe's survivals are read two steps after it, not after the next drafting step), or None."""
        old = [a for step, a in self.history if step <= self.steps - self.lag]
        return old[-1] if old else None

    def draft_limit(self, num_requests: int, slots: int) -> int | None:
        self.planned = None
        old = self.old_survival()
        if old is None:  # no step N−2 yet: draft the whole block, verify it all
            return None
        k, depth, _ = budget_search(old, num_requests, slots, self.cost)
        if k > 0:
            self.wait = self.probe_every
        if depth >= self.width:  # the whole block pays
            self.shallow = 0
            self.planned = k
            return None
        if self.shallow >= self.wait:  # probe: the whole block, so every position's survival is seen again
            if k == 0:  # a probe after which drafting still does not pay waits twice as long for the next
                self.wait = min(2 * self.wait, self.max_probe_every)
            self.shallow = 0
            return None
        self.shallow += 1
        self.planned = k
        return depth

    def plan(self, proposal: Proposal) -> torch.Tensor:
        old, step = self.old_survival(), self.steps
        self.steps += 1
        if proposal.confidence is None:
            return proposal.lengths
        a = prefix_survival(proposal.confidence, proposal.lengths)
        R = a.shape[0]
        slots = int(proposal.lengths.sum())
        if self.planned is not None:
            self.budget = self.planned
        elif old is not None:  # the whole block was drafted unplanned (a probe): paid for
            self.budget = global_budget(old, R, slots, self.cost)
        else:  # no step N−2 yet: verify everything proposed
            self.budget = slots
        self.planned = None
        self.width = max(self.width, a.shape[1])
        self.history.append((step, torch.nn.functional.pad(a, (0, self.width - a.shape[1]))))  # unseen: no gain
        return top_k_lengths(a, min(self.budget, slots))

    def observe(self, st) -> None:
        if 2 * st.admitted >= max(st.num_requests, 1):  # mostly new requests, whose survivals no step has seen:
            self.wait = self.probe_every  # probe within probe_every steps (a trickle into a large batch does not)
        self.cost.observe(st.verify_tokens, st.num_requests, st.t_total - st.t_prefill, drafted=not st.draft_skipped,
                          depth=max(st.drafted, default=0))
