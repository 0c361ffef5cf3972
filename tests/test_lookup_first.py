"""Prompt lookup first, a trained drafter elsewhere (draft/lookup_first.py): one-hot q rows verify exactly as point
masses, a step mixes the two sources row by row, the drafter is not called where every request found a match,
and greedy output with the bundled DSpark drafter behind lookup equals plain greedy (fp32)."""
from __future__ import annotations

import torch

from dspark import SamplingParams
from dspark.draft import Drafter, Proposal, make_drafter
from dspark.draft.lookup_first import LookupFirstDrafter
from dspark.draft.prompt_lookup import PromptLookupDrafter
from dspark.engine.request import Request
from dspark.verify import rejection_sample

V, G = 11, 4


def test_one_hot_q_rows_verify_exactly_as_point_masses():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        R = 5
        lengths = torch.randint(0, G + 1, (R,), generator=gen)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), (lengths + 1).cumsum(0)[:-1]])
        p = (3 * torch.randn(int((lengths + 1).sum()), V, generator=gen)).softmax(-1)
        drafts = torch.randint(0, V, (R, G), generator=gen)
        u, u_next = torch.rand(R, G, generator=gen), torch.rand(R, generator=gen)
        one_hot = torch.nn.functional.one_hot(drafts, V).float()
        a = rejection_sample(p, starts, drafts, None, lengths, u, u_next)
        b = rejection_sample(p, starts, drafts, one_hot, lengths, u, u_next)
        assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_token, b.next_token)


class DenseDrafter(Drafter):
    """Drafts token 7 everywhere with a random dense q; counts its calls."""

    gamma = G

    def __init__(self):
        self.calls = 0

    def propose(self, requests, limit=None):
        self.calls += 1
        R = len(requests)
        q = torch.rand(R, G, V).softmax(-1)
        return Proposal(torch.full((R, G), 7), q, torch.full((R,), G), torch.rand(R, G))


def request(ids: list[int]) -> Request:
    return Request(ids, SamplingParams())


def test_a_step_mixes_lookup_and_drafter_rows():
    inner = DenseDrafter()
    drafter = LookupFirstDrafter(inner, [PromptLookupDrafter(3)])  # lookup drafts of 3, narrower than the drafter's G
    repeats, fresh = request([1, 2, 3, 1, 2]), request([1, 2, 3, 4, 5])  # "1 2" came before, followed by 3 1 2
    mixed = drafter.propose([repeats, fresh])
    assert inner.calls == 1 and mixed.confidence is None
    assert mixed.lengths.tolist() == [3, G] and mixed.tokens[0, :3].tolist() == [3, 1, 2]
    assert mixed.tokens[1].tolist() == [7] * G
    assert torch.equal(mixed.q[0, :3], torch.nn.functional.one_hot(torch.tensor([3, 1, 2]), V).float())
    assert mixed.q[0, 3:].abs().sum() == 0 and torch.allclose(mixed.q[1].sum(-1), torch.ones(G))
    only_lookup = drafter.propose([repeats, request([5, 6, 5])])
    assert inner.calls == 1 and only_lookup.q is None and only_lookup.lengths.tolist() == [3, 3]  # 6 5, then 6 again


def test_a_long_repeat_drafts_more_and_widens_a_mixed_step():
    inner = DenseDrafter()
    drafter = LookupFirstDrafter(inner, [PromptLookupDrafter(2 * G, max_ngram=12, min_ngram=10), PromptLookupDrafter(G)])
    assert drafter.gamma == 2 * G
    repeat = list(range(1, V)) + [1, 2]
    long, fresh = request(repeat + [0] + repeat), request([1, 2, 3, 4, 5])  # the last 12 tokens occurred before
    mixed = drafter.propose([long, fresh])
    assert mixed.tokens.shape[1] == 2 * G and mixed.lengths.tolist() == [2 * G, G]
    assert mixed.tokens[0].tolist() == [0] + repeat[:2 * G - 1]
    assert torch.equal(mixed.q[0], torch.nn.functional.one_hot(mixed.tokens[0], V).float())
    assert torch.allclose(mixed.q[1, :G].sum(-1), torch.ones(G)) and mixed.q[1, G:].abs().sum() == 0
    short = drafter.propose([request([5, 6, 7, 8, 9, 10, 5])])  # a 1-gram match: G drafts at most
    assert short.tokens.shape[1] == 2 * G and short.lengths.tolist() == [G] and inner.calls == 1


def test_lookup_first_greedy_equals_plain(make_llm, greedy, chat_ids, solo_greedy):
    llm = make_llm("lookup+default", max_num_seqs=4)
    drafter = llm.engine.drafter
    assert isinstance(drafter, LookupFirstDrafter)
    sources = []  # per step: (rows drafted by lookup, rows by the drafter)
    propose = drafter.propose

    def spy(requests, limit=None):
        found = [bool(drafter.lookup(r.all_token_ids)) for r in requests]
        sources.append((sum(found), len(found) - sum(found)))
        return propose(requests, limit)

    drafter.propose = spy
    outs = llm.generate(chat_ids, greedy)
    assert [o.token_ids for o in outs] == solo_greedy
    assert sum(o.drafts_accepted for o in outs) > 0
    assert any(a and b for a, b in sources)  # steps that mixed both sources in one verify
    assert any(a == 0 for a, _ in sources) and any(b == 0 for _, b in sources)


def test_lookup_plus_spec_builds_the_named_drafter(base_llm_fp32):
    d = make_drafter("lookup+default", 7, base_llm_fp32.engine.target)
    assert isinstance(d, LookupFirstDrafter) and d.target_layer_ids == d.drafter.target_layer_ids
    assert (d.drafter_gamma, d.gamma) == (7, 14)  # a long repeat drafts up to 2 gamma
    assert base_llm_fp32.sibling("lookup+default").engine.scheduler.gamma == 14  # fixed length lets it through
    assert make_drafter("lookup+default", 4, base_llm_fp32.engine.target).drafter_gamma == 4


def test_auto_puts_lookup_first_for_one_stream_only(base_llm_fp32):
    from test_trained_drafters import COST

    from dspark.draft.dspark import DSparkDrafter
    from dspark.schedule import AsyncBudgetScheduler, FixedLength

    one = base_llm_fp32.sibling("auto", "auto", max_num_seqs=1).engine  # `dspark generate`
    assert isinstance(one.drafter, LookupFirstDrafter) and isinstance(one.drafter.drafter, DSparkDrafter)
    assert isinstance(one.scheduler, FixedLength)
    for config in ({"max_num_seqs": 4}, {"max_num_seqs": 1, "scheduler": "async"}):  # batches; async asked for
        engine = base_llm_fp32.sibling("auto", **{"scheduler": "auto"} | config, cost_table=COST).engine
        assert isinstance(engine.drafter, DSparkDrafter) and isinstance(engine.scheduler, AsyncBudgetScheduler)
