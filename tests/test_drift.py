"""Online calibration (schedule/drift.py): on a calibrated stream the monitor never alarms; when acceptance drifts
away from the confidences it alarms within a window, re-fits STS on the window and the re-fitted temperatures are
calibrated again; in the engine the new temperatures reach the drafter between steps and greedy output stays plain
decoding's. (The G-test with re-fits under way is in test_trained_drafters.py.)"""
from __future__ import annotations

import numpy as np
import pytest

from dspark.calibrate import cumulative
from dspark.schedule import drift
from dspark.schedule.drift import DriftMonitor, pooled_ece, verified_pairs

GAMMA, R = 7, 8


def stream(steps: int, seed: int, truth=lambda c: c):
    """Per step R request-steps: raw confidences c ~ Beta(4, 1.5) (mostly high, as a trained head's), ℓ uniform in
    1..γ, and n drawn from the chain
    "x_k accepted with probability truth(c_k) once x_{k-1} was" (truth = identity: calibrated)."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        c = np.clip(rng.beta(4.0, 1.5, (R, GAMMA)), 0.02, 0.98)
        verified = rng.integers(1, GAMMA + 1, R)
        passed = np.cumprod(rng.random((R, GAMMA)) < truth(c), 1).sum(1)
        yield c.tolist(), verified.tolist(), np.minimum(passed, verified).tolist()


def run(monitor: DriftMonitor, steps: int, seed: int, truth=lambda c: c) -> DriftMonitor:
    for confidence, verified, accepted in stream(steps, seed, truth):
        scaled = 1 / (1 + np.exp(-np.log(np.asarray(confidence) / (1 - np.asarray(confidence)))
                                 / np.asarray(monitor.temperatures)))  # what the drafter returns: calibrated c
        monitor.observe(scaled.tolist(), verified, accepted)
    return monitor


def test_pooled_ece_is_the_calibration_modules_ece():
    from dspark.calibrate import ece

    rng = np.random.default_rng(0)
    p, e = rng.random(500), (rng.random((3, 500)) < 0.5).astype(float)
    assert np.allclose(pooled_ece(p, e), [ece(p, row) for row in e])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_calibrated_stream_never_alarms(seed):
    """3 x 2,500 steps (20,000 request-steps each, 40 checks of a 2,000-row window): no alarm. With the noise term
    left out of the bound (z = 0, next test) the same streams alarm: the bound is what keeps this test from passing
    trivially."""
    monitor = run(DriftMonitor([1.0] * GAMMA, seed=seed), 2500, seed)
    assert monitor.state.alarms == 0 and monitor.state.refits == 0
    assert monitor.state.ece < monitor.state.bound


def test_the_noise_bound_is_what_prevents_false_alarms(monkeypatch):
    monkeypatch.setattr(drift, "Z_ALARM", 0.0)
    monitor = run(DriftMonitor([1.0] * GAMMA, seed=1), 2500, 1)
    assert monitor.state.alarms > 0


def sharper(c):
    """The acceptance of an over-confident head: σ(logit(c) / 3), so the confidences need a temperature of 3."""
    return 1 / (1 + (1 / c - 1) ** (1 / 3))


def test_drift_is_detected_and_the_refit_calibrates_again():
    """The head turns over-confident (as on an unfamiliar domain): an alarm as soon as the window holds enough rows,
    a re-fit with temperatures above 1 (less confident), after which the same traffic checks clean."""
    monitor = run(DriftMonitor([1.0] * GAMMA, seed=0), 400, 0, truth=sharper)
    s = monitor.state
    refits = [e for e in s.events if e.kind == "refit"]
    assert refits and refits[0].step <= 200, s.events
    assert all(1.5 < t < 6.0 for t in refits[0].temperatures[:3]), refits[0].temperatures  # the truth: 3
    data = monitor.data()
    before = pooled_ece(*verified_pairs(cumulative(data, [1.0] * GAMMA), data.verified, data.accepted))[0]
    after = pooled_ece(*verified_pairs(cumulative(data, monitor.temperatures), data.verified, data.accepted))[0]
    assert after < before / 3
    alarms = s.alarms
    run(monitor, 1500, 5, truth=sharper)  # the same shifted traffic goes on: no new alarm
    assert s.alarms == alarms and s.refits == len(refits)


def test_monitor_only_counts_alarms_without_refitting():
    monitor = run(DriftMonitor([1.0] * GAMMA, seed=0, refit=False), 400, 0, truth=sharper)
    assert monitor.state.alarms > 0 and monitor.state.refits == 0 and monitor.temperatures == [1.0] * GAMMA


def test_the_engine_applies_refitted_temperatures_between_steps_and_stays_lossless(llm_bf16, chat_ids, greedy,
                                                                                    solo_greedy_bf16):
    llm = llm_bf16.sibling("default", "async", max_num_seqs=4)
    drafter = llm.engine.drafter
    start = list(drafter.temperatures)
    monitor = DriftMonitor(start, window=60, min_rows=8, check_every=1, patience=1, tolerance=-1.0)  # always drifts
    llm.engine.watch_calibration(monitor)
    outs = llm.generate(chat_ids[:4], greedy)
    assert monitor.state.refits >= 1 and drafter.temperatures == monitor.temperatures != start
    assert [o.token_ids for o in outs] == solo_greedy_bf16[:4]
    with pytest.raises(ValueError, match="confidence head"):
        llm_bf16.sibling("prompt-lookup").engine.watch_calibration(DriftMonitor(start))
