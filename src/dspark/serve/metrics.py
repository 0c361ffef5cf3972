"""Prometheus metrics of the server: requests, tokens, queue and running counts, KV slots held, step time,
verify batch size B, acceptance length τ and drafts verified per step. One registry per server."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine.request import RequestOutput
from ..engine.stats import StepStats

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dspark_requests", "finished requests by finish reason", ["finish_reason"], registry=r)
        self.rejected = Counter("dspark_requests_rejected", "requests refused before running", ["reason"], registry=r)
        self.prompt_tokens = Counter("dspark_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("dspark_generation_tokens", "tokens generated", registry=r)
        self.waiting = Gauge("dspark_waiting_requests", "requests in the waiting queue", registry=r)
        self.running = Gauge("dspark_running_requests", "requests decoding", registry=r)
        self.kv_slots = Gauge("dspark_kv_cache_slots_used", "request slots held in the target's KV cache", registry=r)
        self.step_seconds = Histogram("dspark_step_seconds", "engine step time (prefill, draft, verify, sample)",
                                      buckets=(.005, .01, .02, .05, .1, .2, .5, 1, 2, 5), registry=r)
        self.verify_tokens = Histogram("dspark_verify_batch_tokens", "verify batch size B = Σ_r (1 + ℓ_r)",
                                       buckets=SIZES, registry=r)
        self.drafts_verified = Histogram("dspark_drafts_verified_per_step", "drafts verified per request and step (ℓ_r)",
                                         buckets=(0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16), registry=r)
        self.calibration_ece = Gauge("dspark_calibration_window_ece", "pooled ECE of the confidence head's calibrated "
                                     "survivals over the online window", registry=r)
        self.calibration_bound = Gauge("dspark_calibration_window_bound", "the ECE that sampling noise and the "
                                       "offline fit explain; above it, drift", registry=r)
        self.calibration_alarms = Gauge("dspark_calibration_drift_alarms", "calibration drifts detected", registry=r)
        self.calibration_refits = Gauge("dspark_calibration_refits", "STS re-fits applied online", registry=r)
        self.acceptance = Histogram("dspark_acceptance_length", "tokens per request and step (accepted + 1), τ",
                                    buckets=(1, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9), registry=r)

    def observe_load(self, waiting: int, running: int, kv_slots: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)
        self.kv_slots.set(kv_slots)

    def observe_step(self, seconds: float, st: StepStats | None) -> None:
        self.step_seconds.observe(seconds)
        if st is not None and st.num_requests:
            self.verify_tokens.observe(st.verify_tokens)
            for verified, accepted in zip(st.verified, st.accepted):
                self.drafts_verified.observe(verified)
                self.acceptance.observe(accepted + 1)

    def observe_calibration(self, state) -> None:
        """The drift monitor's last check (schedule/drift.py: DriftState)."""
        self.calibration_ece.set(state.ece)
        self.calibration_bound.set(state.bound)
        self.calibration_alarms.set(state.alarms)
        self.calibration_refits.set(state.refits)

    def observe_finished(self, out: RequestOutput) -> None:
        self.requests.labels(out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(out.prompt_tokens)
        self.generation_tokens.inc(len(out.token_ids))

    def render(self) -> bytes:
        return generate_latest(self.registry)
