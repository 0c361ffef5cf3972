"""Lookups first, a trained drafter elsewhere: each request's draft comes from the first of an ordered list of
lookup sources that finds one (prompt lookup: the tokens that followed the context's last n-gram earlier in the
context; a datastore of the target's own answers: datastore.py), with no forward at all; for the other requests
the drafter drafts. Which source drafts depends only on the committed context, so verification stays lossless.
Lookup drafts are point masses: where a step mixes them with the drafter's, their q rows are one-hot, which
verification treats exactly as a point mass. In a step of greedy requests, every source's draft is verified at once,
merged into a draft tree (tree.py); otherwise the first source's.

On the bundled target, text that repeats itself (numbers restated in a math answer, names in code) is common,
and a lookup draft costs next to nothing to make (no forward), while a drafter call costs a good share of a target
step on a CPU (benchmarks/results/draft_vocab.md: draft_ms). Alone, prompt lookup is accepted for more tokens a
step than the bundled drafter, and lookups first with DSpark elsewhere is the fastest single stream of the bundled
target measured (benchmarks/results/drafters.md: prompt-lookup, dspark, lookup+dspark).
"""
from __future__ import annotations

import torch

from ..proposal import Proposal
from .base import Drafter
from .prompt_lookup import PromptLookupDrafter, point_masses
from .tree import chain, merge


class LookupFirstDrafter(Drafter):
    # lookup drafts carry no confidences, so the steps are scheduled at fixed length (scheduler "auto")
    has_confidence = False

    def __init__(self, drafter: Drafter, sources: list | None = None, gamma: int | None = None, tree: bool = True):
        """sources: objects with lookup(context token ids) -> draft token ids ([] where they find none) and a gamma
        (the most they draft), first first; default: prompt lookup of 3- to 1-grams. gamma: the most drafts the
        drafter makes a step (default its own); a source may draft more (prompt lookup of a long repeat). tree:
        greedy steps verify every source's draft as one tree of at most the widest source's gamma nodes."""
        self.drafter, self.tree = drafter, tree
        self.drafter_gamma = gamma or drafter.gamma
        self.sources = sources or [PromptLookupDrafter(self.drafter_gamma)]
        self.gamma = max(self.drafter_gamma, *(source.gamma for source in self.sources))  # the widest draft
        self.target_layer_ids = drafter.target_layer_ids

    def lookup(self, context: list[int]) -> list[int]:
        for source in self.sources:
            found = source.lookup(context)
            if found:
                return found[:self.gamma]
        return []

    def drafts(self, context: list[int], tree: bool) -> tuple[list[int], list[int]]:
        """(tokens, parents) of a request's lookup drafts: the first source's chain, or (tree) every source's
        drafts merged; ([], []) where no source finds one."""
        if not tree:
            found = self.lookup(context)
            return found, chain(len(found))
        return merge([found for source in self.sources if (found := source.lookup(context))], self.gamma)

    def propose(self, requests: list, limit: int | None = None) -> Proposal:
        tree = self.tree and all(req.params.greedy for req in requests)
        drafts = [self.drafts(req.all_token_ids, tree) for req in requests]
        proposal = self.mix(requests, [tokens for tokens, _ in drafts], limit)
        if tree:  # the drafter's rows are chains
            width = proposal.tokens.shape[1]
            proposal.parents = torch.tensor([parents + chain(width)[len(parents):] for _, parents in drafts],
                                            dtype=torch.long).view(len(requests), width)
        return proposal

    def mix(self, requests: list, found: list[list[int]], limit: int | None) -> Proposal:
        """The lookup drafts `found`, and the drafter's for the requests with none."""
        if all(found):  # no drafter call this step
            return point_masses(found, self.gamma)
        drafted = self.drafter.propose(requests, self.drafter_gamma if limit is None else min(limit, self.drafter_gamma))
        if not any(found):  # the drafter's drafts, without its confidences (see has_confidence)
            return Proposal(drafted.tokens, drafted.q, drafted.lengths)
        width = max(drafted.tokens.shape[1], *map(len, found))
        looked_up = point_masses(found, width)
        rows = torch.tensor([bool(f) for f in found])
        drafts = torch.nn.functional.pad(drafted.tokens, (0, width - drafted.tokens.shape[1]))
        tokens = torch.where(rows[:, None], looked_up.tokens, drafts)
        lengths = torch.where(rows, looked_up.lengths, drafted.lengths)
        if drafted.q is None:  # the drafter's drafts are point masses too
            return Proposal(tokens, None, lengths)
        q = torch.nn.functional.pad(drafted.q, (0, 0, 0, width - drafted.q.shape[1]))  # a copy, zero past its drafts
        q[rows] = 0
        positions = torch.arange(width)
        one_hot = rows[:, None] & (positions[None, :] < lengths[:, None])  # [R, K]: a lookup draft sits here
        q[one_hot, tokens[one_hot]] = 1.0
        return Proposal(tokens, q, lengths)

    def commit(self, requests: list, tokens: list[torch.Tensor], features: list[torch.Tensor]) -> None:
        self.drafter.commit(requests, tokens, features)  # the drafter's context stays whole whoever drafted

    def release(self, request, moved_from: int | None = None) -> None:
        self.drafter.release(request, moved_from)
