"""The live view of a running server: the engine's step records in a ring, read by the page at `/` (static/live.html,
no external assets) through server-sent events at GET /v1/live.

StepFeed.record runs on the engine thread after each step and keeps a small dict: time, step milliseconds, running,
waiting and KV slots, and for a decoding step B, R, drafts proposed / verified / accepted, each request's ℓ_r, the
tokens the step emitted, and the batch's first request's verified drafts and new tokens (the page follows one request
with them). snapshot(since) is what one event carries: the records after `since`, and, made once for every page
open, the totals (the server's own Prometheus counters, so the page and /metrics agree), the SPS(B) cost table and
the reliability diagram of the calibration window (schedule/drift.py) with its ECE, bound, alarms and re-fits.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from pathlib import Path

import numpy as np

from ..calibrate import ConfidenceData, cumulative
from ..engine.llm_engine import LLMEngine
from ..engine.stats import StepStats
from .logprobs import TokenText
from .metrics import Metrics

PAGE = Path(__file__).with_name("static") / "live.html"
LIVE_PERIOD = 0.5  # seconds between two events of a stream
RING = 4096  # step records kept
MAX_RECORDS = 512  # records sent in one event at most (a page that fell behind skips the rest)
SHARED_EVERY = 0.25  # seconds the part of an event every page gets alike is reused
RELIABILITY_BINS = 10
COST_POINTS = 48  # points of the cost curve sent


def finite(x: float) -> float | None:
    """x, or None for NaN and infinities (JSON has neither)."""
    return x if np.isfinite(x) else None


def counter_total(counter) -> float:
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


class StepFeed:
    def __init__(self, engine: LLMEngine, metrics: Metrics, token_text: TokenText):
        self.engine, self.metrics, self.token_text = engine, metrics, token_text
        self.records: deque[dict] = deque(maxlen=RING)
        self.count = 0  # records ever made: the next record's index
        self.clients = 0  # event streams open
        self.calibration: tuple[int, dict | None] = (-1, None)  # (monitor step, diagram) of the last computation
        self.shared_part: tuple[float, dict] | None = None  # (time made, the part every page gets)

    # ---- engine thread ---------------------------------------------------------------------------------
    def record(self, st: StepStats | None, seconds: float) -> None:
        e = self.engine
        rec = {"i": self.count, "t": round(time.time(), 3), "ms": round(seconds * 1e3, 2), "running": len(e.running),
               "waiting": len(e.waiting), "kv": e.cache.num_used}
        if st is not None and st.num_requests:
            rec.update(B=st.verify_tokens, R=st.num_requests, proposed=sum(st.drafted), verified=sum(st.verified),
                       accepted=sum(st.accepted), lengths=st.verified, tokens=st.tokens + st.admitted,
                       skipped=st.draft_skipped, first=st.first)
        elif st is not None:
            rec["tokens"] = st.admitted
        self.records.append(rec)
        self.count += 1

    # ---- event stream --------------------------------------------------------------------------------
    def snapshot(self, since: int) -> dict:
        new = max(0, min(self.count - since, MAX_RECORDS, len(self.records)))
        records = list(itertools.islice(reversed(self.records), new))[::-1]  # the ring's newest, in order
        for r in records:
            if r.get("first") and "words" not in r:  # decoded once, on the first read
                request_id, drafts, tokens = r["first"]
                r["words"] = {"id": request_id, "drafts": [self.token_text.text(t) for t in drafts],
                              "new": [self.token_text.text(t) for t in tokens]}
        return {"next": self.count, "records": [{k: v for k, v in r.items() if k != "first"} for r in records],
                **self.shared()}

    def shared(self) -> dict:
        """What every page gets alike (totals, cost curve, calibration), made at most once per SHARED_EVERY seconds
        however many pages are open."""
        now = time.monotonic()
        if self.shared_part is None or now - self.shared_part[0] > SHARED_EVERY:
            e, m = self.engine, self.metrics
            self.shared_part = (now, {
                "totals": {"running": len(e.running), "waiting": len(e.waiting), "kv": e.cache.num_used,
                           "kv_slots": e.config.max_num_seqs, "requests": counter_total(m.requests),
                           "generation_tokens": counter_total(m.generation_tokens),
                           "drafter": type(e.drafter).__name__, "scheduler": getattr(e.scheduler, "name", "")},
                "cost": self.cost_curve(), "calibration": self.reliability()})
        return self.shared_part[1]

    def cost_curve(self) -> dict | None:
        cost = getattr(self.engine.scheduler, "cost", None)
        if cost is None:
            return None
        top = min(cost.max_size, 4 * max(self.engine.config.max_num_seqs, 8))
        sizes = sorted({max(1, round(top ** (i / (COST_POINTS - 1)))) for i in range(COST_POINTS)})
        return {"B": sizes, "ms": [round(cost.step_time(b, drafted=False) * 1e3, 3) for b in sizes]}

    def reliability(self) -> dict | None:
        """Per draft position k: predicted survival a_k against realised acceptance of x_1..x_k, binned, over the
        calibration window; recomputed only when the window moved."""
        monitor = self.engine.drift
        if monitor is None:
            return None
        if self.calibration[0] == monitor.state.steps:
            return self.calibration[1]
        s = monitor.state
        out = {"ece": finite(s.ece), "bound": finite(s.bound), "alarms": s.alarms, "refits": s.refits, "rows": s.rows,
               "refit": monitor.refit, "temperatures": [round(t, 3) for t in monitor.temperatures],
               "events": [{**e.__dict__, "ece": finite(e.ece), "bound": finite(e.bound)} for e in s.events[-10:]],
               "positions": []}
        rows = list(monitor.rows)
        if rows:
            conf, verified, accepted = (np.asarray(x) for x in zip(*rows))
            survival = cumulative(ConfidenceData(np.stack(conf), verified, accepted), monitor.temperatures)
            for k in range(1, survival.shape[1] + 1):
                seen = verified >= k
                pred, event = survival[seen, k - 1], (accepted[seen] >= k).astype(float)
                idx = np.minimum((pred * RELIABILITY_BINS).astype(int), RELIABILITY_BINS - 1)
                n = np.bincount(idx, minlength=RELIABILITY_BINS)
                bins = [{"p": float(pred[idx == b].mean()), "a": float(event[idx == b].mean()), "n": int(n[b])}
                        for b in range(RELIABILITY_BINS) if n[b]]
                ece = float(sum(b["n"] * abs(b["p"] - b["a"]) for b in bins) / max(len(pred), 1))
                out["positions"].append({"k": k, "n": int(seen.sum()), "ece": ece, "bins": bins})
        self.calibration = (monitor.state.steps, out)
        return out
