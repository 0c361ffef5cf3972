"""Speculative decoding is lossless: the joint distribution of the first emitted tokens equals the
target's (G-test, p > 0.001, fixed seeds).

Synthetic part: a small order-2 Markov target p and drafter q over V = 6 tokens drive `rejection_sample`
directly, tens of thousands of requests at once with ragged verify lengths 0..γ; q far from p (zero where p
is not and the other way round), q == p, point-mass drafts, a one-hot (greedy) target. The same check with
the residual step deliberately broken must fail, which shows it has power.

Real-model part (slow): the engine on the bundled SmolLM2 (bf16) decodes 3 tokens after a one-token prompt
for 20,000 seeded requests with a drafter whose q is the target's own top logits at another temperature;
the joint of the 3 tokens (the first from the prefill, the next two through verification: accepted draft
and bonus, or correction and a plain step) is compared with the exact joint under plain sampling, computed
by target forwards over every likely prefix (`target_tree`). Temperature 1, and top-p 0.9 with top-k 20.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import dspark.verify
from dspark.config import EngineConfig
from dspark.engine.llm_engine import LLMEngine
from dspark.sampling import SamplingParams
from dspark.schedule.base import FixedLength
from dspark.verify import greedy_verdict, rejection_sample

from stats_utils import g_test
from target_tree import TargetTree, TreeDrafter

ALPHA = 1e-3  # a test passes when its G-test p-value is above ALPHA
BROKEN_ALPHA = 1e-6  # a deliberately broken variant must give a p-value below this

# ---- synthetic target and drafter ---------------------------------------------------------------
V, GAMMA = 6, 3
EMITTED = 3  # tokens compared per request: V**3 joint cells
ROWS = 60_000  # requests per setting
START = (0, 1)  # committed context; target and drafter condition on the last two tokens


def markov_table(rng: np.random.Generator, concentration: float, zero_prob: float = 0.0) -> np.ndarray:
    """[V, V, V] next-token distributions given the last two tokens, each row with random zeros (its
    largest entry is always kept)."""
    table = rng.dirichlet(np.full(V, concentration), size=(V, V))
    zero = (rng.random(table.shape) < zero_prob) & (table < table.max(-1, keepdims=True))
    table = np.where(zero, 0.0, table)
    return table / table.sum(-1, keepdims=True)


def one_hot_table(rng: np.random.Generator) -> np.ndarray:
    return np.eye(V)[rng.integers(V, size=(V, V))]


def synthetic_setting(name: str):
    """(target table p, drafter table q or None for point masses, point-mass draft tokens or None)."""
    rng = np.random.default_rng(0)
    p = markov_table(rng, 1.0, zero_prob=0.3)
    if name == "q_far":
        return p, markov_table(rng, 0.3, zero_prob=0.3), None
    if name == "q_near":
        return p, 0.7 * p + 0.3 * markov_table(rng, 1.0), None
    if name == "q_equals_p":
        return p, p, None
    if name == "point_mass":  # one fixed draft per context, mostly tokens p supports
        mix = 0.75 * p + 0.25 / V
        return p, None, np.array([[rng.choice(V, p=row) for row in rows] for rows in mix])
    if name == "greedy_target":
        return one_hot_table(rng), markov_table(rng, 0.5, zero_prob=0.3), None
    raise ValueError(name)


SETTINGS = ["q_far", "q_near", "q_equals_p", "point_mass", "greedy_target"]


def target_joint(p: np.ndarray) -> np.ndarray:
    """Exact probability of each first-EMITTED-tokens sequence [V**3] under plain sampling from p."""
    s0, s1 = START
    return (p[s0, s1][:, None, None] * p[s1][:, :, None] * p).reshape(-1)


def speculative_tokens(p_table, q_table, point_drafts, rows: int, seed: int):
    """Run one verification cycle per request and return (first EMITTED tokens [rows, EMITTED], verify
    lengths [rows]); requests that emit fewer tokens continue with plain samples from p."""
    gen = torch.Generator().manual_seed(seed)
    P = torch.from_numpy(p_table)
    lengths = torch.randint(GAMMA + 1, (rows,), generator=gen)
    drafts = torch.zeros(rows, GAMMA, dtype=torch.long)
    q = None if q_table is None else torch.zeros(rows, GAMMA, V, dtype=torch.float64)
    p_all = torch.zeros(rows, GAMMA + 1, V, dtype=torch.float64)
    a, b = torch.full((rows,), START[0]), torch.full((rows,), START[1])
    for k in range(GAMMA):  # draft autoregressively from q (or the point-mass table)
        p_all[:, k] = P[a, b]
        if q is None:
            x = torch.from_numpy(point_drafts)[a, b]
        else:
            q[:, k] = torch.from_numpy(q_table)[a, b]
            x = torch.multinomial(q[:, k], 1, generator=gen).squeeze(1)
        drafts[:, k] = x
        a, b = b, x
    p_all[:, GAMMA] = P[a, b]
    # flat target rows: request r verifies lengths[r] drafts and owns 1 + lengths[r] rows
    p_flat = p_all[torch.arange(GAMMA + 1)[None, :] <= lengths[:, None]].float()
    starts = torch.cumsum(1 + lengths, 0) - (1 + lengths)
    verdict = rejection_sample(p_flat, starts, drafts, None if q is None else q.float(), lengths,
                               torch.rand(rows, GAMMA, generator=gen), torch.rand(rows, generator=gen))
    n, last = verdict.num_accepted, verdict.next_token
    out = torch.zeros(rows, EMITTED, dtype=torch.long)
    a, b = torch.full((rows,), START[0]), torch.full((rows,), START[1])
    for k in range(EMITTED):
        plain = torch.multinomial(P[a, b], 1, generator=gen).squeeze(1)
        out[:, k] = torch.where(k < n, drafts[:, min(k, GAMMA - 1)], torch.where(k == n, last, plain))
        a, b = b, out[:, k]
    return out, lengths


def test_greedy_verdict_is_rejection_sampling_of_a_greedy_target():
    """The engine's shortcut for steps of greedy requests (argmaxes only) gives rejection_sample's verdict on the
    one-hot p, with drafted q and with point-mass drafts."""
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 5000, 4  # a small vocabulary: many drafts are the argmax
    lengths = torch.randint(GAMMA + 1, (rows,), generator=gen)
    starts = torch.cumsum(1 + lengths, 0) - (1 + lengths)
    best = torch.randint(vocab, (int((1 + lengths).sum()),), generator=gen)
    p = torch.nn.functional.one_hot(best, vocab).float()
    drafts = torch.randint(vocab, (rows, GAMMA), generator=gen)
    q = torch.rand(rows, GAMMA, vocab, generator=gen)
    for q_drafts in (None, q / q.sum(-1, keepdim=True)):
        u_accept, u_sample = torch.rand(rows, GAMMA, generator=gen), torch.rand(rows, generator=gen)
        expect = rejection_sample(p, starts, drafts, q_drafts, lengths, u_accept, u_sample)
        got = greedy_verdict(best, starts, drafts, lengths)
        assert torch.equal(got.num_accepted, expect.num_accepted) and torch.equal(got.next_token, expect.next_token)
    whole = expect.num_accepted == lengths
    assert (whole & (lengths > 0)).any() and (~whole).any()  # both all-accepted and rejected requests seen


def synthetic_p_value(name: str, seed: int = 0) -> float:
    """G-test of the emitted joint against the target joint, one stratum per verify length."""
    p_table, q_table, point_drafts = synthetic_setting(name)
    tokens, lengths = speculative_tokens(p_table, q_table, point_drafts, ROWS, seed)
    cell = (tokens * torch.tensor([V * V, V, 1])).sum(-1)
    counts = torch.bincount(lengths * V**EMITTED + cell, minlength=(GAMMA + 1) * V**EMITTED)
    return g_test(counts.view(GAMMA + 1, -1).numpy(), target_joint(p_table)[None])


def test_synthetic_settings_cover_the_edge_cases():
    p, q, _ = synthetic_setting("q_far")
    assert ((p > 0) & (q == 0)).any() and ((q > 0) & (p == 0)).any()  # zeros on both sides
    p, _, drafts = synthetic_setting("point_mass")
    supported = np.take_along_axis(p, drafts[..., None], -1)[..., 0] > 0
    assert supported[START] and not supported.all()  # the first draft can pass; some drafts never do


@pytest.mark.parametrize("name", SETTINGS)
def test_synthetic_joint_matches_target(name):
    assert synthetic_p_value(name) > ALPHA


@pytest.mark.parametrize("name", ["q_far", "point_mass"])
def test_synthetic_check_fails_with_broken_residual(name, monkeypatch):
    """Drawing the correction from p instead of norm(max(0, p - q)) is caught."""
    monkeypatch.setattr(dspark.verify, "residual", lambda p, q, rejected: p)
    assert synthetic_p_value(name) < BROKEN_ALPHA


# ---- real model ---------------------------------------------------------------------------------
REAL_SAMPLES = 12_000  # enough: a residual drawn from p instead gives p-values of 1e-200 and 3e-64 here (long test)
REAL_PROMPT = "The"  # one token, so each request's prefill is cheap
REAL_TOKENS = 3  # compared per request
DRAFT_TEMPERATURE = 3.0  # q: the target's top logits this flat (wider than p: q > 0 where p = 0 under top-p)
REAL_SETTINGS = {
    "temperature_1": SamplingParams(temperature=1.0),
    "top_p_0.9_top_k_20": SamplingParams(temperature=1.0, top_p=0.9, top_k=20),  # both filters bind often
}
# Both settings run in bf16. The reference computes every prefix in large forwards and the engine's steps hold
# anything from one row to hundreds; a top-k/top-p cut can turn on the last bit of a logit near its edge, so this
# holds only because every row rounds as the token decoded alone (Options.exact; without it this setting gave p = 0
# in bf16).
REAL_DTYPES = {"temperature_1": "bf16", "top_p_0.9_top_k_20": "bf16"}


def real_model_check(llm, setting: str, samples: int = REAL_SAMPLES) -> tuple[float, LLMEngine]:
    """G-test p-value of the engine's first REAL_TOKENS tokens under speculative decoding against the
    exact plain-sampling joint; also returns the engine (its stats show what was drafted and accepted)."""
    target, tokenizer = llm.engine.target, llm.tokenizer
    params = dataclasses.replace(REAL_SETTINGS[setting], max_tokens=REAL_TOKENS, ignore_eos=True)
    prompt = tokenizer.encode(REAL_PROMPT, add_special_tokens=False)
    tree = TargetTree(target, prompt, params, samples, depth=REAL_TOKENS)
    drafter = TreeDrafter(tree, target.config.vocab_size, DRAFT_TEMPERATURE)
    config = EngineConfig(dtype=llm.config.dtype, max_num_seqs=512, max_model_len=len(prompt) + REAL_TOKENS + 1)
    engine = LLMEngine(target, tokenizer, drafter, FixedLength(), config)
    requests = [engine.add_request(prompt, dataclasses.replace(params, seed=i)) for i in range(samples)]
    while engine.has_unfinished():
        engine.step()
    assert all(r.finish_reason == "length" for r in requests), "a request failed or stopped early"
    keys, probs = tree.cells()
    index = {key: i for i, key in enumerate(keys)}
    counts = np.bincount([index[tree.cell_of(r.output_ids)] for r in requests], minlength=len(keys))
    return g_test(counts, probs), engine


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(REAL_SETTINGS))
def test_real_model_joint_matches_plain_sampling(setting, llm_bf16, make_llm):
    p_value, engine = real_model_check(llm_bf16 if REAL_DTYPES[setting] == "bf16" else make_llm(), setting)
    verified = sum(sum(st.verified) for st in engine.stats)
    accepted = sum(sum(st.accepted) for st in engine.stats)
    # the speculative path ran: most requests verified a draft, with both outcomes common
    assert verified > REAL_SAMPLES / 2 and 0.2 < accepted / verified < 0.9
    assert p_value > ALPHA


@pytest.mark.long
@pytest.mark.parametrize("setting", list(REAL_SETTINGS))
def test_real_model_check_fails_with_broken_residual(setting, llm_bf16, monkeypatch):
    """The real-model G-test at REAL_SAMPLES has the power to see a broken verifier: drawing the correction from p
    instead of norm(max(0, p - q)) is caught."""
    monkeypatch.setattr(dspark.verify, "residual", lambda p, q, rejected: p)
    assert real_model_check(llm_bf16, setting)[0] < BROKEN_ALPHA
