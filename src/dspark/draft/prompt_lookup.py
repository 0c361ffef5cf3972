"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the context's last
n-gram (longest n first). Drafts are point masses, so verification accepts x with probability p(x)."""
from __future__ import annotations

import torch

from .base import Drafter, Proposal


class PromptLookupDrafter(Drafter):
    def __init__(self, gamma: int = 7, max_ngram: int = 3, min_ngram: int = 1):
        if gamma < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError("prompt lookup needs gamma >= 1 and 1 <= min_ngram <= max_ngram")
        self.gamma, self.max_ngram, self.min_ngram = gamma, max_ngram, min_ngram

    def lookup(self, context: list[int]) -> list[int]:
        n_ctx = len(context)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            tail = context[-n:]
            for start in range(n_ctx - n - 1, -1, -1):  # latest match first
                if context[start:start + n] == tail:
                    return context[start + n:start + n + self.gamma]
        return []

    def propose(self, requests: list, limit: int | None = None) -> Proposal:
        return point_masses([self.lookup(req.all_token_ids) for req in requests], self.gamma)


def point_masses(drafts: list[list[int]], width: int) -> Proposal:
    """A proposal of point-mass drafts (q None), one list of tokens per request, each cut to width."""
    tokens = torch.zeros(len(drafts), width, dtype=torch.long)
    lengths = torch.zeros(len(drafts), dtype=torch.long)
    for i, found in enumerate(drafts):
        found = found[:width]
        tokens[i, :len(found)] = torch.tensor(found, dtype=torch.long)
        lengths[i] = len(found)
    return Proposal(tokens, None, lengths)
