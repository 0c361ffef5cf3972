"""What a drafter hands the step: per request its draft tokens, the distributions they were sampled from, how many
there are, the confidence head's survival estimates and, for draft trees, each draft's parent. The schedulers read
it, the verifier checks it; it depends on nothing else in dspark."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    tokens: torch.Tensor  # [R, gamma] long
    q: torch.Tensor | None  # [R, gamma, V] draft distributions; None: each draft is a point mass
    lengths: torch.Tensor  # [R] drafts actually proposed (tokens past it are padding)
    confidence: torch.Tensor | None = None  # [R, gamma] c_k in (0, 1)
    parents: torch.Tensor | None = None  # [R, gamma] long: draft trees (tree.py), each draft's parent; None: chains

    @staticmethod
    def empty(num_requests: int) -> "Proposal":
        z = torch.zeros(num_requests, 0, dtype=torch.long)
        return Proposal(z, None, torch.zeros(num_requests, dtype=torch.long))
