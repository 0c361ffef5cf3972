"""The DSpark drafter (docs/method.md §2) on a tiny random target: inference agrees with the teacher-forced
training forward (and its fused backbone with the layer loop), q is exactly softmax(U + Markov bias) and the drafts
are sampled from it, the confidence head never reads x_k, the context is projected lazily, and the drafter runs
losslessly inside the engine. Checkpoints: test_drafter_checkpoint.py.

Sections: helpers | training vs inference | sequential heads | confidence | context projection | engine.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from stats_utils import g_test
from tiny_models import (BLOCK, FIRST_TOKEN, HEAD_KINDS, HIDDEN, RANK, VOCAB, one_thread,
                         random_tokens, tiny_drafter, tiny_target, tiny_target_dir)

from dspark import LLM, SamplingParams
from dspark.draft.dspark import DSparkDrafter
from dspark.engine.request import Request
from dspark.sampling import param_tensors, warp
from dspark.train.anchors import AnchorBatch
from dspark.train.features import target_features
from dspark.train.forward import block_forward

__all__ = ["one_thread", "tiny_target", "tiny_target_dir"]  # fixtures used here
pytestmark = pytest.mark.usefixtures("one_thread")


# ---- helpers --------------------------------------------------------------------------------------
def sequence(n: int, seed: int) -> list[int]:
    return random_tokens(n, torch.Generator().manual_seed(seed))


def other_token(token: int) -> int:
    """A different ordinary token."""
    return (token + 1 - FIRST_TOKEN) % (VOCAB - FIRST_TOKEN) + FIRST_TOKEN


def one_anchor(a: int, block_size: int = BLOCK) -> AnchorBatch:
    return AnchorBatch(torch.tensor([[a]]), torch.tensor([[True]]), block_size)


def train_block(model, target, seq: list[int], a: int, feats=None):
    """(q [γ, V], confidence [γ]) of the block at anchor a, teacher-forced on seq."""
    feats = feats or target_features(target, [seq], model.target_layer_ids)
    out = block_forward(model, target, torch.tensor([seq]), feats, one_anchor(a, model.block_size))
    conf = torch.sigmoid(out.conf_logits[0]) if out.conf_logits is not None else None
    return out.logits[0].softmax(-1), conf


def committed_request(drafter, slot: int, features: torch.Tensor, anchor_token: int, params: SamplingParams,
                      chunks: int = 1, context: list[int] | None = None) -> Request:
    """A request in `slot` whose committed context (tokens, default zeros, and target features) is given
    in `chunks` commits, as an engine commits prompt and accepted tokens, and whose newest token is
    anchor_token."""
    req = Request([anchor_token], params)
    req.slot, req.output_ids = slot, [anchor_token]
    tokens = torch.tensor(context) if context is not None else torch.zeros(features.shape[0], dtype=torch.long)
    for toks, part in zip(tokens.tensor_split(chunks), features.tensor_split(chunks)):
        drafter.commit([req], [toks], [part])
    return req


def manual_bias(head, prev: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None):
    """docs/method.md §2 written out with the raw weights: (B(x_{k-1}, ·) [N, V], next RNN state)."""
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight  # [V, r], [V, r]
    e = w1[prev]
    if head.kind == "vanilla":
        return e @ w2.T, None
    if head.kind == "gated":
        gate = torch.sigmoid(torch.cat([h, e], -1) @ head.gate_proj.weight.T + head.gate_proj.bias)
        return (gate * e) @ w2.T, None
    z = torch.cat([state, e, h], -1)
    W, b, r = head.joint_proj.weight, head.joint_proj.bias, head.rank
    g = torch.sigmoid(z @ W[:r].T + b[:r])
    state = g * state + (1 - g) * torch.tanh(z @ W[r:2 * r].T + b[r:2 * r])
    return torch.tanh(z @ W[2 * r:].T + b[2 * r:]) @ w2.T, state


def capture_hidden(model):
    """Record the backbone's final hidden states h (the output of the final norm) on every forward."""
    seen = []
    handle = model.norm.register_forward_hook(lambda mod, args, out: seen.append(out.detach().clone()))
    return seen, handle


# ---- training vs inference ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_drafter_matches_teacher_forced_training_forward(tiny_target, kind):
    """Two requests drafted in one batch (contexts committed in pieces) give the same q_1..q_γ and
    c_1..c_γ as the training forward over their sequences with the drafts spliced in after the anchor."""
    model = tiny_drafter(tiny_target, kind)
    drafter, G = DSparkDrafter(model), model.block_size
    seqs, anchors = [sequence(24, 1), sequence(24, 2)], [10, 15]
    feats = target_features(tiny_target, seqs, model.target_layer_ids)
    reqs = [committed_request(drafter, i, feats.features[i, :a], seqs[i][a], SamplingParams(temperature=1.0, seed=i),
                              chunks=2) for i, a in enumerate(anchors)]
    proposal = drafter.propose(reqs)
    assert proposal.tokens.shape == (2, G) and proposal.q.shape == (2, G, VOCAB)
    assert proposal.lengths.tolist() == [G, G]
    spliced = [s[:a + 1] + proposal.tokens[i].tolist() + s[a + 1 + G:] for i, (s, a) in enumerate(zip(seqs, anchors))]
    out = block_forward(model, tiny_target, torch.tensor(spliced), feats,
                        AnchorBatch(torch.tensor([[a] for a in anchors]), torch.ones(2, 1, dtype=torch.bool), G))
    torch.testing.assert_close(out.logits.softmax(-1), proposal.q, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.sigmoid(out.conf_logits), proposal.confidence, rtol=1e-5, atol=1e-6)


def test_base_logits_match_between_training_and_inference(tiny_target):
    """The backbone's U_1..U_γ themselves: the hidden states h that both paths feed to the LM head agree."""
    model = tiny_drafter(tiny_target, "vanilla")
    seq, a = sequence(20, 3), 9
    feats = target_features(tiny_target, [seq], model.target_layer_ids)
    seen, handle = capture_hidden(model)
    try:
        drafter = DSparkDrafter(model)
        drafter.propose([committed_request(drafter, 0, feats.features[0, :a], seq[a], SamplingParams(seed=0))])
        train_block(model, tiny_target, seq, a, feats)
    finally:
        handle.remove()
    inference_h, training_h = seen
    torch.testing.assert_close(model.base_logits(training_h), model.base_logits(inference_h), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_backbone_drafts_as_the_layer_loop(tiny_target, dtype, monkeypatch, use_options):
    """The backbone's layers in one fused_layers.cpp call (inference, dtype as the engine runs the drafter: bf16
    with the packed and joined weight copies on AMX CPUs) give the layer loop's q and confidences, within
    rounding, over two contexts committed in pieces."""
    model = copy.deepcopy(tiny_drafter(tiny_target, "vanilla")).to(dtype)  # a copy: the target stays float32
    seqs, anchors = [sequence(24, 5), sequence(24, 6)], [11, 17]
    feats = target_features(tiny_target, seqs, model.target_layer_ids)
    proposals = {}
    for fused in ("1", "0"):
        use_options(fused=fused == "1")
        drafter = DSparkDrafter(model)
        reqs = [committed_request(drafter, i, feats.features[i, :a], seqs[i][a], SamplingParams(temperature=1.0, seed=i),
                                  chunks=2) for i, a in enumerate(anchors)]
        with torch.inference_mode():  # as the engine drafts: copies made here keep no version counter
            proposals[fused] = drafter.propose(reqs)
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=0.1, atol=2e-3)
    torch.testing.assert_close(proposals["1"].q, proposals["0"].q, **tol)
    torch.testing.assert_close(proposals["1"].confidence, proposals["0"].confidence, **tol)


@pytest.mark.parametrize("kind", ["dflash", "vanilla"])
def test_greedy_step_drafts_the_argmax_chain_without_q(tiny_target, kind):
    """A step of greedy requests drafts what the sampling path drafts for a greedy request (the argmax of U plus
    the Markov bias, position by position) and returns no q (point masses)."""
    model = tiny_drafter(tiny_target, kind)
    seq, a = sequence(24, 7), 13
    feats = target_features(tiny_target, [seq], model.target_layer_ids)
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)
    alone = DSparkDrafter(model)
    proposal = alone.propose([committed_request(alone, 0, feats.features[0, :a], seq[a], greedy)])
    mixed = DSparkDrafter(model)  # beside a sampled request the step takes the sampling path
    reqs = [committed_request(mixed, i, feats.features[0, :a], seq[a], p) for i, p in enumerate((greedy, sampled))]
    reference = mixed.propose(reqs)
    assert proposal.q is None and reference.q is not None
    assert torch.equal(proposal.tokens[0], reference.tokens[0])
    assert bool((reference.q[0].max(-1).values == 1).all())  # the greedy row's q there: a point mass


# ---- sequential heads -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_markov_head_computes_the_method_formula(tiny_target, kind):
    head = tiny_drafter(tiny_target, kind).markov_head
    assert head.markov_w1.weight.shape == (VOCAB, RANK) and head.markov_w2.weight.shape == (VOCAB, RANK)
    g = torch.Generator().manual_seed(5)
    prev = torch.randint(VOCAB, (6,), generator=g)
    h = torch.randn(6, HIDDEN, generator=g)
    state = torch.randn(6, RANK, generator=g) if kind == "rnn" else None
    bias, e, next_state = head(prev, h, state)
    want_bias, want_state = manual_bias(head, prev, h, state)
    torch.testing.assert_close(bias, want_bias, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(e, head.markov_w1.weight[prev], rtol=0, atol=0)
    if kind == "rnn":
        torch.testing.assert_close(next_state, want_state, rtol=1e-5, atol=1e-6)
        assert torch.equal(head.initial_state(3, h), torch.zeros(3, RANK))


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=20)],
                         ids=["T1", "T0.7-top20"])
def test_q_is_the_normalised_softmax_of_base_logits_plus_markov_bias(tiny_target, kind, params):
    """q_k = warp(U_k + B(x_{k-1}, ·)) with x_0 the anchor and x_{k-1} the draft just sampled; at T = 1
    that is exactly softmax(U_k + W2 W1[x_{k-1}]) (vanilla), summing to 1."""
    model = tiny_drafter(tiny_target, kind)
    seq, a = sequence(16, 4), 8
    feats = target_features(tiny_target, [seq], model.target_layer_ids)
    seen, handle = capture_hidden(model)
    try:
        drafter = DSparkDrafter(model)
        proposal = drafter.propose([committed_request(drafter, 0, feats.features[0, :a], seq[a], params)])
    finally:
        handle.remove()
    h = seen[0]  # [γ, d]
    U = h @ model.lm_head.weight.T
    prev = torch.tensor([seq[a]] + proposal.tokens[0, :-1].tolist())
    state = torch.zeros(1, RANK) if kind == "rnn" else None
    for k in range(model.block_size):
        bias, state = manual_bias(model.markov_head, prev[k:k + 1], h[k:k + 1], state)
        want = warp(U[k:k + 1] + bias, *param_tensors([params]))
        torch.testing.assert_close(proposal.q[0, k:k + 1], want, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(proposal.q.sum(-1), torch.ones(1, model.block_size), rtol=0, atol=1e-5)
    if params.temperature == 1.0 and params.top_k == 0:
        assert bool((proposal.q > 0).all())  # a full softmax: no token left out


def test_drafts_are_sampled_from_the_returned_q(tiny_target):
    """Across many seeded requests, x_1 follows the returned q_1 and x_2 follows the returned q_2 given
    x_1 (G-test); the same counts reject the untempered distribution (the test has power)."""
    model = tiny_drafter(tiny_target, "vanilla")
    seq, a = sequence(12, 6), 8
    feats = target_features(tiny_target, [seq], model.target_layer_ids)
    drafter = DSparkDrafter(model)
    params = [SamplingParams(temperature=0.7, top_k=20, seed=1000 + i) for i in range(256)]
    reqs = [committed_request(drafter, i, feats.features[0, :a], seq[a], p) for i, p in enumerate(params)]
    rounds = [drafter.propose(reqs) for _ in range(10)]
    tokens = torch.cat([r.tokens for r in rounds])  # [2560, γ]
    q = torch.cat([r.q for r in rounds])  # [2560, γ, V]
    q1 = q[0, 0]
    assert torch.equal(q[:, 0], q1.expand_as(q[:, 0]))  # same context and anchor: the same q_1 for all
    assert bool((q.gather(-1, tokens[..., None]) > 0).all())  # never a token outside the support
    counts1 = np.bincount(tokens[:, 0].numpy(), minlength=VOCAB)
    assert g_test(counts1, q1.double().numpy() / q1.double().sum().item()) > 1e-3
    firsts = sorted(set(tokens[:, 0].tolist()))
    counts2 = np.stack([np.bincount(tokens[tokens[:, 0] == t, 1].numpy(), minlength=VOCAB) for t in firsts])
    q2 = torch.stack([q[tokens[:, 0] == t][0, 1] for t in firsts]).double()
    assert g_test(counts2, (q2 / q2.sum(-1, keepdim=True)).numpy()) > 1e-3
    untempered = q1.double() ** 0.7  # the same support at temperature 1, the bug of ignoring temperature
    assert g_test(counts1, (untempered / untempered.sum()).numpy()) < 1e-6


# ---- confidence -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_confidence_and_q_never_read_x_k(tiny_target, kind):
    """Changing x_k (the token at position a + k) leaves c_1..c_k and q_1..q_k unchanged; c_{k+1}, which
    reads x_k as x_{(k+1)-1}, changes when the confidence head reads W1[x_{k-1}]."""
    model = tiny_drafter(tiny_target, kind)
    seq, a, G = sequence(20, 7), 6, model.block_size
    feats = target_features(tiny_target, [seq], model.target_layer_ids)
    q, conf = train_block(model, tiny_target, seq, a, feats)
    for k in range(1, G):
        changed = list(seq)
        changed[a + k] = other_token(seq[a + k])
        q2, conf2 = train_block(model, tiny_target, changed, a, feats)
        assert torch.equal(conf2[:k], conf[:k]) and torch.equal(q2[:k], q[:k])
        if kind != "dflash":
            assert not torch.equal(conf2[k], conf[k]) and not torch.equal(q2[k], q[k])
        else:
            assert torch.equal(conf2, conf) and torch.equal(q2, q)  # no sequential head: tokens unused


def test_confidence_head_reads_h_and_previous_token_only(tiny_target):
    """c_k = σ(w^T [h_k; W1[x_{k-1}]] + b) with the drafts the drafter itself sampled."""
    model = tiny_drafter(tiny_target, "gated")
    seq, a = sequence(16, 8), 8
    feats = target_features(tiny_target, [seq], model.target_layer_ids)
    seen, handle = capture_hidden(model)
    try:
        drafter = DSparkDrafter(model)
        req = committed_request(drafter, 0, feats.features[0, :a], seq[a], SamplingParams(seed=2))
        proposal = drafter.propose([req])
    finally:
        handle.remove()
    assert model.confidence_head.proj.weight.shape == (1, HIDDEN + RANK)
    prev = torch.tensor([seq[a]] + proposal.tokens[0, :-1].tolist())
    z = torch.cat([seen[0], model.markov_head.markov_w1.weight[prev]], -1)
    want = torch.sigmoid(z @ model.confidence_head.proj.weight[0] + model.confidence_head.proj.bias)
    torch.testing.assert_close(proposal.confidence[0], want, rtol=1e-5, atol=1e-6)


# ---- context projection ---------------------------------------------------------------------------
def test_context_is_projected_lazily_in_one_batched_forward(tiny_target, monkeypatch):
    """Commits only queue positions, so steps that skip the drafter cost it no forward; the next proposal projects
    every queued position of every request in one call and drafts as if each commit had been projected at once;
    a request with FLUSH_ROWS positions queued is projected at commit (the queue's memory stays bounded)."""
    from dspark.draft.context_cache import FLUSH_ROWS

    model = tiny_drafter(tiny_target, "vanilla")
    seqs, a = [sequence(20, 1), sequence(20, 2)], 12
    feats = target_features(tiny_target, seqs, model.target_layer_ids).features
    lazy, eager = DSparkDrafter(model), DSparkDrafter(model)
    calls = []
    project = lazy.project
    monkeypatch.setattr(lazy, "project", lambda reqs, *rest: calls.append(len(reqs)) or project(reqs, *rest))
    chunks = [torch.arange(0, 5), torch.arange(5, 6), torch.arange(6, a)]  # a prompt, then one token per step
    by_drafter = {}
    for drafter in (lazy, eager):
        reqs = [Request([seqs[i][a]], SamplingParams(temperature=1.0, seed=i)) for i in range(2)]
        for i, req in enumerate(reqs):
            req.slot, req.output_ids = i, [seqs[i][a]]
        for idx in chunks:
            drafter.commit(reqs, [torch.tensor(seqs[i])[idx] for i in range(2)], [feats[i, idx] for i in range(2)])
            if drafter is eager:
                drafter.flush()
        by_drafter[drafter] = reqs
    assert calls == [] and lazy.context_len == {} and lazy.committed_len(by_drafter[lazy][0].request_id) == a
    got, want = lazy.propose(by_drafter[lazy]), eager.propose(by_drafter[eager])
    assert calls == [2] and lazy.pending == {} and lazy.context_len[by_drafter[lazy][1].request_id] == a
    torch.testing.assert_close(got.q, want.q, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.confidence, want.confidence, rtol=1e-5, atol=1e-7)
    req = by_drafter[lazy][0]
    lazy.commit([req], [torch.zeros(FLUSH_ROWS, dtype=torch.long)], [feats[0, :1].expand(FLUSH_ROWS, -1)])
    assert calls == [2, 1] and lazy.pending == {} and lazy.context_len[req.request_id] == a + FLUSH_ROWS


# ---- engine ---------------------------------------------------------------------------------------
def test_engine_with_dspark_drafter_is_lossless_under_greedy(tiny_target, tiny_target_dir):
    """Greedy output equals plain decoding, and the drafter's context always covers exactly the
    positions the engine has committed (requests of different lengths, finishing at different steps)."""
    prompts = [sequence(9, 20), sequence(5, 21), sequence(13, 22)]
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 11, 17)]
    plain = LLM(str(tiny_target_dir), dtype="fp32").generate(prompts, greedy)
    drafter = DSparkDrafter(tiny_drafter(tiny_target, "rnn"))
    llm = LLM(str(tiny_target_dir), drafter=drafter, gamma=BLOCK, dtype="fp32")
    engine = llm.engine
    reqs = [engine.add_request(prompt, params) for prompt, params in zip(prompts, greedy)]
    while engine.has_unfinished():
        engine.step()
        for req in engine.running:
            assert drafter.committed_len(req.request_id) == req.num_cached
    assert drafter.context_len == {} and drafter.pending == {}  # every finished request was released
    assert [r.output_ids for r in reqs] == [o.token_ids for o in plain]
    assert sum(sum(s.verified) for s in engine.stats) > 0  # drafts were really verified
