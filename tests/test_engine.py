"""The engine end to end on the bundled SmolLM2 (float32 unless said): greedy speculative decoding with
ragged verify lengths gives exactly the plain greedy output; requests joining and leaving a running batch
are unaffected; stop strings, EOS, max_tokens, the context limit and streaming behave as documented."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dspark import SamplingParams
from dspark.draft import Drafter, Proposal
from dspark.engine.emit import append_tokens, held_back
from dspark.engine.request import Request
from dspark.schedule import Scheduler


class NoisyReferenceDrafter(Drafter):
    """Drafts a request's known greedy continuation with random lengths 0..gamma (always gamma if not
    random_lengths), each token replaced by a random one with probability `noise`. dense=True also returns a
    random draft distribution q."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab_size: int, gamma: int = 5,
                 noise: float = 0.25, dense: bool = False, random_lengths: bool = True, seed: int = 0):
        self.references, self.vocab_size, self.gamma = references, vocab_size, gamma
        self.noise, self.dense, self.random_lengths = noise, dense, random_lengths
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, requests: list, limit: int | None = None) -> Proposal:
        R, G, g = len(requests), self.gamma, self.gen
        tokens = torch.randint(0, self.vocab_size, (R, G), generator=g)  # wrong guesses past the reference
        for i, req in enumerate(requests):
            ref = torch.tensor(self.references[tuple(req.prompt_ids)][len(req.output_ids):][:G], dtype=torch.long)
            keep = torch.rand(len(ref), generator=g) >= self.noise
            tokens[i, :len(ref)] = torch.where(keep, ref, tokens[i, :len(ref)])
        q = (2 * torch.randn(R, G, self.vocab_size, generator=g)).softmax(-1) if self.dense else None
        lengths = torch.randint(0, G + 1, (R,), generator=g) if self.random_lengths else torch.full((R,), G)
        return Proposal(tokens, q, lengths)


class RandomLengths(Scheduler):
    """Verify a uniformly random number 0..len of each request's drafts."""

    def __init__(self, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)

    def plan(self, proposal: Proposal) -> torch.Tensor:
        u = torch.rand(len(proposal.lengths), generator=self.gen)
        return (u * (proposal.lengths + 1)).floor().long()


@pytest.fixture
def noisy_drafter(chat_ids, solo_greedy, smollm_fp32):
    def make(**kwargs) -> NoisyReferenceDrafter:
        refs = {tuple(ids): out for ids, out in zip(chat_ids, solo_greedy)}
        return NoisyReferenceDrafter(refs, smollm_fp32[0].config.vocab_size, **kwargs)

    return make


def verify_counts(llm) -> tuple[int, int]:
    """(drafts verified, drafts accepted) over the engine's steps."""
    return sum(sum(s.verified) for s in llm.engine.stats), sum(sum(s.accepted) for s in llm.engine.stats)


# ---- greedy speculative decoding is exactly greedy decoding ------------------------------------
@pytest.mark.parametrize("dense_q", [False, True], ids=["point-mass-q", "dense-q"])
def test_greedy_speculative_equals_plain_with_ragged_lengths(make_llm, greedy, noisy_drafter, chat_ids, solo_greedy,
                                                             dense_q):
    llm = make_llm(drafter=noisy_drafter(dense=dense_q), scheduler=RandomLengths())
    outs = llm.generate(chat_ids, greedy)
    assert [o.token_ids for o in outs] == solo_greedy
    verified, accepted = verify_counts(llm)
    assert 0 < accepted < verified  # both acceptances and rejections happened
    assert any(len(set(s.verified)) > 1 for s in llm.engine.stats)  # ragged: different ℓ_r in one step


def test_greedy_prompt_lookup_equals_plain(make_llm, greedy, chat_ids, solo_greedy):
    llm = make_llm(drafter="prompt-lookup", gamma=4)
    assert [o.token_ids for o in llm.generate(chat_ids, greedy)] == solo_greedy
    verified, accepted = verify_counts(llm)
    assert verified > 0 and accepted > 0


# ---- continuous batching -----------------------------------------------------------------------
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_requests_joining_and_leaving_keep_their_outputs(make_llm, greedy, noisy_drafter, chat_ids, solo_greedy,
                                                         speculative):
    """Requests arrive between steps, wait for a free slot (max_num_seqs=3), and two finish early (small
    max_tokens) so that later slots are compacted into theirs: every output equals the solo one."""
    drafter = noisy_drafter(seed=1) if speculative else "none"
    llm = make_llm(drafter=drafter, scheduler=RandomLengths(seed=1) if speculative else "fixed", max_num_seqs=3)
    engine = llm.engine
    max_tokens = [greedy.max_tokens, 5, greedy.max_tokens, 12]
    arrival_step = [0, 0, 1, 2]
    reqs, slots_seen, waited = {}, {}, False
    step = 0
    while len(reqs) < len(chat_ids) or engine.has_unfinished():
        for i, at in enumerate(arrival_step):
            if at == step:
                params = SamplingParams(temperature=0, max_tokens=max_tokens[i])
                reqs[i] = engine.add_request(chat_ids[i], params)
        engine.step()
        waited |= bool(engine.waiting)
        for i, req in reqs.items():
            if req.slot >= 0:
                slots_seen.setdefault(i, set()).add(req.slot)
        step += 1
    for i, req in reqs.items():
        assert req.finish_reason in ("length", "stop") and req.error is None
        assert req.output_ids == solo_greedy[i][:max_tokens[i]], f"request {i}"
    assert waited, "a request should have waited for a slot"
    assert any(len(s) > 1 for s in slots_seen.values()), "a request should have moved to a freed slot"
    assert not engine.running and engine.cache.num_used == 0


def test_requests_with_one_prompt_share_its_prefill(make_llm, chat_ids):
    """Samples of one prompt admitted together cost one prefill (the others copy its keys and values), and
    each is the sample its seed gives alone."""
    prompts = [chat_ids[0], chat_ids[1], chat_ids[0], chat_ids[0]]
    params = [SamplingParams(temperature=1.0, max_tokens=12, seed=s) for s in range(len(prompts))]
    llm = make_llm(drafter="prompt-lookup")
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.stats[0].prefill_tokens == len(chat_ids[0]) + len(chat_ids[1])
    alone = [llm.generate(ids, sp)[0].token_ids for ids, sp in zip(prompts, params)]
    assert together == alone
    assert len({tuple(t) for t in together}) == len(prompts), "different seeds should give different samples"


# ---- finishing: EOS, max_tokens, context limit, stop strings -----------------------------------
@pytest.mark.parametrize("gamma", [2, 0])
def test_a_fixed_length_scheduler_caps_what_is_drafted(make_llm, noisy_drafter, chat_ids, gamma):
    """fixed γ passes γ to the drafter as its drafting limit (plain: the drafter is not called), so no draft is
    made that could not be verified."""
    drafter, limits = noisy_drafter(gamma=5), []
    propose = drafter.propose
    drafter.propose = lambda reqs, limit=None: limits.append(limit) or propose(reqs, limit)
    llm = make_llm(drafter=drafter, scheduler="fixed", gamma=gamma)
    llm.generate(chat_ids[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert (limits and max(limits) == gamma) if gamma else not limits


@pytest.fixture(scope="module")
def short_answer(make_llm, greedy):
    """A prompt whose greedy answer ends with EOS well before greedy.max_tokens, and that output."""
    llm = make_llm()
    ids = llm.chat_prompt("What is 2+2? Answer in one short sentence.")
    out = llm.generate(ids, greedy)[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < greedy.max_tokens
    return ids, out


def test_eos_finishes_with_stop_and_ignore_eos_continues(make_llm, greedy, short_answer):
    ids, ref = short_answer  # from plain decoding
    llm = make_llm(drafter="prompt-lookup")
    out = llm.generate(ids, greedy)[0]
    assert out.token_ids == ref.token_ids and out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.engine.eos_ids
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True) and "<|im_end|>" not in out.text
    n = len(ref.token_ids) + 6
    longer = llm.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
    assert longer.finish_reason == "length" and len(longer.token_ids) == n
    assert longer.token_ids[:len(ref.token_ids)] == ref.token_ids


def test_max_tokens_and_context_limit_are_exact(make_llm, greedy, noisy_drafter, chat_ids, solo_greedy):
    """A drafter that always proposes 7 right tokens: verification stops exactly at the limits, with no
    accepted draft thrown away (tokens after the prefill's = accepted drafts + one per step)."""
    ids = chat_ids[2]  # a long answer: code
    assert len(solo_greedy[2]) == greedy.max_tokens
    oracle = dict(gamma=7, noise=0.0, random_lengths=False)
    llm = make_llm(drafter=noisy_drafter(**oracle))
    limits = (1, 2, 9, 23)
    outs = llm.generate([ids] * len(limits), [SamplingParams(temperature=0, max_tokens=n) for n in limits])
    room = 11
    tight = make_llm(drafter=noisy_drafter(**oracle), max_model_len=len(ids) + room)
    outs += tight.generate(ids, greedy)
    for out, n in zip(outs, limits + (room,)):
        assert out.finish_reason == "length" and out.token_ids == solo_greedy[2][:n]
        assert out.drafts_accepted + out.steps == n - 1


def test_stop_strings_cut_the_text(make_llm, greedy, chat_ids, solo_greedy):
    llm = make_llm(drafter="prompt-lookup")
    full = llm.tokenizer.decode(solo_greedy[3], skip_special_tokens=True)
    stops = [full[20:26], "NEVER-APPEARS"]  # the first most likely straddles tokens

    def run(stop: list[str]):
        return llm.generate(chat_ids[3], SamplingParams(temperature=0, max_tokens=greedy.max_tokens, stop=stop))[0]

    out = run(stops)
    assert out.finish_reason == "stop" and len(out.token_ids) < len(solo_greedy[3])
    assert out.text == full[:full.find(stops[0])]
    missing = run(stops[1:])
    assert missing.text == full and missing.finish_reason == "length"


# ---- streaming ---------------------------------------------------------------------------------
def test_held_back_text():
    """Characters that may still turn into a stop string or a whole character wait."""
    assert held_back("The end</", ["</s>", "STOP"]) == 2
    assert held_back("The end ST", ["</s>", "STOP"]) == 2
    assert held_back("The end", ["</s>"]) == 0
    assert held_back("caf\ufffd", []) == 1  # a partial UTF-8 character decodes as U+FFFD


def test_a_character_cut_by_max_tokens_never_ends_the_text(make_llm):
    """An emoji takes several byte tokens: an answer cut inside it, as a prompt here forced token by token,
    streams and ends without the broken character."""
    llm = make_llm()
    ids = llm.tokenizer.encode("Привет 😀 ok", add_special_tokens=False)
    decoded = [llm.tokenizer.decode(ids[:k]) for k in range(1, len(ids) + 1)]
    cuts = [k for k, text in enumerate(decoded, 1) if text.endswith("\ufffd")]
    assert cuts, "the emoji should span several tokens"
    for k in cuts:
        req = Request([1], SamplingParams(temperature=0, max_tokens=k))
        deltas = [append_tokens(req, [t], llm.tokenizer, set(), 10_000) for t in ids[:k]]
        assert req.finish_reason == "length" and "\ufffd" not in req.text and "".join(deltas) == req.text
        assert req.text == decoded[k - 1].rstrip("\ufffd")


def stream(llm, prompts, params, chat: bool = False):
    """generate() with a callback: the finished outputs and each request's streamed outputs in order."""
    streamed: dict[str, list] = {}
    outs = llm.generate(prompts, params, chat=chat,
                        on_output=lambda o: streamed.setdefault(o.request_id, []).append(o))
    return outs, [streamed[o.request_id] for o in outs]


def check_stream(out, events):
    """The deltas add up to the final text, with no empty update, and the finished output comes last."""
    assert "".join(e.delta for e in events) == out.text
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    assert all(e.delta for e in events[:-1])
    assert events[-1].token_ids == out.token_ids and events[-1].finish_reason == out.finish_reason


def test_stop_string_split_across_steps_is_never_streamed(make_llm, chat_ids, solo_greedy, greedy):
    """Plain decoding, one token per step: each stop string is the text of two consecutive tokens, so its
    first part must be held back until the next step shows whether the stop string completes."""
    llm = make_llm()
    decode = lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    params, expected = [], []
    for ids, k in zip(solo_greedy, (10, 6, 14, 3)):
        full, before = decode(ids), decode(ids[:k])
        stop = decode(ids[:k + 2])[len(before):]
        assert len(stop) >= 2 and full.find(stop) == len(before), (stop, full)
        params.append(SamplingParams(temperature=0, max_tokens=greedy.max_tokens, stop=[stop]))
        expected.append(before)
    outs, events = stream(llm, chat_ids, params)
    for out, ev, text in zip(outs, events, expected):
        check_stream(out, ev)
        assert out.finish_reason == "stop" and out.text == text


def test_streamed_deltas_concatenate_to_the_final_text(llm_bf16, chat_prompts):
    """bf16 with prompt lookup (several tokens per step), stop strings, a short max_tokens and a sampled
    request."""
    rest = [SamplingParams(temperature=0, max_tokens=7), SamplingParams(temperature=0.8, max_tokens=32, seed=3)]
    # the texts without stop strings, from the same batch: in bf16 a token's rounding, and so the greedy text, may
    # change with the number of tokens in the forward (products of up to 16 rows, AMX tiles from 2 rows on)
    plain = llm_bf16.generate(chat_prompts, [SamplingParams(temperature=0, max_tokens=32)] * 2 + rest, chat=True)
    params = [SamplingParams(temperature=0, max_tokens=32, stop=[o.text[25:29]]) for o in plain[:2]] + rest
    outs, events = stream(llm_bf16, chat_prompts, params, chat=True)
    for out, ev, p in zip(outs, events, params):
        check_stream(out, ev)
        if p.stop:
            assert out.finish_reason == "stop" and p.stop[0] not in out.text
    assert outs[2].finish_reason == "length" and len(outs[2].token_ids) == 7


def test_logprobs_are_the_targets_whatever_the_drafter(make_llm, chat_ids, smollm_fp32):
    """Each emitted token's log-probability and alternatives come from the target row that decided it: with drafts
    (several tokens a step) they are the ones plain decoding reports, and they match a forward of the whole
    answer through the target."""
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    plain = make_llm().generate(chat_ids[:2], params)
    drafted = make_llm(drafter="prompt-lookup").generate(chat_ids[:2], params)
    for p, d in zip(plain, drafted):
        assert d.token_ids == p.token_ids and len(p.logprobs) == len(p.token_ids)
        for (tp, lp, top_p), (td, ld, top_d) in zip(p.logprobs, d.logprobs):
            assert tp == td and abs(lp - ld) < 1e-4 and [t for t, _ in top_p] == [t for t, _ in top_d]
    model = AutoModelForCausalLM.from_pretrained(smollm_fp32[2], dtype=torch.float32).eval()  # transformers' own
    ids = chat_ids[0] + plain[0].token_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(chat_ids[0]) - 1:-1].float().log_softmax(-1)
    expected = logits.gather(-1, torch.tensor(plain[0].token_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor([lp for _, lp, _ in plain[0].logprobs]), expected, atol=1e-3)
    assert make_llm().generate(chat_ids[0], SamplingParams(temperature=0, max_tokens=3))[0].logprobs is None


def test_a_request_finished_at_admission_leaves_no_gap_in_the_batch(make_llm, greedy, chat_ids, solo_greedy):
    """Admitted together, the second request finishes with its first token (max_tokens 1): the requests after it
    move up into its slot before the step's batch is built (a batch's rows are consecutive slots), so they decode
    their own context."""
    params = [greedy, SamplingParams(temperature=0, max_tokens=1), greedy, greedy]
    outs = make_llm(drafter="prompt-lookup").generate(chat_ids[:4], params)
    assert outs[1].token_ids == solo_greedy[1][:1]
    for i in (0, 2, 3):
        assert outs[i].token_ids == solo_greedy[i][:greedy.max_tokens], f"request {i}"
