"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the context's last
n-gram (longest n first). Drafts are point masses, so verification accepts x with probability p(x).

The search runs over the context as bytes (4 per token) with bytes.rfind, in C, which is several times faster
than comparing list slices in Python."""
from __future__ import annotations

from array import array

import torch

from ..proposal import Proposal
from .base import Drafter

WORD = "I" if array("I").itemsize == 4 else "L"  # 4-byte tokens


class PromptLookupDrafter(Drafter):
    def __init__(self, gamma: int = 7, max_ngram: int = 3, min_ngram: int = 1):
        if gamma < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError("prompt lookup needs gamma >= 1 and 1 <= min_ngram <= max_ngram")
        self.gamma, self.max_ngram, self.min_ngram = gamma, max_ngram, min_ngram

    def lookup(self, context: list[int]) -> list[int]:
        n_ctx = len(context)
        data = array(WORD, context).tobytes()
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            tail, end = data[-4 * n:], 4 * (n_ctx - 1)  # a match ends before the context's last token
            while (at := data.rfind(tail, 0, end)) >= 0:
                if at % 4 == 0:  # whole tokens, not bytes across two
                    return continuation(context, at // 4 + n, self.gamma)
                end = at + 4 * n - 1
        return []

    def propose(self, requests: list, limit: int | None = None) -> Proposal:
        return point_masses([self.lookup(req.all_token_ids) for req in requests], self.gamma)


def continuation(context: list[int], start: int, gamma: int) -> list[int]:
    """The gamma tokens from context[start] on, where the text from start to the end repeats: a match that ends
    fewer than gamma tokens before the context's end has only those tokens after it, and if the text goes on as it
    did after the match (the last n-gram again followed by what followed it), it repeats them with period
    len(context) - start. So the draft continues its own first tokens with that period: in a loop of one token
    ("()()()..."), a 1-token continuation becomes gamma copies."""
    draft = context[start:start + gamma]
    period = len(context) - start
    while len(draft) < gamma:
        draft.append(draft[len(draft) - period])
    return draft


def point_masses(drafts: list[list[int]], width: int) -> Proposal:
    """A proposal of point-mass drafts (q None), one list of tokens per request, each cut to width."""
    tokens = torch.zeros(len(drafts), width, dtype=torch.long)
    lengths = torch.zeros(len(drafts), dtype=torch.long)
    for i, found in enumerate(drafts):
        found = found[:width]
        tokens[i, :len(found)] = torch.tensor(found, dtype=torch.long)
        lengths[i] = len(found)
    return Proposal(tokens, None, lengths)
