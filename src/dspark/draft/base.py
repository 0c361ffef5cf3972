"""The Drafter interface: propose a block of draft tokens per request (a Proposal, proposal.py), with the exact
distribution each was sampled from (q) and optional per-position confidences (c, survival given the earlier
drafts)."""
from __future__ import annotations

import torch

from ..proposal import Proposal


class Drafter:
    """Base class: no drafts (plain decoding). Subclasses override `propose` and, when they read target
    features, set `target_layer_ids` and use `commit`."""

    gamma: int = 0
    target_layer_ids: tuple[int, ...] = ()  # target layers whose outputs the drafter reads
    has_confidence: bool = False  # proposals carry confidences (a confidence scheduler can use them)

    def propose(self, requests: list, limit: int | None = None) -> Proposal:
        """Draft for every running request (in order); sample with each request's params and generator.
        limit: no request can verify more drafts than this (its tokens or context run out), so drafting
        past it is wasted work."""
        return Proposal.empty(len(requests))

    def commit(self, requests: list, tokens: list[torch.Tensor], features: list[torch.Tensor]) -> None:
        """Each request's newly committed positions: their tokens [n_r] and target features [n_r, m*d]."""

    def release(self, request, moved_from: int | None = None) -> None:
        """Forget a finished or cancelled request. Slots stay compact: if moved_from is given, the
        request that held slot moved_from now holds request.slot (move its state along)."""


class NoDrafter(Drafter):
    """Plain decoding: one target forward per token."""
