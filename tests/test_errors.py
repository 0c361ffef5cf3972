"""Bad input gets a clear error and breaks nothing else: invalid sampling values, prompts, targets and
settings; a request failing mid-batch; a failing step; cancelled requests; the CLI's exit codes."""
from __future__ import annotations

import math

import pytest
from transformers import GPT2Config

import dspark
from dspark import SamplingParams
from dspark.cli import main
from dspark.config import EngineConfig
from dspark.draft import Drafter, make_drafter
from dspark.schedule import make_scheduler
from dspark.target.loading import load_target
from dspark.target.model import TargetModel

SHORT = SamplingParams(temperature=0, max_tokens=16)  # enough to tell outputs apart, cheap to run


# ---- settings -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    dict(temperature=-1.0), dict(temperature=math.nan), dict(temperature=math.inf), dict(temperature="hot"),
    dict(top_p=0), dict(top_p=1.5), dict(top_p=math.nan), dict(top_k=-1), dict(top_k=2.5),
    dict(max_tokens=0), dict(max_tokens=-3), dict(seed="x"), dict(stop=[""]), dict(stop=[3]),
], ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()))
def test_invalid_sampling_values_are_rejected(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        SamplingParams(**kwargs)


def test_invalid_engine_settings_are_rejected():
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="fp16")
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="unknown drafter 'bogus'"):
        make_drafter("bogus")
    with pytest.raises(ValueError, match="unknown scheduler 'bogus'"):
        make_scheduler("bogus")
    with pytest.raises(ValueError, match="unsupported model family 'gpt2'"):
        TargetModel(GPT2Config())


# ---- targets ------------------------------------------------------------------------------------
def test_missing_targets_raise_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_target("/tmp/nope.gguf")
    with pytest.raises(FileNotFoundError, match="target not found"):
        load_target(str(tmp_path / "no-such-folder"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_target(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        load_target("nobody-here/no-such-model-xyz")


# ---- prompts ------------------------------------------------------------------------------------
def test_bad_prompts_are_rejected_and_leave_the_engine_clean(make_llm, chat_ids, solo_greedy, greedy):
    llm = make_llm(max_model_len=160)
    long_prompt = (chat_ids[2] * 20)[:170]
    assert len(long_prompt) >= 160 > len(chat_ids[1]) + greedy.max_tokens
    cases = [("", "empty prompt"), ([], "empty prompt"), (long_prompt, "does not fit the context of 160"),
             ([1, 2, 10**6], r"token ids must be in \[0, 49152\)"), ([-1], "token ids must be in")]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.engine.add_request(prompt, greedy)
        with pytest.raises(ValueError, match=message):  # a good prompt before the bad one is not left queued
            llm.generate([chat_ids[1], prompt], greedy)
        assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="empty message list"):
        llm.generate([[]], greedy, chat=True)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([chat_ids[1]], [greedy, greedy])
    assert llm.generate(chat_ids[1], SHORT)[0].token_ids == solo_greedy[1][:SHORT.max_tokens]


# ---- failures while running ---------------------------------------------------------------------
def test_a_request_failing_mid_batch_does_not_disturb_the_others(make_llm, chat_ids, solo_greedy):
    """Its on_output callback raises after a few tokens: it finishes with "error" and the message; the
    others finish with their solo outputs, and the engine then serves new requests."""
    engine = make_llm(drafter="prompt-lookup").engine

    def explode(out):
        if len(out.token_ids) >= 3:
            raise RuntimeError("client went away")

    reqs = [engine.add_request(ids, SHORT, on_output=explode if i == 1 else None) for i, ids in enumerate(chat_ids)]
    last = {}
    while engine.has_unfinished():
        last.update((out.request_id, out) for out in engine.step())
    failed = last[reqs[1].request_id]
    assert failed.finished and failed.finish_reason == "error" and failed.error == "RuntimeError: client went away"
    assert 3 <= len(failed.token_ids) < SHORT.max_tokens
    for i in (0, 2, 3):
        assert reqs[i].error is None and reqs[i].output_ids == solo_greedy[i][:SHORT.max_tokens]
    assert engine.cache.num_used == 0 and not engine.running
    late = engine.add_request(chat_ids[1], SHORT)
    while engine.has_unfinished():
        engine.step()
    assert late.output_ids == solo_greedy[1][:SHORT.max_tokens]


class FailingDrafter(Drafter):
    """Raises on its `fail_at`-th proposal (every proposal from then on if always), or on every proposal that
    includes the prompt `poison`; proposes nothing otherwise."""

    def __init__(self, fail_at: int = 0, always: bool = False, poison: list[int] | None = None):
        self.calls, self.fail_at, self.always, self.poison = 0, fail_at, always, poison

    def propose(self, requests, limit=None):
        self.calls += 1
        if self.calls == self.fail_at or (self.always and self.calls > self.fail_at) or \
                any(r.prompt_ids == self.poison for r in requests):
            raise RuntimeError("drafter crashed")
        return super().propose(requests, limit)


def test_a_transient_fault_is_retried_request_by_request(make_llm, chat_ids, solo_greedy):
    llm = make_llm(drafter=FailingDrafter(fail_at=3))
    outs = llm.generate(chat_ids[:3], SHORT)
    assert [o.token_ids for o in outs] == [s[:SHORT.max_tokens] for s in solo_greedy[:3]]
    assert all(o.error is None for o in outs)


def test_a_fault_that_follows_one_request_fails_only_it(make_llm, chat_ids, solo_greedy):
    llm = make_llm(drafter=FailingDrafter(poison=chat_ids[1]))
    outs = llm.generate(chat_ids[:4], SHORT)
    assert outs[1].finish_reason == "error" and outs[1].error == "RuntimeError: drafter crashed"
    for i in (0, 2, 3):
        assert outs[i].error is None and outs[i].token_ids == solo_greedy[i][:SHORT.max_tokens]


def test_a_sampling_fault_in_one_request_leaves_the_others_draws_untouched(make_llm, chat_ids):
    """Request 1's temperature is broken after its checks (NaN: its probabilities are not finite, as a tiny
    temperature once made them): it fails with a message; the sampled requests beside it draw exactly what
    they draw without it in trouble (their generators are rewound for the retry)."""
    params = [SamplingParams(temperature=1.0, max_tokens=10, seed=s) for s in range(4)]
    llm = make_llm(drafter="prompt-lookup")
    reference = [o.token_ids for o in llm.generate(chat_ids[:4], params)]
    engine = llm.engine
    reqs = [engine.add_request(ids, SamplingParams(temperature=1.0, max_tokens=10, seed=s))
            for s, ids in enumerate(chat_ids[:4])]
    engine.step()
    engine.step()
    reqs[1].params.temperature = float("nan")
    while engine.has_unfinished():
        engine.step()
    assert reqs[1].finish_reason == "error" and "outside the vocabulary" in reqs[1].error
    assert [reqs[i].output_ids for i in (0, 2, 3)] == [reference[i] for i in (0, 2, 3)]
    assert engine.cache.num_used == 0


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(make_llm, chat_ids, solo_greedy):
    llm = make_llm(drafter=FailingDrafter(fail_at=3, always=True))
    failed = llm.generate(chat_ids[:2], SHORT)
    assert [o.finish_reason for o in failed] == ["error", "error"]
    assert all(o.error == "RuntimeError: drafter crashed" and len(o.token_ids) == 3 for o in failed)
    assert llm.engine.cache.num_used == 0
    llm.engine.drafter.always = False
    assert [o.token_ids for o in llm.generate(chat_ids[:2], SHORT)] == [s[:SHORT.max_tokens] for s in solo_greedy[:2]]


def test_aborted_requests_free_their_place(make_llm, chat_ids, solo_greedy):
    engine = make_llm(max_num_seqs=2).engine
    reqs = [engine.add_request(ids, SHORT) for ids in chat_ids[:3]]  # the third waits
    engine.step()
    engine.step()
    assert engine.abort(reqs[0].request_id) and engine.abort(reqs[2].request_id)
    assert not engine.abort("no-such-request")
    while engine.has_unfinished():
        engine.step()
    assert [r.finish_reason for r in reqs] == ["abort", "length", "abort"]
    assert reqs[1].output_ids == solo_greedy[1][:SHORT.max_tokens]
    assert engine.cache.num_used == 0


# ---- command line -------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--temperature", "-1"], "temperature must be"),
    (["--top-p", "1.5"], "top_p must be"),
    (["--max-tokens", "0"], "max_tokens must be"),
    (["--target", "/tmp/nope.gguf"], "GGUF file not found"),
])
def test_cli_bad_input_exits_2_with_a_message(argv, message, capsys):
    assert main(["generate", *argv, "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dspark: error: ") and message in err


def test_cli_bad_choice_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--scheduler", "bogus", "hello"])
    assert exit_info.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err


@pytest.fixture
def cli_on_shared_weights(make_llm, monkeypatch):
    """The CLI's LLM(...) built on the session's float32 weights instead of loading them again."""

    def llm(target=None, drafter="none", scheduler="fixed", *, gamma=7, dtype="bf16", threads=None, **config):
        return make_llm(drafter=drafter, scheduler=scheduler, gamma=gamma, **config)

    monkeypatch.setattr(dspark, "LLM", llm)


def test_cli_prompt_errors_and_success(cli_on_shared_weights, chat_prompts, capsys):
    assert main(["generate", "--raw", ""]) == 2
    assert "empty prompt" in capsys.readouterr().err
    assert main(["generate", "--drafter", "bogus", "hello"]) == 2
    assert "unknown drafter 'bogus'" in capsys.readouterr().err
    assert main(["generate", "--max-model-len", "8", chat_prompts[0]]) == 2
    assert "does not fit the context of 8" in capsys.readouterr().err
    assert main(["generate", "--max-tokens", "5", chat_prompts[0]]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "5 tokens in" in err and "finish: length" in err
