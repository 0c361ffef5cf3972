"""Prefix survival and the orders the confidence schedulers rank drafts in (docs/method.md).

a[r, j] = Π_{i<=j} c[r, i]: the probability that drafts 1..j of request r all survive verification, non-
increasing in j. Candidates are ranked by a descending, ties to the earlier position, so that a later draft
never outranks an earlier one of the same request and every top-K set is a set of prefixes.
"""
from __future__ import annotations

import torch


def prefix_survival(confidence: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """a [R, γ] from c [R, γ]; zero past each request's proposed drafts."""
    a = confidence.double().cumprod(-1)
    return a.masked_fill(torch.arange(a.shape[1])[None, :] >= lengths[:, None], 0.0)


def ranked_candidates(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(r, j, a) of every draft with a > 0, sorted by a descending, ties to smaller j (then smaller r).
    j counts from 1."""
    R, G = a.shape
    r = torch.arange(R).repeat_interleave(G)
    j = torch.arange(1, G + 1).repeat(R)
    flat = a.flatten()
    keep = flat > 0
    r, j, flat = r[keep], j[keep], flat[keep]
    order = sorted(range(len(flat)), key=lambda i: (-float(flat[i]), int(j[i]), int(r[i])))
    order = torch.tensor(order, dtype=torch.long)
    return r[order], j[order], flat[order]


def top_k_lengths(a: torch.Tensor, k: int) -> torch.Tensor:
    """ℓ [R]: the k best-ranked drafts, which form a prefix of every request (the τ-maximising set of size k)."""
    r, _, _ = ranked_candidates(a)
    return torch.bincount(r[:k], minlength=a.shape[0]).long()


def expected_tau(a: torch.Tensor, lengths: torch.Tensor) -> float:
    """τ = Σ_r (1 + Σ_{j<=ℓ_r} a[r, j])."""
    verified = torch.arange(a.shape[1])[None, :] < lengths[:, None]
    return float(a.shape[0] + (a * verified).sum())
