"""Calibration drift and the live page's cost.

Drift: the bundled DSpark drafter (STS temperatures fitted offline) under the async scheduler serves prompts of the
calibration domain, then prompts of a shifted one, at each R, in two engines side by side (chunk by chunk, the order
alternating): with the offline calibration only (the monitor checks but never re-fits) and with online re-fit
(schedule/drift.py). Per run: the window ECE at every check (plot),
throughput in the shifted phase, the step of the first re-fit after the shift (detection delay). A long run of the
calibration domain alone with re-fit on counts false alarms.

Page: `dspark serve` in this process answers the same concurrent requests with the step feed off, on with no page
open, and on with `--pages` pages reading the event stream, interleaved: page_overhead = 1 - tokens/s with the pages
open / tokens/s with the feed off; and page_cpu_share, the time spent in the feed's code per second of serving with
the pages open (under the GIL an upper bound on their cost, free of the machine's noise).

Headline: drift_ece_static and drift_ece_refit (the window ECE at the end of the shifted phase, mean over R),
drift_refit_over_static_throughput (the minimum over R), drift_detection_steps (the maximum over R),
drift_false_alarms, page_overhead, page_cpu_share.

    python benchmarks/drift.py                 # R = 1, 4, 16; mt-bench, then humaneval + mbpp
    python benchmarks/drift.py --quick         # smoke test
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import statistics
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx2 as httpx  # noqa: E402
import uvicorn  # noqa: E402

from benchmarks.common import (DEFAULT_DATA_DIR, RESULTS_DIR, Log, add_presets, apply_presets, finish,  # noqa: E402
                               load_prompts, markdown_table, result_header, result_preamble, spread)
from benchmarks.serve_load import free_port  # noqa: E402
from dspark import LLM, SamplingParams  # noqa: E402
from dspark.config import DTYPE_CHOICES  # noqa: E402
from dspark.schedule.drift import DriftMonitor  # noqa: E402
from dspark.serve.app import build_app  # noqa: E402
from dspark.serve.settings import ServerSettings  # noqa: E402

FULL = {"concurrency": "1,4,16", "calibration_prompts": 24, "shifted_prompts": 24, "long_prompts": 80,
        "max_new_tokens": 96, "window": 600, "min_rows": 150, "check_every": 10, "page_requests": 8,
        "page_repeats": 5, "pages": 20}
QUICK = {"concurrency": "2", "calibration_prompts": 2, "shifted_prompts": 2, "long_prompts": 2, "max_new_tokens": 8,
         "window": 40, "min_rows": 4, "check_every": 1, "page_requests": 2, "page_repeats": 1, "pages": 2}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_presets(p, FULL, QUICK)
    p.add_argument("--calibration-sets", default="mt-bench", help="the domain the offline calibration stands for")
    p.add_argument("--shifted-sets", default="humaneval,mbpp", help="the shifted domain")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", default="bf16", choices=DTYPE_CHOICES)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    p.add_argument("--out", default=str(RESULTS_DIR / "drift"))
    return apply_presets(p.parse_args(argv), FULL, QUICK)


# ---- drift ---------------------------------------------------------------------------------------------
class Arm:
    """One engine (the bundled drafter, async scheduler, R requests at once) and its calibration monitor; the
    tokens and seconds it spent per phase."""

    def __init__(self, base: LLM, R: int, refit: bool, args):
        self.llm = base.sibling("default", "async", max_num_seqs=R)
        self.monitor = DriftMonitor.for_drafter(self.llm.engine.drafter, refit=refit, window=args.window,
                                                min_rows=args.min_rows, check_every=args.check_every)
        self.llm.engine.watch_calibration(self.monitor)
        self.row = {"R": R, "arm": "refit" if refit else "static"}
        self.trace: list[dict] = []
        self.tokens: dict[str, int] = {}
        self.seconds: dict[str, float] = {}

    def serve(self, prompts: list[list[int]], first_seed: int, params: SamplingParams, phase: str) -> None:
        """Answer the prompts (R at a time) and append each check of the monitor to the trace."""
        engine, state = self.llm.engine, self.monitor.state
        start = time.perf_counter()
        reqs = [engine.add_request(ids, dataclasses.replace(params, seed=first_seed + i)) for i, ids in enumerate(prompts)]
        last = (state.ece, state.bound, state.refits)
        while engine.has_unfinished():
            engine.step()
            if (state.ece, state.bound, state.refits) != last:
                last = (state.ece, state.bound, state.refits)
                self.trace.append({"phase": phase, "step": state.steps, "ece": state.ece, "bound": state.bound,
                                   "refits": state.refits})
        self.tokens[phase] = self.tokens.get(phase, 0) + sum(len(r.output_ids) for r in reqs)
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def result(self) -> dict:
        row, state = dict(self.row), self.monitor.state
        for phase in self.tokens:
            row[f"{phase}_tokens_per_s"] = self.tokens[phase] / self.seconds[phase]
        row["trace"], row["alarms"], row["refits"] = self.trace, state.alarms, state.refits
        shifted = [t for t in self.trace if t["phase"] == "shifted"]
        row["ece_end"] = shifted[-1]["ece"] if shifted else None
        begin = row.get("shifted_start_step")
        refits = [e.step for e in state.events if e.kind == "refit" and begin is not None and e.step >= begin]
        row["detection_steps"] = refits[0] - begin if refits else None
        return row


def drift_runs(base: LLM, R: int, arms_refit: list[bool], phases: list[tuple[str, list[list[int]]]], args) -> list[dict]:
    """The arms side by side: each phase's prompts in chunks of 2R, every chunk through each arm in turn (the order
    alternating), so that the machine's drifts in speed fall on both alike."""
    arms = [Arm(base, R, refit, args) for refit in arms_refit]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens)
    for phase, prompts in phases:
        for arm in arms:
            arm.row[f"{phase}_start_step"] = arm.monitor.state.steps
        size = 2 * R
        for i, first in enumerate(range(0, len(prompts), size)):
            for arm in arms if i % 2 == 0 else arms[::-1]:
                arm.serve(prompts[first:first + size], first, params, phase)
    return [arm.result() for arm in arms]


# ---- the page's cost -------------------------------------------------------------------------------------
class InProcessServer:
    def __init__(self, llm: LLM):
        self.app = build_app(llm, ServerSettings("dspark", max_waiting=64))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]),
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


def read_pages(url: str, n: int, stop: threading.Event) -> list[threading.Thread]:
    def page():
        with httpx.stream("GET", url + "/v1/live", timeout=60) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return
    threads = [threading.Thread(target=page, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def timed_requests(url: str, prompts: list[str], max_tokens: int) -> float:
    """tokens/s of the prompts sent at once (greedy)."""
    def one(prompt):
        r = httpx.post(url + "/v1/chat/completions", json={"model": "dspark", "max_tokens": max_tokens, "temperature": 0,
                                                          "messages": [{"role": "user", "content": prompt}]}, timeout=600)
        return r.json()["usage"]["completion_tokens"]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(pool.map(one, prompts))
    return tokens / (time.perf_counter() - start)


class PageClock:
    """Seconds spent in the feed's code (each step's record; each event's snapshot and its JSON), which under the GIL
    the engine thread waits for: an upper bound on what the page costs decoding, free of the machine's noise."""

    def __init__(self, feed):
        self.seconds = 0.0
        record, snapshot = feed.record, feed.snapshot

        def timed_record(*a):
            t0 = time.perf_counter()
            record(*a)
            self.seconds += time.perf_counter() - t0

        def timed_snapshot(since):
            t0 = time.perf_counter()
            snap = snapshot(since)
            json.dumps(snap, default=str)  # what the route then does with it
            self.seconds += time.perf_counter() - t0
            return snap

        feed.record, feed.snapshot = timed_record, timed_snapshot


def page_cost(base: LLM, prompts: list[str], args, log) -> dict:
    srv = InProcessServer(base.sibling("default", "async", max_num_seqs=len(prompts)))
    feed = srv.app.state.engine.feed
    clock = PageClock(feed)
    rates = {"feed_off": [], "feed_on": [], "pages_open": []}
    shares = {"feed_on": [], "pages_open": []}
    try:
        timed_requests(srv.url, prompts[:1], 4)  # warm-up
        for rep in range(args.page_repeats):
            conditions = list(rates) if rep % 2 == 0 else list(reversed(rates))
            for condition in conditions:
                srv.app.state.engine.feed = None if condition == "feed_off" else feed
                stop = threading.Event()
                pages = read_pages(srv.url, args.pages, stop) if condition == "pages_open" else []
                clock.seconds, start = 0.0, time.perf_counter()
                rates[condition].append(timed_requests(srv.url, prompts, args.max_new_tokens))
                if condition in shares:
                    shares[condition].append(clock.seconds / (time.perf_counter() - start))
                stop.set()
                for t in pages:
                    t.join(5)
            log(f"page cost: repeat {rep + 1}/{args.page_repeats}: " +
                ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in rates.items()))
    finally:
        srv.stop()
    off = statistics.median(rates["feed_off"])
    return {"tokens_per_s": {k: spread(v) for k, v in rates.items()},
            "feed_overhead": 1 - statistics.median(rates["feed_on"]) / off,
            "page_overhead": 1 - statistics.median(rates["pages_open"]) / off,
            "page_cpu_share": {k: spread(v) for k, v in shares.items()}}


def markdown(result: dict) -> str:
    s, h = result["settings"], result["headline"]
    rows = [{k: v for k, v in r.items() if k != "trace"} for r in result["rows"]]
    cols = ["R", "arm", "calibration_tokens_per_s", "shifted_tokens_per_s", "ece_end", "alarms", "refits",
            "detection_steps"]
    page = result["page"]
    return (result_preamble(result) + f"\nCalibration domain {s['calibration_sets']} ({s['calibration_prompts']} "
            f"prompts), then {s['shifted_sets']} ({s['shifted_prompts']} prompts), T = {s['temperature']}, "
            f"{s['max_new_tokens']} tokens, the async scheduler; window {s['window']} request-steps, checked every "
            f"{s['check_every']} steps from {s['min_rows']} rows. ece_end: the window's pooled ECE at the last check "
            "of the shifted phase; detection_steps: engine steps from the shift to the first re-fit.\n\n"
            + markdown_table(rows, cols) + f"\n\nFalse alarms on {s['long_prompts']} prompts of the calibration domain "
            f"alone, re-fit on: {result['false_alarm_run']['alarms']}.\n\nThe page: {s['page_requests']} concurrent "
            f"requests, {s['page_repeats']} interleaved repeats; tokens/s median [min, max]: " +
            ", ".join(f"{k} {v['median']:.1f} [{v['min']:.1f}, {v['max']:.1f}]" for k, v in page["tokens_per_s"].items())
            + f" ({s['pages']} pages open in the last). Time in the feed's code (records, snapshots and their JSON) "
            "per second of serving, median [min, max]: " + ", ".join(
                f"{k} {v['median']:.4f} [{v['min']:.4f}, {v['max']:.4f}]" for k, v in page["page_cpu_share"].items())
            + ".\n\nHeadline: " + ", ".join(f"`{k}` {v}" for k, v in h.items())
            + "\n\n![window ECE](drift_ece.png)\n")


def plot_ece(result: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Rs = sorted({r["R"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(Rs), figsize=(4.2 * len(Rs), 3.2), squeeze=False)
    for ax, R in zip(axes[0], Rs):
        for row in (r for r in result["rows"] if r["R"] == R):
            pts = [t for t in row["trace"] if t["ece"] is not None]
            ax.plot([t["step"] for t in pts], [t["ece"] for t in pts], marker=".", label=row["arm"])
            if "shifted_start_step" in row:
                ax.axvline(row["shifted_start_step"], color="grey", lw=0.8, ls="--")
        ax.set_title(f"R = {R}", fontsize=9)
        ax.set_xlabel("engine step")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("window ECE")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    log = Log()
    base = LLM(dtype=args.dtype, max_num_seqs=1, threads=args.threads, profile=False)
    chat = [base.chat_prompt(p["text"]) for p in load_prompts(args.data_dir, args.calibration_prompts,
                                                               tuple(args.calibration_sets.split(",")))]
    shifted = [base.chat_prompt(p["text"]) for p in load_prompts(args.data_dir, args.shifted_prompts,
                                                                  tuple(args.shifted_sets.split(",")))]
    long_chat = [base.chat_prompt(p["text"]) for p in load_prompts(args.data_dir, args.long_prompts,
                                                                    tuple(args.calibration_sets.split(",")))]
    rows = []
    for R in [int(x) for x in args.concurrency.split(",")]:
        rows += drift_runs(base, R, [False, True], [("calibration", chat), ("shifted", shifted)], args)
        for r in rows[-2:]:
            log(f"R = {R} {r['arm']}: shifted {r['shifted_tokens_per_s']:.1f} tok/s, ECE at the end {r['ece_end']}, "
                f"refits {r['refits']}, detection {r['detection_steps']} steps")
    false_run = drift_runs(base, max(r["R"] for r in rows), [True], [("calibration", long_chat)], args)[0]
    log(f"false-alarm run: {false_run['alarms']} alarms over {len(long_chat)} prompts")
    page_prompts = [p["text"] for p in load_prompts(args.data_dir, args.page_requests)]
    page = page_cost(base, page_prompts, args, log)
    result = result_header("drift", __file__, sys.argv[1:] if argv is None else argv)
    result["settings"] = {k: getattr(args, k) for k in (*FULL, "calibration_sets", "shifted_sets", "temperature",
                                                        "dtype", "threads")}
    result["rows"], result["page"] = rows, page
    result["false_alarm_run"] = {k: v for k, v in false_run.items() if k != "trace"}

    def mean_ece(arm):
        values = [r["ece_end"] for r in rows if r["arm"] == arm and r["ece_end"] is not None]
        return statistics.mean(values) if values else None

    ratios = [next(r for r in rows if r["R"] == R and r["arm"] == "refit")["shifted_tokens_per_s"] /
              next(r for r in rows if r["R"] == R and r["arm"] == "static")["shifted_tokens_per_s"]
              for R in sorted({r["R"] for r in rows})]
    delays = [r["detection_steps"] for r in rows if r["arm"] == "refit"]
    result["headline"] = {"drift_ece_static": mean_ece("static"), "drift_ece_refit": mean_ece("refit"),
                          "drift_refit_over_static_throughput": min(ratios),
                          "drift_detection_steps": None if None in delays else max(delays),
                          "drift_false_alarms": false_run["alarms"], "page_overhead": page["page_overhead"],
                          "page_cpu_share": page["page_cpu_share"]["pages_open"]["median"]}
    return finish(result, args.out, markdown, {"ece": lambda path: plot_ece(result, path)}, log)


if __name__ == "__main__":
    sys.exit(main())
