"""Baseline: a static confidence threshold. Verify the drafts whose prefix survival a[r, j] is at least θ,
whatever the load (a prefix, since a is non-increasing in j)."""
from __future__ import annotations

import torch

from ..proposal import Proposal
from .base import Scheduler
from .survival import prefix_survival


class ThresholdScheduler(Scheduler):
    name = "threshold"

    def __init__(self, threshold: float = 0.5):
        if not 0 < threshold < 1:
            raise ValueError(f"threshold must be in (0, 1), got {threshold}")
        self.threshold = threshold

    def plan(self, proposal: Proposal) -> torch.Tensor:
        if proposal.confidence is None:
            return proposal.lengths
        a = prefix_survival(proposal.confidence, proposal.lengths)
        return (a >= self.threshold).sum(-1).long()
