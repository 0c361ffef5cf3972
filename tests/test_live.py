"""The live page of `dspark serve` (serve/live.py, serve/static/live.html): the page ships whole (no external
assets), its event stream follows the engine's steps and agrees with /metrics, it works with no drafter and on an
idle server, a closed page frees its stream, and the online calibration shows in the stream and in /metrics."""
from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import time

import httpx2 as httpx
import openai
import pytest
from server_utils import MODEL, Server, wait_until

from dspark import LLM

PROMPTS = ["Write a short poem about the sea.", "List the first ten prime numbers.", "Explain what a CPU does.",
           "What is 17 times 23? Show the steps."]


@pytest.fixture(scope="module")
def live_server():
    """The bundled DSpark drafter (a confidence head) under the async scheduler, the calibration window small
    enough to be checked within the test."""
    srv = Server(LLM(dtype="bf16", drafter="default", scheduler="async", max_num_seqs=4, profile=False), max_waiting=8)
    monitor = srv.llm.engine.drift
    monitor.min_rows, monitor.wait, monitor.check_every = 4, 4, 1
    srv.thread.start()
    assert wait_until(lambda: srv.uvicorn.started, 60)
    yield srv
    srv.uvicorn.should_exit = True
    srv.thread.join(30)


def events(url: str, seconds: float, history: int = 300):
    """The snapshots the event stream sends in `seconds`."""
    out = []
    with httpx.stream("GET", url + f"/v1/live?history={history}", timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        end = time.time() + seconds
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
            if time.time() > end:
                break
    return out


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_the_page_ships_whole_without_external_assets(live_server):
    r = httpx.get(live_server.url + "/", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert 'new EventSource("/v1/live"' in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page) and "@import" not in page
    for figure in ("tokens-per-s", "running", "waiting", "kv", "requests-finished", "generation-tokens", "reliability",
                   "cost", "follow"):
        assert f'id="{figure}"' in page


def test_the_stream_follows_the_steps_and_agrees_with_metrics(live_server):
    url = live_server.url
    idle = events(url, 0.6)
    assert idle and idle[0]["totals"]["running"] == 0 and idle[0]["cost"]["B"]
    before = idle[-1]["totals"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = pool.map(lambda p: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=40), PROMPTS)
        seen = events(url, 4.0, history=0)
        answers = list(running)
    assert wait_until(live_server.idle, 30)
    records = [r for snap in seen for r in snap["records"]]
    steps = [r for r in records if r.get("R")]
    assert steps and max(r["running"] for r in records) >= 2
    for r in steps:
        assert r["B"] == r["R"] + r["verified"] and len(r["lengths"]) == r["R"] and sum(r["lengths"]) == r["verified"]
        assert 0 <= r["accepted"] <= r["verified"] <= r["proposed"] or r["skipped"]
    # one request followed: its new tokens, step after step, are a piece of its answer
    first = next(r["words"]["id"] for r in steps if r.get("words"))
    followed = "".join("".join(r["words"]["new"]) for r in steps if r.get("words", {}).get("id") == first)
    followed = followed.replace("<|im_end|>", "").strip()  # the end token is shown on the page, not in the text
    assert followed and any(followed in a.choices[0].message.content for a in answers)
    after = events(url, 0.6, history=0)[-1]["totals"]
    assert after["requests"] - before["requests"] == len(PROMPTS)
    assert after["requests"] == metric(url, "dspark_requests_total")
    assert after["generation_tokens"] == metric(url, "dspark_generation_tokens_total")
    assert after["generation_tokens"] - before["generation_tokens"] == sum(a.usage.completion_tokens for a in answers)
    calibration = events(url, 0.6, history=0)[-1]["calibration"]
    assert calibration["rows"] > 0 and not calibration["refit"]  # watched, not re-fitted: the default
    assert calibration["positions"] and calibration["positions"][0]["bins"]
    assert calibration["ece"] is not None and calibration["ece"] == pytest.approx(
        metric(url, "dspark_calibration_window_ece"), rel=1e-6)


def test_a_closed_page_frees_its_stream(live_server):
    feed = live_server.loop_engine.feed
    assert wait_until(lambda: feed.clients == 0, 5)
    with httpx.stream("GET", live_server.url + "/v1/live", timeout=30) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
        assert feed.clients == 1
    assert wait_until(lambda: feed.clients == 0, 5)


def test_the_page_works_with_no_drafter_and_an_idle_server(live_server):
    srv = Server(live_server.llm.sibling("none", max_num_seqs=2), max_waiting=2)
    srv.thread.start()
    try:
        assert wait_until(lambda: srv.uvicorn.started, 60)
        snap = events(srv.url, 1.2)[-1]
        assert snap["calibration"] is None and snap["totals"]["drafter"] == "NoDrafter" and snap["records"] == []
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
        steps = [r for s in events(srv.url, 0.6) for r in s["records"] if r.get("R")]
        assert steps and all(r["proposed"] == r["verified"] == 0 and r["B"] == r["R"] for r in steps)
        assert httpx.get(srv.url + "/", timeout=10).status_code == 200
    finally:
        srv.uvicorn.should_exit = True
        srv.thread.join(30)


# ---- in a real browser ------------------------------------------------------------------------------------
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (Debian's chromium and chromium-driver, which .ci/run installs) through selenium, given the
    driver's path so that nothing is downloaded."""
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("no chromium/chromedriver on this machine (apt-get install chromium chromium-driver; CI has them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1200"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def page_figures(driver) -> dict[str, str]:
    return {name: driver.find_element("id", name).text for name in
            ("running", "waiting", "requests-finished", "generation-tokens", "steps-seen", "status", "ece-line")}


def page_follows_the_server(driver, url: str, timeout: float = 30) -> bool:
    """Open the page, answer two requests, and wait for the page's figures to change and to equal /metrics."""
    driver.get(url + "/")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda p: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=24), PROMPTS[:2]))
    want = {"requests-finished": str(int(metric(url, "dspark_requests_total"))),
            "generation-tokens": str(int(metric(url, "dspark_generation_tokens_total"))), "running": "0"}
    return wait_until(lambda: all(page_figures(driver)[k] == v for k, v in want.items())
                      and int(page_figures(driver)["steps-seen"]) > 0, timeout, every=0.25)


def test_the_page_in_a_real_browser_shows_what_metrics_says(live_server, browser, monkeypatch, tmp_path):
    """The page's figures change as requests run and end equal to /metrics; a screenshot of it is kept. With the event
    stream broken (every snapshot raises) the same check fails: the page's figures come from the stream alone."""
    assert page_follows_the_server(browser, live_server.url), page_figures(browser)
    figures = page_figures(browser)
    assert figures["status"].startswith("live") and "ECE" in figures["ece-line"]
    browser.save_screenshot(str(tmp_path / "live.png"))
    assert (tmp_path / "live.png").stat().st_size > 10_000

    def broken(since):
        raise RuntimeError("stream broken for the test")

    monkeypatch.setattr(live_server.loop_engine.feed, "snapshot", broken)
    assert not page_follows_the_server(browser, live_server.url, timeout=5)
    assert page_figures(browser)["requests-finished"] == "-"
