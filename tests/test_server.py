"""`dspark serve` on loopback, called with the official `openai` client as users call it: chat and
completions, streaming and not, stop strings, seeds, n choices, usage counts; greedy answers equal `dspark generate`;
bad input gets OpenAI-shaped 4xx errors and the server keeps serving; a dropped stream leaves nothing
running or held; 429 over the limits; SIGTERM shuts down cleanly with exit code 0.

The server runs the bundled SmolLM2 (bf16, prompt lookup, as the CLI defaults) in a thread of this process,
so the tests can look at the engine's state directly.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time

import httpx2 as httpx  # the HTTP client the openai package ships on
import openai
import pytest

from server_utils import MODEL, Server, Tracebacks, free_port, wait_until

from dspark import LLM
from dspark.cli import main as cli_main

PROMPTS = ["What is 12 times 7? Answer briefly.", "Name three colors of the rainbow."]


@pytest.fixture(scope="module")
def tracebacks():
    handler = Tracebacks()
    logging.getLogger().addHandler(handler)
    yield handler
    logging.getLogger().removeHandler(handler)


@pytest.fixture(scope="module")
def server(tracebacks):
    srv = Server(LLM(dtype="bf16", drafter="prompt-lookup", max_num_seqs=4), max_waiting=2,
                 max_completion_tokens=400, max_prompt_tokens=1000, max_body_bytes=1 << 16)
    srv.thread.start()
    assert wait_until(lambda: srv.uvicorn.started, 60)
    yield srv
    srv.uvicorn.should_exit = True
    srv.thread.join(30)
    assert not tracebacks.records, [r.getMessage() for r in tracebacks.records]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy_chat(client, prompt: str, max_tokens: int = 24, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                          temperature=0, max_tokens=max_tokens, **kw)


# ---- the API as clients use it ----------------------------------------------------------------------
def test_chat_completion_with_usage(client, server):
    r = greedy_chat(client, PROMPTS[0], max_tokens=12)
    assert r.object == "chat.completion" and r.model == MODEL
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    prompt_ids = server.llm.chat_prompt(PROMPTS[0])
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 12


def test_completion_with_usage_and_token_prompt(client, server):
    text = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=text, temperature=0, max_tokens=8)
    assert r.object == "text_completion" and r.choices[0].text
    ids = server.llm.tokenizer.encode(text, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens <= 8
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=8)
    assert by_ids.choices[0].text == r.choices[0].text


def test_streaming_equals_non_streaming(client):
    whole = greedy_chat(client, PROMPTS[1])
    chunks = list(greedy_chat(client, PROMPTS[1], stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    plain = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=16)
    streamed = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=16,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text


def test_stop_strings(client):
    full = greedy_chat(client, PROMPTS[1], max_tokens=32).choices[0].message.content
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    cut = greedy_chat(client, PROMPTS[1], max_tokens=32, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[:full.index(stop)]
    streamed = greedy_chat(client, PROMPTS[1], max_tokens=32, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == full[:full.index(stop)]


def test_seeds_are_reproducible(client):
    def sample(seed):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}],
                                              temperature=1.0, top_p=0.95, seed=seed, max_tokens=20,
                                              extra_body={"top_k": 50}).choices[0].message.content
    a, b = sample(7), sample(7)
    assert a == b
    assert len({a, sample(8), sample(9)}) > 1


def test_n_choices_share_one_prefill_and_replay_with_their_seed(client, server):
    """n = 3 answers with 3 different samples (choice i samples with seed + i) from one prefill; the same request
    again, streamed or not, gives the same choices; usage counts every choice. (Each choice equals its seed's sample
    alone only up to rounding, which in bf16 can move a sample: the float32 engine test checks that equality.)"""
    kw = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[1]}], "temperature": 1.0, "seed": 5,
          "max_tokens": 12}
    server.llm.engine.stats.clear()
    many = client.chat.completions.create(n=3, **kw)
    assert server.llm.engine.stats[0].prefill_tokens == many.usage.prompt_tokens  # one prefill for three
    assert [c.index for c in many.choices] == [0, 1, 2]
    texts = [c.message.content for c in many.choices]
    assert len(set(texts)) == 3
    assert [c.message.content for c in client.chat.completions.create(n=3, **kw).choices] == texts
    assert 3 <= many.usage.completion_tokens <= 36
    assert many.usage.prompt_tokens == len(server.llm.chat_prompt(PROMPTS[1]))
    chunks = list(client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)]
    assert streamed == texts
    assert chunks[-1].usage.completion_tokens == many.usage.completion_tokens
    completions = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=1.0, n=2,
                                            max_tokens=8)
    assert [c.index for c in completions.choices] == [0, 1] and all(c.text for c in completions.choices)
    assert wait_until(server.idle)


def test_greedy_answers_equal_dspark_generate(client):
    for prompt in PROMPTS:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli_main(["generate", "--quiet", "--max-tokens", "24", "--drafter", "prompt-lookup", prompt]) == 0
        assert greedy_chat(client, prompt).choices[0].message.content == out.getvalue()[:-1]  # less the newline


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics").text
    for name in ("dspark_requests_total", "dspark_generation_tokens_total", "dspark_waiting_requests",
                 "dspark_running_requests", "dspark_kv_cache_slots_used", "dspark_step_seconds_bucket", "dspark_verify_batch_tokens_bucket",
                 "dspark_acceptance_length_bucket", "dspark_drafts_verified_per_step_bucket"):
        assert name in text, name


# ---- bad input ----------------------------------------------------------------------------------------
BAD = [
    ("malformed json", b'{"model": "smollm2", "messages": [', 400),
    ("missing messages", {"model": MODEL}, 400),
    ("missing model", {"messages": [{"role": "user", "content": "hi"}]}, 400),
    ("wrong type", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400),
    ("negative max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, 400),
    ("huge max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, 400),
    ("temperature out of range", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 7}, 400),
    ("top_p out of range", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400),
    ("n = 0", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 0}, 400),
    ("n over the server's limit", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 7}, 400),
    ("unknown model", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("empty message list", {"model": MODEL, "messages": []}, 400),
    ("unknown role", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
]


@pytest.mark.parametrize("name,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_chat_input_gets_a_clear_4xx(server, name, body, status):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text


@pytest.mark.parametrize("body", [{"model": MODEL, "prompt": ""}, {"model": MODEL, "prompt": [10**9]},
                                  {"model": MODEL, "prompt": "hi", "max_tokens": 0}])
def test_bad_completion_input_gets_a_clear_400(server, body):
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"], r.text


def test_server_keeps_serving_after_bad_input(server, client):
    for _, body, _ in BAD[:4]:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        httpx.post(server.url + "/v1/chat/completions", timeout=30, **kw)
    assert greedy_chat(client, PROMPTS[0], max_tokens=4).choices[0].message.content
    assert wait_until(server.idle)


# ---- disconnects and limits ---------------------------------------------------------------------------
def metric(server, line_start: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.split()[-1])
    return 0.0


def test_a_dropped_stream_frees_its_request(server):
    aborted = metric(server, 'dspark_requests_total{finish_reason="abort"}')
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert server.llm.engine.running  # generating right now
    assert wait_until(server.idle, 30), "the dropped request is still running"
    drafter = server.llm.engine.drafter
    assert getattr(drafter, "context_len", {}) == {}
    assert metric(server, "dspark_running_requests") == 0 and metric(server, "dspark_kv_cache_slots_used") == 0
    assert metric(server, 'dspark_requests_total{finish_reason="abort"}') == aborted + 1


def test_over_the_limit_the_answer_is_429(server, client):
    """4 running plus 2 waiting fit; the 7th request in flight is refused, then the server recovers."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to one hundred in words."}],
            "max_tokens": 300, "temperature": 0, "stream": True}
    with contextlib.ExitStack() as stack:
        for _ in range(6):
            r = stack.enter_context(httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60))
            assert r.status_code == 200
        over = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=30)
        assert over.status_code == 429 and over.json()["error"]["type"] == "rate_limit_error"
    assert wait_until(server.idle, 30)
    assert greedy_chat(client, PROMPTS[0], max_tokens=4).choices[0].message.content


# ---- shutdown -----------------------------------------------------------------------------------------
def test_sigterm_finishes_running_requests_and_exits_zero(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dspark.cli", "serve", "--port", str(port), "--model-name", MODEL,
                             "--drafter", "none", "--graceful-seconds", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{port}"

        def up():
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        assert wait_until(up, 120, 0.25), proc.stdout.read1().decode() if proc.poll() is not None else "no server"
        body = {"model": MODEL, "prompt": "One, two, three,", "max_tokens": 40, "temperature": 0, "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            events.append(next(lines))
            proc.send_signal(signal.SIGTERM)
            events += [e for e in lines if e]
        assert events[-1] == "data: [DONE]"  # the running request finished
        finals = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events if e.startswith("data: {")]
        assert finals[-1] == "length"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- the rest of the API: logprobs, content parts, prompt lists, parameters refused -------------------------
def chat_body(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "temperature": 0, "max_tokens": 10,
            **kw}


def test_logprobs_are_the_targets_and_stream_like_the_whole(client):
    whole = greedy_chat(client, PROMPTS[0], max_tokens=10, logprobs=True, top_logprobs=3)
    entries = whole.choices[0].logprobs.content
    assert len(entries) == whole.usage.completion_tokens
    for e in entries:  # greedy: the chosen token is a most likely one (bf16 logits can tie)
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob == e.logprob and e.token in [t.token for t in e.top_logprobs
                                                                      if t.logprob == e.logprob]
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    assert b"".join(bytes(e.bytes) for e in entries).decode() == whole.choices[0].message.content
    chunks = list(greedy_chat(client, PROMPTS[0], max_tokens=10, logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    assert greedy_chat(client, PROMPTS[0], max_tokens=4).choices[0].logprobs is None
    text = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=8, logprobs=2)
    lp = text.choices[0].logprobs
    assert "".join(lp.tokens) == text.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0


def test_content_parts_developer_role_and_prompt_lists(client, server):
    plain = greedy_chat(client, PROMPTS[0], max_tokens=8).choices[0].message.content
    parts = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=8,
        messages=[{"role": "user", "content": [{"type": "text", "text": PROMPTS[0]}]}])
    assert parts.choices[0].message.content == plain
    system = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[0]}]).choices[0].message.content
    developer = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": PROMPTS[0]}])
    assert developer.choices[0].message.content == system
    prompts = ["Once upon a time", "The capital of France is"]
    alone = [client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=6).choices[0].text
             for p in prompts]
    both = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=6, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [alone[0], alone[0], alone[1], alone[1]]
    ids = [server.llm.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    assert both.usage.prompt_tokens == sum(map(len, ids))
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=6)
    assert [c.text for c in by_ids.choices] == alone


REFUSED = [
    ("logit_bias", {"logit_bias": {"42": 5}}, 400, "logit_bias"),
    ("presence penalty", {"presence_penalty": 0.5}, 400, "presence_penalty"),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("response format", {"response_format": {"type": "json_object"}}, 400, "response_format"),
    ("unknown argument", {"frobnicate": 1}, 400, "frobnicate"),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, None),
    ("tool role", {"messages": [{"role": "tool", "content": "x"}]}, 400, None),
    ("max_tokens over the limit", {"max_tokens": 401}, 400, "max_tokens"),
    ("prompt over the limit", {"messages": [{"role": "user", "content": "word " * 1200}]}, 400, "messages"),
    ("n over max_n", {"n": 17}, 400, "n"),
    ("top_logprobs over 20", {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
]


@pytest.mark.parametrize("name,extra,status,param", REFUSED, ids=[r[0] for r in REFUSED])
def test_parameters_the_server_does_not_implement_are_refused(server, name, extra, status, param):
    r = httpx.post(server.url + "/v1/chat/completions", json=chat_body(**extra), timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param), err


def test_neutral_values_of_unimplemented_parameters_pass(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json=chat_body(
        max_tokens=3, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, user="me", tool_choice="none"))
    assert r.status_code == 200, r.text


def test_extreme_sampling_values_answer_and_never_hurt_the_batch(server):
    """A tiny temperature (once NaN probabilities and a 500 for the whole batch), a huge top_k and a huge seed, sent
    together with ordinary requests: every one is answered."""
    bodies = [chat_body(temperature=1e-40, max_tokens=8), chat_body(temperature=1.0, top_k=2**63, seed=2**64),
              chat_body(max_tokens=8), chat_body(temperature=0.7, seed=-5, max_tokens=8)]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: httpx.post(server.url + "/v1/chat/completions", json=b, timeout=120),
                                bodies))
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert all(a.json()["choices"][0]["message"]["content"] for a in answers)


def test_request_bodies_over_the_limit_get_413(server):
    big = chat_body(messages=[{"role": "user", "content": "x" * 70_000}])
    r = httpx.post(server.url + "/v1/chat/completions", json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    chunked = httpx.post(server.url + "/v1/chat/completions", timeout=30, headers={"content-type": "application/json"},
                         content=iter([json.dumps(big).encode()[i:i + 8192] for i in range(0, 80_000, 8192)]))
    assert chunked.status_code == 413
    assert httpx.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=2), timeout=30).status_code == 200


def test_unknown_routes_and_methods_get_the_error_shape(server):
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405)]:
        r = httpx.request(method, server.url + path, timeout=10)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_non_streaming_client_that_leaves_frees_its_request_at_once(server):
    """The client gives up after 1 s of a long answer: the request is aborted within a step or two, with no
    traceback in the log (the module's fixture checks the log), and its tokens count as generated."""
    tokens = metric(server, "dspark_generation_tokens_total")
    body = chat_body(messages=[{"role": "user", "content": "Write a long story about a dragon."}], max_tokens=400)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1.0)
    start = time.time()
    assert wait_until(server.idle, 10)
    assert time.time() - start < 1.0, "the request outlived its client by more than a second"
    assert metric(server, "dspark_generation_tokens_total") > tokens


@pytest.fixture(scope="module")
def keyed_server(server):
    srv = Server(server.llm.sibling("prompt-lookup", max_num_seqs=2), max_waiting=2, api_key="sesame")
    srv.thread.start()
    assert wait_until(lambda: srv.uvicorn.started, 60)
    yield srv
    srv.uvicorn.should_exit = True
    srv.thread.join(30)


def test_with_an_api_key_every_route_but_health_needs_it(keyed_server):
    url = keyed_server.url
    for method, path in [("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/metrics"),
                         ("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/"), ("GET", "/v1/live"),
                         ("GET", "/v1/live?key=wrong"), ("GET", "/metrics?key=sesame")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            r = httpx.request(method, url + path, headers=headers, json=chat_body(max_tokens=2), timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    good = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0, timeout=60)
    assert greedy_chat(good, PROMPTS[0], max_tokens=3).choices[0].message.content
    assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer sesame"}, timeout=10).status_code == 200
    assert httpx.get(url + "/?key=sesame", timeout=10).status_code == 200  # the page (a browser sends no header)


# ---- fuzz ---------------------------------------------------------------------------------------------
FUZZ_SEED, FUZZ_COUNT = 20261207, 1200
WEIRD = [None, True, False, 0, -1, 1, 2, 3, 1.5, -0.0, 1e-40, 1e308, -1e308, 2**31, 2**63, 2**64, -2**63, 10**40,
         "", "x", "2", "NaN", "Infinity", "\ud800", "é" * 3, "\x00", "a" * 5000, [], [1], [[]], ["x"], [None], {},
         {"type": "text"}, {"a": {"b": {"c": [1, [2, [3]]]}}}, [[[[[[[[[[1]]]]]]]]]]]
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs", "logit_bias", "user", "tools",
          "presence_penalty", "echo", "best_of", "response_format", "unknown_field"]


def fuzz_request(rng: random.Random) -> tuple[str, str, bytes, dict]:
    """(method, path, body, headers): a valid small request with 1-3 random mutations, or raw junk."""
    path = rng.choice(["/v1/chat/completions", "/v1/completions"])
    headers = {"content-type": "application/json"}
    kind = rng.random()
    if kind < 0.08:  # not JSON, or JSON that is not an object
        body = rng.choice([b"", b"{", b"}", b"null", b"[1, 2]", b"42", b'"text"', b"\xff\xfe\x00",
                           bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))), b'{"model": ' * 50])
        return "POST", path, body, headers
    if kind < 0.11:  # other routes and methods
        return rng.choice(["GET", "PUT", "DELETE", "PATCH"]), rng.choice([path, "/", "/v1", "/v2/x", "/metrics/..",
                                                                        "/v1/models/x"]), b"", headers
    body: dict = {"model": MODEL, "max_tokens": rng.choice([1, 2, 3]), "temperature": rng.choice([0, 0.8])}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    else:
        body["prompt"] = rng.choice(["Once upon a time", [1, 2, 3], ["a", "b"]])
    for _ in range(rng.randint(1, 3)):
        field = rng.choice(FIELDS)
        action = rng.random()
        if action < 0.15:
            body.pop(field, None)
        elif action < 0.25 and field == "messages":
            body["messages"] = [{"role": rng.choice(["user", "assistant", "system", "x", None]),
                                 "content": rng.choice(WEIRD)} for _ in range(rng.randint(0, 3))]
        else:
            body[field] = rng.choice(WEIRD)
    if rng.random() < 0.03:
        headers["content-type"] = rng.choice(["text/plain", "application/x-www-form-urlencoded", ""])
    raw = json.dumps(body).encode() if rng.random() > 0.05 else json.dumps(body).encode()[:-rng.randint(1, 5)]
    return "POST", path, raw, headers


def test_fuzzed_requests_never_get_5xx_and_the_server_goes_on(server, client, report):
    """FUZZ_COUNT seeded random malformed and adversarial requests, 4 at a time: no 5xx, every answer JSON with the
    error shape (or a valid answer or stream), no traceback in the log (the module fixture checks it at the end), and
    a normal request afterwards is answered as before."""
    before = greedy_chat(client, PROMPTS[0], max_tokens=8).choices[0].message.content
    rng = random.Random(FUZZ_SEED)
    cases = [fuzz_request(rng) for _ in range(FUZZ_COUNT)]
    http = httpx.Client(base_url=server.url, timeout=60)

    def send(case):
        method, path, body, headers = case
        r = http.request(method, path, content=body, headers=headers)
        return case, r.status_code, r.headers.get("content-type", ""), r.text

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(send, cases))
    statuses: dict[int, int] = {}
    for (method, path, body, _), status, ctype, text in results:
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, (method, path, body[:200], text[:300])
        if ctype.startswith("text/event-stream"):
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and all(json.loads(e) for e in events[:-1])
            continue
        if ctype.startswith("text/html"):  # GET /: the live page
            assert method == "GET" and path in ("/", "/metrics/..") and text.startswith("<!doctype html>")
            continue
        payload = json.loads(text)
        if status >= 400:
            assert set(payload["error"]) == {"message", "type", "param", "code"} and payload["error"]["message"]
        assert "Traceback" not in text
    report(f"fuzz: {FUZZ_COUNT} requests (seed {FUZZ_SEED}), statuses {dict(sorted(statuses.items()))}")
    assert statuses.get(200, 0) >= 50 and sum(v for k, v in statuses.items() if 400 <= k < 500) >= 500
    assert wait_until(server.idle, 30)
    assert greedy_chat(client, PROMPTS[0], max_tokens=8).choices[0].message.content == before
