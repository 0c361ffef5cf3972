"""Sampling: `warp` (temperature, top-k, top-p, greedy) against transformers' warpers and hand-computed
values, `sample` (inverse CDF, never a zero-probability token), and seeded generation."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from dspark import SamplingParams
from dspark.sampling import warp, sample


def settings_tensors(rows: list[tuple[float, float, int]]):
    t, p, k = zip(*rows)
    return torch.tensor(t), torch.tensor(p), torch.tensor(k, dtype=torch.long)


# (temperature, top_p, top_k) per row; each row is warped with its own settings in one call
ROWS = [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.3, 1.0, 50), (1.0, 0.9, 0), (0.5, 0.8, 20), (2.0, 0.3, 0),
        (1.0, 0.95, 1000), (0.9, 1.0, 1), (1.0, 0.5, 3)]


def transformers_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    scores = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)[0]


def test_warp_matches_transformers_warpers():
    logits = 3 * torch.randn(len(ROWS), 2000, generator=torch.Generator().manual_seed(0))
    ours = warp(logits, *settings_tensors(ROWS))
    for row, setting in enumerate(ROWS):
        ref = transformers_probs(logits[row], *setting)
        assert torch.equal(ours[row] > 0, ref > 0), setting  # the same tokens survive
        torch.testing.assert_close(ours[row], ref, rtol=1e-5, atol=1e-7, msg=str(setting))


def test_warp_by_hand_with_ties():
    """probs .5 .2 .2 .1: ties at the cut are kept, for top-k and for top-p."""
    logits = torch.tensor([0.5, 0.2, 0.2, 0.1]).log().repeat(5, 1)
    rows = [(1.0, 1.0, 2), (1.0, 0.55, 0), (1.0, 0.45, 0), (0.5, 1.0, 0), (1.0, 1.0, 1)]
    probs = warp(logits, *settings_tensors(rows))
    top3 = torch.tensor([0.5, 0.2, 0.2, 0.0]) / 0.9
    sharpened = torch.tensor([0.25, 0.04, 0.04, 0.01]) / 0.34  # p^(1/T) with T = 0.5
    expected = torch.stack([top3, top3, torch.tensor([1.0, 0, 0, 0]), sharpened, torch.tensor([1.0, 0, 0, 0])])
    torch.testing.assert_close(probs, expected)


def test_greedy_rows_are_one_hot_whatever_the_other_settings():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    rows = [(0.0, 1.0, 0), (0.0, 0.1, 0), (0.0, 1.0, 5), (1.0, 1.0, 0)]
    probs = warp(logits, *settings_tensors(rows))
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), 300).float()
    assert torch.equal(probs[:3], one_hot[:3])
    torch.testing.assert_close(probs[3], logits[3].softmax(-1))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.just(0.0), st.floats(1e-30, 1e3)), min_size=1, max_size=12).filter(any),
       st.one_of(st.floats(0, 1, exclude_max=True), st.just(math.nextafter(1.0, 0.0)), st.just(0.0)))
def test_sample_never_returns_a_zero_probability_token(weights, u):
    probs = torch.tensor(weights, dtype=torch.float32)[None]  # unnormalised rows are allowed
    token = int(sample(probs, torch.tensor([u], dtype=torch.float32))[0])
    assert probs[0, token] > 0


def test_sample_is_the_inverse_cdf():
    """Evenly spaced uniforms hit each token in proportion to its probability (to one in n)."""
    probs = torch.tensor([0.1, 0.0, 0.35, 0.05, 0.0, 0.5])
    n = 10_000
    u = (torch.arange(n) + 0.5) / n
    counts = torch.bincount(sample(probs.expand(n, -1), u), minlength=len(probs))
    assert (counts / n - probs).abs().max() <= 1 / n


# ---- seeded generation -------------------------------------------------------------------------
@pytest.mark.parametrize("drafter", ["none", "prompt-lookup"])
def test_seeded_sampling_is_reproducible(make_llm, chat_ids, drafter):
    llm = make_llm(drafter=drafter)
    params = [SamplingParams(temperature=1.0, max_tokens=12, seed=s) for s in (11, 12)]
    first = llm.generate(chat_ids[:2], params)
    again = llm.generate(chat_ids[:2], params)
    alone = llm.generate(chat_ids[0], params[0])[0]  # a request's draws do not depend on its neighbours
    other_seed = llm.generate(chat_ids[0], SamplingParams(temperature=1.0, max_tokens=12, seed=13))[0]
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert alone.token_ids == first[0].token_ids
    assert other_seed.token_ids != first[0].token_ids


@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0], ids=["flat", "typical", "peaky"])
def test_windowed_top_p_top_k_equals_the_full_sort(spread):
    """The topk-window fast path cuts exactly where sorting the whole row cuts, for peaky rows (decided in
    the window), flat rows (the nucleus spills out of it: full sort) and top-k with ties at the k-th value
    beyond the window."""
    from dspark.sampling import _filter

    g = torch.Generator().manual_seed(int(spread * 10))
    V, n = 5000, 48
    logits = torch.randn(n, V, generator=g) * spread
    logits[:8] = logits[:8].round()  # many ties
    logits[8:12, :400] = 50.0  # the k-th value tied far past the window
    top_p = torch.rand(n, generator=g).clamp(min=0.05)
    top_p[::4] = 1.0
    top_k = torch.randint(0, 300, (n,), generator=g) * (torch.rand(n, generator=g) < 0.5)
    top_k[8:12] = torch.tensor([1, 5, 100, 0])
    top_p[::4] = torch.where(top_k[::4] == 0, 0.9, 1.0)
    # the window's top-k mass would miss most of a tie group at the k-th value and stop top-p too early
    logits[13, :10], logits[13, 10:410], top_k[13], top_p[13] = 52.0, 50.0, 100, 0.18
    fast, whole = _filter(logits, top_p, top_k, window=16), _filter(logits, top_p, top_k, window=V)
    assert torch.equal(fast.isfinite(), whole.isfinite())
    assert 0 < int(fast.isfinite().sum(-1).min()) and int(fast.isfinite().sum(-1).max()) < V


# ---- every accepted parameter is numerically safe ----------------------------------------------------
@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-8, 1e-3])
def test_tiny_temperatures_give_the_argmax_not_nan(temperature):
    """Dividing logits of ~30 by 1e-40 overflows float32; the row's max is subtracted first, so the
    probabilities stay finite and tend to the point mass on the argmax."""
    logits = torch.randn(4, 1000) * 10 + 30
    t, p, k = settings_tensors([(temperature, 1.0, 0), (temperature, 0.9, 0), (temperature, 1.0, 5),
                                (temperature, 0.5, 2**62)])
    probs = warp(logits, t, p, k)
    assert torch.isfinite(probs).all()
    assert torch.allclose(probs.sum(-1), torch.ones(4))
    if temperature < 1e-6:
        assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and (probs.max(-1).values == 1).all()
    drawn = sample(probs, torch.rand(4))
    assert (drawn < 1000).all()


@pytest.mark.parametrize("top_k", [2**31, 2**63, 10**30])
def test_huge_top_k_and_seed_are_no_cut_and_a_valid_seed(make_llm, chat_ids, top_k):
    llm = make_llm()
    big = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=4, seed=2**64 + 5)
    plain = SamplingParams(temperature=1.0, top_k=0, max_tokens=4, seed=5)  # same seed mod 2**64, no cut
    assert llm.generate(chat_ids[0], big)[0].token_ids == llm.generate(chat_ids[0], plain)[0].token_ids


def test_a_tiny_temperature_request_beside_others_runs_like_greedy(make_llm, chat_ids):
    llm = make_llm(drafter="prompt-lookup", max_num_seqs=4)
    tiny = [SamplingParams(temperature=1e-40, max_tokens=10, seed=i) for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=10)
    outs = llm.generate(chat_ids[:3], tiny)
    assert all(o.finish_reason == "length" for o in outs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(chat_ids[:3], greedy)]


def test_mend_cuts_a_draft_where_its_distribution_broke():
    from dspark.sampling import mend

    probs = torch.tensor([[float("nan"), 1.0], [0.25, 0.75]])
    choice = sample(probs, torch.tensor([0.5, 0.5]))
    assert choice.tolist() == [-1, 1]
    lengths = torch.tensor([4, 4])
    assert mend(choice, lengths, 2).tolist() == [0, 1] and lengths.tolist() == [2, 4]
