"""Retrieval drafts from a datastore of answers (draft/datastore.py): the longest match of the context's last
tokens, the majority continuation followed token by token, never across an answer's ends; equal to a brute-force
search over random corpora; lookup+default puts it between prompt lookup's 2-gram and 1-gram matches."""
from __future__ import annotations

import collections
import random

import numpy as np
import pytest

from dspark.draft.datastore import Datastore
from dspark.draft.lookup_first import LookupFirstDrafter
from dspark.draft.prompt_lookup import PromptLookupDrafter

ANSWERS = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [8, 2, 3, 9, 9], [7, 2, 3, 4, 5]]


def store(answers, **kwargs) -> Datastore:
    return Datastore(np.array([t for a in answers for t in a]), np.array([len(a) for a in answers]), **kwargs)


def test_majority_continuation_of_the_longest_match():
    ds = store(ANSWERS)
    assert ds.lookup([0, 2, 3]) == [4, 5]  # "2 3" in all four: 4 three times, then 5 twice against 6 once
    assert ds.lookup([7, 2, 3]) == [4, 5]  # "7 2 3" only in the last answer
    assert ds.lookup([8, 2, 3]) == [9, 9]  # the longer match wins over the majority of the shorter one
    assert ds.lookup([4, 6]) == []  # an answer's last token: nothing follows it
    assert ds.lookup([0, 3]) == []  # a 1-token match, under min_ngram 2
    assert store(ANSWERS, min_ngram=1).lookup([0, 3]) == [4, 5]
    assert store(ANSWERS, agree=0.8).lookup([0, 2, 3]) == []  # 3 of 4 share the first token: under 0.8
    assert store(ANSWERS, gamma=1).lookup([0, 2, 3]) == [4]
    assert ds.lookup([5, 1, 2]) == [3, 4, 5]  # matches never reach across an answer's start
    assert ds.lookup([70000, 2, 3]) == [4, 5]  # a token outside the 16-bit key columns matches nothing


def brute_force(answers, context, gamma, max_ngram, min_ngram, agree):
    for n in range(min(max_ngram, len(context)), min_ngram - 1, -1):
        tail = context[-n:]
        follow = [a[i:] for a in answers for i in range(n, len(a)) if a[i - n:i] == tail]  # followed by a token
        if not follow:
            continue
        draft = []
        for d in range(gamma):
            counts = collections.Counter(f[d] for f in follow if len(f) > d)
            if not counts:
                break
            token, count = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))  # ties: the smallest token
            if len(follow) - sum(counts.values()) > count or (d == 0 and count < agree * len(follow)):
                break  # more continuations end here than go on with the majority token
            draft.append(token)
            follow = [f for f in follow if len(f) > d and f[d] == token]
        return draft
    return []


@pytest.mark.parametrize("seed", range(4))
def test_equals_brute_force_search(seed):
    rng = random.Random(seed)
    answers = [[rng.randrange(6) for _ in range(rng.randrange(1, 30))] for _ in range(40)]
    ds = store(answers, gamma=5, max_ngram=4, sample=10_000)
    for _ in range(300):
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 8))]
        assert ds.lookup(context) == brute_force(answers, context, 5, 4, 2, 0.5), context


def test_refuses_inconsistent_input():
    with pytest.raises(ValueError, match="sum to"):
        Datastore(np.arange(5), np.array([2, 2]))
    with pytest.raises(ValueError, match="min_ngram"):
        store(ANSWERS, min_ngram=3, max_ngram=2)


def test_lookup_default_puts_the_datastore_between_prompt_lookups(base_llm_fp32):
    from dspark.draft import make_drafter

    d = make_drafter("lookup+default", 7, base_llm_fp32.engine.target)
    assert isinstance(d, LookupFirstDrafter)
    long, first, ds, last = d.sources
    assert (long.min_ngram, long.gamma, first.min_ngram, last.max_ngram) == (10, 14, 2, 1)
    assert isinstance(ds, Datastore) and len(ds) > 500_000 and isinstance(last, PromptLookupDrafter)
    assert make_drafter("lookup+default", 7, base_llm_fp32.engine.target).sources[2] is ds  # loaded once


def test_chain_takes_the_first_source_that_finds_a_draft():
    class Fixed:
        gamma = 6

        def __init__(self, draft):
            self.draft, self.calls = draft, 0

        def lookup(self, context):
            self.calls += 1
            return self.draft

    empty, found, never = Fixed([]), Fixed([4, 5, 6, 7, 8, 9, 10]), Fixed([1])
    chain = LookupFirstDrafter(type("D", (), {"gamma": 4, "target_layer_ids": ()})(), [empty, found, never])
    assert chain.gamma == 6 and chain.lookup([1, 2]) == [4, 5, 6, 7, 8, 9]  # cut to the widest source's gamma
    assert (empty.calls, found.calls, never.calls) == (1, 1, 0)


def test_prompt_lookup_equals_a_slice_by_slice_search():
    """prompt_lookup.py searches the context's bytes (4 per token): the same drafts as comparing list slices,
    whatever the tokens' bytes (ids past 2^16 too), the n-gram range and gamma; a match near the context's end is
    continued as a copy that reads its own output (the text repeating with its period)."""

    def slices(pl, context):
        for n in range(min(pl.max_ngram, len(context) - 1), pl.min_ngram - 1, -1):
            for start in range(len(context) - n - 1, -1, -1):
                if context[start:start + n] == context[-n:]:
                    text = list(context)
                    for i in range(pl.gamma):  # copy token by token, past the context into the copy itself
                        text.append(text[start + n + i])
                    return text[len(context):]
        return []

    rng = random.Random(0)
    for _ in range(3000):
        low, high = sorted([rng.randrange(1, 6), rng.randrange(1, 6)])
        pl = PromptLookupDrafter(rng.randrange(1, 9), max_ngram=high, min_ngram=low)
        vocab = rng.choice([2, 3, 300, 70_000, 2**24 + 3])
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        assert pl.lookup(context) == slices(pl, context), (context, pl.__dict__)


def test_prompt_lookup_continues_a_loop():
    """A context looping on one token or a few: the latest match of its tail ends one period before the end, and
    the draft repeats the loop gamma times (not just the period's tokens that follow the match)."""
    pl = PromptLookupDrafter(6, max_ngram=3)
    assert pl.lookup([5, 9, 9, 9, 9]) == [9] * 6
    assert pl.lookup([5, 1, 2, 3, 1, 2, 3, 1, 2]) == [3, 1, 2, 3, 1, 2]
    assert pl.lookup([1, 2, 3, 4, 1, 2]) == [3, 4, 1, 2, 3, 4]  # "1 2" seen once, then "3 4": the same rule
    assert pl.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9, 1]) == [2, 3, 4, 5, 6, 7]  # room enough: a plain copy
    assert PromptLookupDrafter(14, max_ngram=12, min_ngram=10).lookup([7] * 12) == [7] * 14
