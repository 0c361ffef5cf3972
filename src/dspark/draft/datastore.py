"""Retrieval drafts (REST, He et al. 2023): where the context's last n tokens occur in a datastore of the target's
own answers, draft the continuation most of those occurrences share. No forward at all, like prompt lookup, but
over text the target wrote for other prompts: the phrases a small model repeats from answer to answer.

The bundled drafter's datastore (`datastore.npz`) holds the target's answers to training prompts, no evaluation
prompt among them: the answers the drafter was trained on, and two more draws of answers to every code prompt of the
pool (`dspark regenerate --mix code=1`, seeds 1 and 2; drafters/training_answers.py builds it), about 1.49 M tokens
in all (benchmarks/results/drafters.md has lookup+dspark by prompt set). Every answer position is one entry, keyed
by the `max_ngram` tokens before it read backwards; the entries sorted by that key, the occurrences of the context's
last n tokens are one run of entries, found by narrowing the run one token at a time (binary searches on sorted key
columns, no hash table). The draft follows the most common next token among the run's entries (at most `sample` of
them, spread over the run), keeps the entries that agree, and goes on until the continuations end. Where fewer than
`agree` of the run's entries share the first token, or the match is shorter than `min_ngram`, it drafts nothing
(another source drafts there).
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np



class Datastore:
    def __init__(self, tokens: np.ndarray, lengths: np.ndarray, gamma: int = 7, max_ngram: int = 8,
                 min_ngram: int = 2, agree: float = 0.5, sample: int = 512):
        tokens, lengths = np.asarray(tokens, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        if lengths.sum() != len(tokens) or (lengths < 0).any():
            raise ValueError(f"datastore lengths sum to {lengths.sum()}, not its {len(tokens)} tokens")
        if gamma < 1 or not 1 <= min_ngram <= max_ngram or not 0 < agree <= 1:
            raise ValueError("a datastore needs gamma >= 1, 1 <= min_ngram <= max_ngram and 0 < agree <= 1")
        self.gamma, self.max_ngram, self.min_ngram, self.agree, self.sample = gamma, max_ngram, min_ngram, agree, sample
        # key columns in 16 bits where the vocabulary allows; self.end (before an answer's start, after its end)
        # matches no token
        self.dtype = np.uint16 if tokens.max(initial=0) < np.iinfo(np.uint16).max else np.int32
        self.end = np.iinfo(self.dtype).max
        ends = np.repeat(np.cumsum(lengths), lengths)
        starts = ends - np.repeat(lengths, lengths)
        at = np.arange(len(tokens))
        at = at[at > starts]  # an entry needs at least one token before it

        def column(offset: int) -> np.ndarray:  # the token at `offset` from each entry, end outside its answer
            where = at + offset
            inside = (where >= starts[at]) & (where < ends[at])
            return np.where(inside, tokens[np.clip(where, 0, len(tokens) - 1)], self.end).astype(self.dtype)

        before = [column(-1 - d) for d in range(max_ngram)]  # before[d]: the token d + 1 places before the entry
        order = np.lexsort(before[::-1])  # sorted by before[0], then before[1], ...
        self.before = [c[order] for c in before]
        self.after = [column(d)[order] for d in range(gamma)]  # after[d]: the token d places after

    @classmethod
    @functools.lru_cache(maxsize=4)  # engines on one target (LLM.sibling) share it
    def load(cls, path: str | Path, gamma: int = 7) -> "Datastore":
        with np.load(path) as f:
            return cls(f["tokens"], f["lengths"], gamma)

    def __len__(self) -> int:
        return len(self.after[0])

    def match(self, context: list[int]) -> tuple[int, int, int]:
        """The run [lo, hi) of entries whose preceding tokens are the context's last n, n as long as found."""
        lo, hi, n = 0, len(self), 0
        for d in range(min(self.max_ngram, len(context))):
            if not 0 <= context[-1 - d] < self.end:
                break
            column, token = self.before[d][lo:hi], self.dtype(context[-1 - d])
            a, b = np.searchsorted(column, token, "left"), np.searchsorted(column, token, "right")
            if a == b:
                break
            lo, hi, n = lo + a, lo + b, d + 1
        return lo, hi, n

    def lookup(self, context: list[int]) -> list[int]:
        lo, hi, n = self.match(context)
        if n < self.min_ngram:
            return []
        rows = np.arange(lo, hi) if hi - lo <= self.sample else np.linspace(lo, hi - 1, self.sample).astype(np.int64)
        draft: list[int] = []
        for d in range(self.gamma):
            nexts = self.after[d][rows]
            values, counts = np.unique(nexts, return_counts=True)
            best = int(counts.argmax())
            if values[best] == self.end or (d == 0 and counts[best] < self.agree * len(rows)):
                break
            draft.append(int(values[best]))
            rows = rows[nexts == values[best]]
        return draft
