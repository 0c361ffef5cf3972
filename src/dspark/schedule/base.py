"""The Scheduler interface: choose how many drafts each request verifies this step (ℓ_r)."""
from __future__ import annotations

import torch

from ..proposal import Proposal


class Scheduler:
    name = "scheduler"
    max_drafts: int | None = None  # no request ever verifies more drafts than this, so none are drafted

    def plan(self, proposal: Proposal) -> torch.Tensor:
        """ℓ_r per request, 0 <= ℓ_r <= proposal.lengths[r]."""
        raise NotImplementedError

    def draft_limit(self, num_requests: int, slots: int) -> int | None:
        """Asked before the drafter runs (so it never reads this step's drafts): the most drafts any request
        can verify this step, so the drafter samples no more positions than that; 0 skips the drafter call
        (a plain decoding step); None: no limit but the drafter's block. slots: drafts the step could verify
        (Σ_r min(γ, room_r))."""
        return self.max_drafts

    def observe(self, st) -> None:
        """The finished step's statistics (StepStats): measured time, B, R (for online cost correction)."""


class FixedLength(Scheduler):
    """Verify up to gamma drafts of every request (the usual speculative decoding); 0 is plain decoding."""

    name = "fixed"

    def __init__(self, gamma: int | None = None):
        if gamma is not None and gamma < 0:
            raise ValueError(f"fixed length must be >= 0, got {gamma}")
        self.gamma = self.max_drafts = gamma

    def plan(self, proposal: Proposal) -> torch.Tensor:
        return proposal.lengths if self.gamma is None else proposal.lengths.clamp(max=self.gamma)
