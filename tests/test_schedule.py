"""Confidence-scheduled verification (docs/method.md §4–5): Appendix A's counterexample as a statistical test,
properties of Algorithm 1 and the asynchronous scheduler (hypothesis), and the engine's losslessness with every
scheduler. The cost table and its profiling: test_cost_table.py.

Sections: Appendix A | properties | engine.
"""
from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stats_utils import g_test
from tiny_models import BLOCK, one_thread, tiny_drafter, tiny_target, tiny_target_dir

from dspark import LLM, SamplingParams
from dspark.proposal import Proposal
from dspark.draft.dspark import DSparkDrafter
from dspark.schedule import (AsyncBudgetScheduler, CostTable, FixedLength, PrefixScheduler, Scheduler,
                             ThresholdScheduler, make_scheduler)
from dspark.schedule.async_budget import budget_search, global_budget
from dspark.schedule.prefix import algorithm1
from dspark.schedule.survival import expected_tau, prefix_survival, ranked_candidates, top_k_lengths
from dspark.verify import rejection_sample

__all__ = ["one_thread", "tiny_target", "tiny_target_dir"]

# ---- Appendix A -------------------------------------------------------------------------------------
APPENDIX_A = CostTable.from_sps({1: 1.0, 2: 0.5, 3: 0.45})
P_TARGET, Q_DRAFT = torch.tensor([0.7, 0.3]), torch.tensor([0.5, 0.5])  # two tokens: A = 0, B = 1


class SearchWithoutEarlyStop(Scheduler):
    """The biased variant: Algorithm 1's ranking, but it takes the best Θ over all candidates."""

    def __init__(self, cost: CostTable):
        self.cost = cost

    def plan(self, proposal: Proposal) -> torch.Tensor:
        a = prefix_survival(proposal.confidence, proposal.lengths)
        R = a.shape[0]
        lengths, best, best_lengths, B, tau = [0] * R, R * self.cost.sps(R, R), [0] * R, R, float(R)
        for r, j, s in zip(*(x.tolist() for x in ranked_candidates(a))):
            lengths[r], B, tau = j, B + 1, tau + s
            if tau * self.cost.sps(B, R) > best:
                best, best_lengths = tau * self.cost.sps(B, R), list(lengths)
        return torch.tensor(best_lengths)


def first_tokens(scheduler: Scheduler, n: int, seed: int) -> np.ndarray:
    """Counts of A and B as the first emitted token over n cycles: drafts x1, x2 ~ q, c1 = 0.8, and c2
    reads x1 (1.0 after A, 0.01 after B), the rule that lets a search past the stop verify A and drop B."""
    g = torch.Generator().manual_seed(seed)
    q = Q_DRAFT.expand(1, 2, 2)
    p = P_TARGET.expand(3, 2)
    counts = np.zeros(2, dtype=np.int64)
    for _ in range(n):
        drafts = torch.multinomial(Q_DRAFT, 2, replacement=True, generator=g)[None]
        c2 = 1.0 if int(drafts[0, 0]) == 0 else 0.01
        proposal = Proposal(drafts, q, torch.tensor([2]), torch.tensor([[0.8, c2]]))
        lengths = scheduler.plan(proposal).long()
        u = torch.rand(1, 3, generator=g)
        verdict = rejection_sample(p[:1 + int(lengths[0])], torch.tensor([0]), drafts, q, lengths, u[:, :2], u[:, 2])
        first = int(drafts[0, 0]) if int(verdict.num_accepted[0]) > 0 else int(verdict.next_token[0])
        counts[first] += 1
    return counts


N_APPENDIX = 20_000


def test_appendix_a_search_without_early_stop_is_biased():
    counts = first_tokens(SearchWithoutEarlyStop(APPENDIX_A), N_APPENDIX, seed=1)
    assert abs(counts[0] / N_APPENDIX - 0.85) < 0.01  # P(A) = 0.5 + 0.5 * 0.7
    assert g_test(counts, P_TARGET.numpy()) < 1e-6


@pytest.mark.parametrize("make", [PrefixScheduler, AsyncBudgetScheduler], ids=["algorithm1", "async"])
def test_appendix_a_confidence_schedulers_keep_the_target_distribution(make):
    scheduler = make(APPENDIX_A)
    counts = first_tokens(scheduler, N_APPENDIX, seed=2)
    assert g_test(counts, P_TARGET.numpy()) > 1e-3, counts / N_APPENDIX


def test_appendix_a_numbers():
    """Θ_0 = 1.0 > Θ_1 = 0.9: Algorithm 1 stops at once; the async budget follows step N−2's drafts."""
    a = prefix_survival(torch.tensor([[0.8, 1.0]]), torch.tensor([2]))
    assert algorithm1(a, APPENDIX_A) == (torch.tensor([0]), 1) or algorithm1(a, APPENDIX_A)[0].tolist() == [0]
    assert algorithm1(a, APPENDIX_A)[1] == 1  # it read one candidate and stopped
    assert global_budget(a, 1, 2, APPENDIX_A) == 2  # Θ_2 = 2.6 * 0.45 = 1.17 beats 1.0
    low = prefix_survival(torch.tensor([[0.8, 0.01]]), torch.tensor([2]))
    assert global_budget(low, 1, 2, APPENDIX_A) == 0


# ---- properties -------------------------------------------------------------------------------------
def confidences(max_r: int = 5, max_g: int = 5):
    return st.integers(1, max_r).flatmap(lambda R: st.integers(1, max_g).flatmap(lambda G: st.tuples(
        st.lists(st.lists(st.sampled_from([0.0, 0.05, 0.3, 0.5, 0.8, 0.95, 1.0]) | st.floats(0.0, 1.0),
                          min_size=G, max_size=G), min_size=R, max_size=R),
        st.lists(st.integers(0, G), min_size=R, max_size=R))))


def tables():
    """Cost tables with a per-token slope, a fixed cost and random staircase jumps."""
    return st.tuples(st.floats(0.1, 5.0), st.floats(0.001, 0.5), st.lists(st.floats(0, 2.0), min_size=40, max_size=40)).map(
        lambda x: CostTable(list(range(1, 41)), [x[0] + x[1] * b + sum(x[2][:b]) * (b % 8 == 0) for b in range(1, 41)]))


def as_tensors(c, lengths):
    return torch.tensor(c, dtype=torch.float64), torch.tensor(lengths)


def best_tau_of_size(a: torch.Tensor, k: int) -> float:
    """Brute force: the largest Σ a over prefix-closed sets of k drafts."""
    R, G = a.shape
    limits = [int((a[r] > 0).sum()) for r in range(R)]
    best = -1.0
    for ls in itertools.product(*(range(m + 1) for m in limits)):
        if sum(ls) == k:
            best = max(best, sum(float(a[r, :l].sum()) for r, l in enumerate(ls)))
    return best


@settings(max_examples=200, deadline=None)
@given(confidences(4, 4), st.integers(0, 16))
def test_top_k_is_a_set_of_prefixes_maximising_tau(data, k):
    c, lengths = as_tensors(*data)
    a = prefix_survival(c, lengths)
    available = int((a > 0).sum())
    chosen = top_k_lengths(a, k)
    assert int(chosen.sum()) == min(k, available)  # the budget, exactly, while drafts last
    assert bool((chosen <= lengths).all())
    assert bool(((a > 0).sum(-1) >= chosen).all())  # only candidates of positive survival
    got = expected_tau(a, chosen) - a.shape[0]
    assert got >= best_tau_of_size(a, min(k, available)) - 1e-12


@settings(max_examples=200, deadline=None)
@given(confidences(), tables())
def test_algorithm1_chooses_prefixes_and_never_looks_past_its_stop(data, cost):
    c, lengths = as_tensors(*data)
    a = prefix_survival(c, lengths)
    chosen, read = algorithm1(a, cost)
    assert bool((chosen >= 0).all()) and bool((chosen <= lengths).all())
    r, j, s = ranked_candidates(a)
    # what it chose is exactly the first (read - 1) or read candidates of the ranking: a prefix per request
    taken = int(chosen.sum())
    assert taken in (read - 1, read) or (read == 0 and taken == 0)
    assert torch.equal(torch.bincount(r[:taken], minlength=a.shape[0]), chosen)
    # candidates ranked after the stop: lowering them (the ranking before the stop unchanged) changes nothing
    if read < len(r):
        lowered = a.clone()
        for rr, jj in zip(r[read:].tolist(), j[read:].tolist()):
            lowered[rr, jj - 1] = lowered[rr, jj - 1] * 0.5
        lowered = torch.minimum(lowered, lowered.cummin(-1).values)  # survival stays non-increasing
        assert torch.equal(algorithm1(lowered, cost)[0], chosen)
    # and Θ of the choice is no worse than plain decoding
    R = a.shape[0]
    assert expected_tau(a, chosen) * cost.sps(R + taken, R) >= R * cost.sps(R, R) - 1e-12


@settings(max_examples=200, deadline=None)
@given(confidences(), confidences(), tables())
def test_async_budget_is_respected_and_allocated_by_survival(old, now, cost):
    scheduler = AsyncBudgetScheduler(cost)
    for c, lengths in (old, old, now):  # the third plan reads the first one's confidences
        proposal = Proposal(torch.zeros(len(c), len(c[0]), dtype=torch.long), None, torch.tensor(lengths),
                            torch.tensor(c, dtype=torch.float64))
        chosen = scheduler.plan(proposal)
    c, lengths = as_tensors(*now)
    a = prefix_survival(c, lengths)
    slots = int(lengths.sum())
    assert 0 <= scheduler.budget <= slots
    assert int(chosen.sum()) == min(scheduler.budget, int((a > 0).sum()))
    assert torch.equal(chosen, top_k_lengths(a, scheduler.budget))
    # the budget depends on the old confidences only
    a_old = prefix_survival(*as_tensors(*old))
    assert scheduler.budget == global_budget(a_old, len(c), slots, cost)


@settings(max_examples=100, deadline=None)
@given(confidences(), st.floats(0.01, 0.99))
def test_threshold_chooses_prefixes_above_it(data, threshold):
    c, lengths = as_tensors(*data)
    proposal = Proposal(torch.zeros(c.shape, dtype=torch.long), None, lengths, c)
    chosen = ThresholdScheduler(threshold).plan(proposal)
    a = prefix_survival(c, lengths)
    for r, l in enumerate(chosen.tolist()):
        assert bool((a[r, :l] >= threshold).all()) and (l == a.shape[1] or float(a[r, l]) < threshold)


@pytest.mark.parametrize("drafter_seconds, expected", [
    # the drafter never pays: skipped, probed after 3 skips, then after 6 (each fruitless probe doubles the wait)
    (0.5, [False, False] + [True] * 3 + [False] + [True] * 6 + [False, True]),
    (0.01, [False] * 14),  # a cheap drafter: drafting pays at every step
])
def test_async_skips_the_drafter_only_where_no_budget_pays_for_it(drafter_seconds, expected):
    cost = CostTable([1, 2, 4, 8], [1.0, 1.0, 1.1, 1.2], [1], [drafter_seconds])
    scheduler = AsyncBudgetScheduler(cost, probe_every=3)
    proposal = Proposal(torch.zeros(1, 4, dtype=torch.long), None, torch.tensor([4]), torch.full((1, 4), 0.3))
    decisions = []
    for _ in expected:
        decisions.append(scheduler.draft_limit(1, 4) == 0)
        scheduler.plan(Proposal.empty(1) if decisions[-1] else proposal)  # as the engine plans every step
    assert decisions == expected
    # the rule: plain decoding (no drafter call) against the best budget with the call
    a = prefix_survival(proposal.confidence, proposal.lengths)
    best = max((1 + float(a[0, :k].sum())) / cost.step_time(1 + k, 1) for k in range(5))
    assert (best <= 1 / cost.step_time(1, 1, drafted=False)) == expected[2]
    cost.draft_seconds = [0.01]  # drafting pays again: the next step drafts and probing starts over from 3
    assert scheduler.draft_limit(1, 4) != 0 and scheduler.wait == 3
    assert FixedLength(3).draft_limit(2, 6) == 3 and FixedLength(0).draft_limit(2, 6) == 0


def test_async_probes_soon_after_new_requests_arrive():
    from dspark.engine.stats import StepStats

    cost = CostTable([1, 2, 4, 8], [1.0, 1.0, 1.1, 1.2], [1], [0.5], correction_rate=0.0)  # never pays
    scheduler = AsyncBudgetScheduler(cost, probe_every=3)
    low = Proposal(torch.zeros(1, 4, dtype=torch.long), None, torch.tensor([4]), torch.full((1, 4), 0.3))
    limits = []
    for step in range(10):
        limits.append(scheduler.draft_limit(1, 4))
        scheduler.plan(Proposal.empty(1) if limits[-1] == 0 else low)
        scheduler.observe(StepStats(num_requests=1, verify_tokens=1, drafted=[0], t_total=1.0, draft_skipped=True,
                                    prefill_tokens=5 * (step == 6), admitted=int(step == 6)))  # it arrives at step 6
    # the fruitless probe at step 5 doubled the wait to 6; the arrival resets it to 3, so after three steps short
    # of the whole block (6, 7, 8) step 9 probes
    assert limits == [None, None, 0, 0, 0, None, 0, 0, 0, None]
    scheduler.wait = 12  # one request joining three running ones: the pause stands
    scheduler.observe(StepStats(num_requests=4, verify_tokens=4, drafted=[0] * 4, t_total=1.0, admitted=1))
    assert scheduler.wait == 12


def test_async_reads_a_probe_two_steps_after_it_though_the_steps_between_skip():
    cost = CostTable([1, 2, 4, 8], [1.0, 1.0, 1.1, 1.2], [1], [0.3])
    scheduler = AsyncBudgetScheduler(cost, probe_every=3)
    limits = []
    for step in range(10):
        limits.append(scheduler.draft_limit(1, 4))
        c = 0.05 if step < 5 else 0.9  # the drafter turns good at step 5, a probe
        scheduler.plan(Proposal.empty(1) if limits[-1] == 0 else
                       Proposal(torch.zeros(1, 4, dtype=torch.long), None, torch.tensor([4]), torch.full((1, 4), c)))
    # step 6 still reads step 1 (skips count as steps), step 7 reads the probe and drafts the whole block
    assert limits == [None, None, 0, 0, 0, None, 0, None, None, None]


def test_budget_search_costs_the_drafter_at_the_depth_it_needs():
    old = torch.tensor([[0.9, 0.8], [0.3, 0.1]], dtype=torch.float64)  # ranked 0.9 (r0 j1), 0.8 (j2), 0.3, 0.1
    deep = CostTable([1, 2, 4, 8], [1.0, 1.0, 1.0, 1.0], [1, 2], [1.2, 1.2], [0.0, 0.0], draft_depth=2)
    # drafting one position costs nothing, two cost 1.2: Θ_1 = 2.9 / 1 beats Θ_2 = 3.7 / 2.2 and plain 2 / 1
    assert budget_search(old, 2, 4, deep) == (1, 1, pytest.approx(2.9))
    assert budget_search(old, 2, 4, deep, sunk=True)[0] == 4  # the block is paid for: verify it all
    flat = CostTable([1, 2, 4, 8], [1.0, 1.0, 1.0, 1.0], [1, 2], [1.2, 1.2])  # no depth costs: every call 1.2
    assert budget_search(old, 2, 4, flat) == (0, 0, pytest.approx(2.0))  # at best 4.1 / 2.2 < 2: plain decoding
    assert deep.draft_time(2, 0) == 0.0 and flat.draft_time(2, 1) == 1.2


def test_async_drafts_only_as_deep_as_its_budget_and_probes_the_whole_block():
    cost = CostTable([1, 2, 4, 8], [1.0, 1.0, 1.0, 1.0], [1], [1.0], [0.1], draft_depth=4)
    scheduler = AsyncBudgetScheduler(cost, probe_every=2)
    full = Proposal(torch.zeros(1, 4, dtype=torch.long), None, torch.tensor([4]),
                    torch.tensor([[0.9, 0.2, 0.2, 0.2]], dtype=torch.float64))
    limits = []
    for _ in range(8):
        limits.append(scheduler.draft_limit(1, 4))
        K = 4 if limits[-1] is None else limits[-1]
        shallow = Proposal(full.tokens[:, :K], None, torch.tensor([K]), full.confidence[:, :K])
        chosen = scheduler.plan(shallow)
        assert int(chosen.sum()) == min(scheduler.budget, K)
    # whole blocks until step N−2 exists, then one position (Θ_1 = 1.9 / 1.1 beats 2.08 / 1.4 and 1 / 1),
    # and the whole block again after `probe_every` shallow steps
    assert limits == [None, None, 1, 1, None, 1, 1, None]


def test_schedulers_without_confidences_verify_everything():
    proposal = Proposal(torch.zeros(2, 3, dtype=torch.long), None, torch.tensor([3, 1]))
    for s in (PrefixScheduler(APPENDIX_A), AsyncBudgetScheduler(APPENDIX_A), ThresholdScheduler(0.5)):
        assert s.plan(proposal).tolist() == [3, 1]


def test_make_scheduler_names_and_errors():
    assert isinstance(make_scheduler("fixed", 5), FixedLength) and make_scheduler("plain").gamma == 0
    assert isinstance(make_scheduler("algorithm1", cost=APPENDIX_A), PrefixScheduler)
    with pytest.raises(ValueError, match="cost table"):
        make_scheduler("async")
    with pytest.raises(ValueError, match="unknown scheduler"):
        make_scheduler("magic")
    with pytest.raises(ValueError, match="threshold"):
        make_scheduler("threshold", threshold=1.5)


# ---- engine -------------------------------------------------------------------------------------------
ENGINE_TABLE = CostTable(list(range(1, 65)), [0.02 + 0.002 * b for b in range(1, 65)])


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", ["plain", "threshold", "algorithm1", "async"])
def test_engine_is_lossless_under_greedy_with_every_scheduler(tiny_target, tiny_target_dir, name):
    prompts = [[5 + i, 9, 33, 100 + i, 7] * (i + 1) for i in range(3)]
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 9, 14)]
    plain = LLM(str(tiny_target_dir), dtype="fp32").generate(prompts, greedy)
    drafter = DSparkDrafter(tiny_drafter(tiny_target, "gated", seed=3))
    llm = LLM(str(tiny_target_dir), drafter=drafter, dtype="fp32", gamma=BLOCK, scheduler=name,
              cost_table=ENGINE_TABLE, threshold=0.3)
    outs = llm.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = list(llm.engine.stats)
    drafting = [s for s in stats if sum(s.drafted)]  # steps where some request could still verify a draft
    if name == "plain":  # nothing is drafted that could not be verified
        assert not drafting
        return
    assert drafting and all(s.expected_tau is not None and s.expected_tau >= s.num_requests for s in drafting)


@pytest.mark.usefixtures("one_thread")
def test_engine_is_lossless_when_the_async_scheduler_drafts_short_of_the_block(tiny_target, tiny_target_dir):
    prompts = [[5 + i, 9, 33, 100 + i, 7] * (i + 1) for i in range(3)]
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 19, 30)]
    plain = LLM(str(tiny_target_dir), dtype="fp32").generate(prompts, greedy)
    # one position per request costs almost nothing, the whole block more than a verify step
    shallow = CostTable([1, 64], [0.02, 0.02], [1, 4], [0.05, 0.05], [0.001, 0.001], draft_depth=BLOCK)
    drafter = DSparkDrafter(tiny_drafter(tiny_target, "gated", seed=3))
    llm = LLM(str(tiny_target_dir), drafter=drafter, dtype="fp32", gamma=BLOCK, scheduler="async", cost_table=shallow)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == [o.token_ids for o in plain]
    depths = [max(s.drafted) for s in llm.engine.stats if not s.draft_skipped]
    # one position on most steps; the first two steps (no step N−2 yet) and the probes draft the whole block
    assert sum(d == 1 for d in depths) > len(depths) / 2 and depths[:2] == [BLOCK] * 2 and BLOCK in depths[2:]


@pytest.mark.usefixtures("one_thread")
def test_engine_skipping_the_drafter_stays_lossless(tiny_target, tiny_target_dir):
    """A table where no budget pays for the drafter: the async scheduler skips it, probing after 2 skips, then 4, ..."""
    prompts = [[5 + i, 9, 33, 100 + i, 7] * (i + 1) for i in range(3)]
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 9, 14)]
    plain = LLM(str(tiny_target_dir), dtype="fp32").generate(prompts, greedy)
    costly = CostTable(list(range(1, 65)), [0.02 * b for b in range(1, 65)], [1, 64], [0.02, 0.02])
    drafter = DSparkDrafter(tiny_drafter(tiny_target, "gated", seed=3))
    llm = LLM(str(tiny_target_dir), drafter=drafter, dtype="fp32", gamma=BLOCK,
              scheduler=AsyncBudgetScheduler(costly, probe_every=2))
    outs = llm.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = list(llm.engine.stats)
    skipped = [s for s in stats if s.draft_skipped]
    assert skipped and len(skipped) < len(stats)
    assert all(not sum(s.drafted) and s.verify_tokens == s.num_requests for s in skipped)
    assert all(s.expected_tau == s.num_requests for s in skipped)  # predictions cover every step, as τ does


def test_without_a_cached_profile_a_server_starts_from_the_provisional_table(base_llm_fp32, monkeypatch, tmp_path,
                                                                            capsys, chat_ids):
    """`dspark serve` does not profile before opening its port (unless --profile): with no profile cached the cost
    table is the provisional one, said on stderr, and measured steps start correcting it at once."""
    import copy

    from dspark.cli import build_parser
    from dspark.engine import profile

    assert build_parser().parse_args(["serve"]).profile is False
    monkeypatch.setattr(profile, "cache_root", lambda: tmp_path)  # nothing cached
    unprofiled = copy.copy(base_llm_fp32)
    unprofiled.profile = False
    start = time.perf_counter()
    llm = unprofiled.sibling("default", "async")
    assert time.perf_counter() - start < 30
    table = llm.engine.scheduler.cost
    assert table.meta == {"provisional": True} and "provisional cost table" in capsys.readouterr().err
    llm.generate(chat_ids[:2], SamplingParams(temperature=0, max_tokens=8))
    assert any(c != 1.0 for c in table.correction), "measured steps should correct the table"
    assert not list(tmp_path.iterdir()), "nothing profiled, nothing written"
