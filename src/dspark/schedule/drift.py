"""Calibration drift: do the confidence head's calibrated survivals still match what the target accepts? And the
online re-fit of STS when they do not.

DriftMonitor keeps a sliding window of the latest request-steps that verified drafts: the raw confidences
c_1..c_γ (the calibrated ones the drafter returned, un-scaled by the temperatures then in use), ℓ and n. Every
`check_every` steps, once the window holds `min_rows`, it computes the window's pooled ECE: the cumulative products
a_k = Π_{i<=k} σ(logit(c_i)/T_i) of every verified position against "x_1..x_k accepted", the survivals the
schedulers rank drafts by. A calibrated head's ECE on a finite window is not zero, so the bound is what sampling
noise gives: `draws` sets of acceptance events are drawn from the window's own a_k (x_k accepted with probability
a_k / a_{k-1} once x_{k-1} was, up to ℓ), and the bound is the one-sided 0.001 point of a log-normal fitted to their
ECEs (exp(mean + z·sd of log ECE), z = 3.09: the ECE's right tail is longer than a normal's) plus `tolerance` (the
offline fit's own ECE: what it already accepted). A check over the bound is an exceedance; `patience` in a row is
an alarm: drift. On an alarm STS is re-fitted on the window (calibrate.fit_sts) and the new temperatures are
returned, for the engine to apply between two steps; the next check waits for half a window of new rows.

Confidences only decide which drafts are verified, never what the target accepts: decoding stays lossless whatever
the temperatures.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..calibrate import BINS, ConfidenceData, cumulative, fit_sts

Z_ALARM = 3.09  # one-sided normal quantile of 0.001


@dataclass
class DriftEvent:
    step: int
    kind: str  # "alarm" (drift: `patience` checks over the bound in a row) or "refit" (temperatures replaced)
    ece: float
    bound: float
    temperatures: list[float] | None = None


@dataclass
class DriftState:
    """What the last check saw (for /metrics and the live page)."""
    steps: int = 0
    rows: int = 0
    ece: float = float("nan")
    bound: float = float("nan")
    exceedances: int = 0  # checks over the bound
    alarms: int = 0
    refits: int = 0
    events: list[DriftEvent] = field(default_factory=list)


def logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return np.log(p / (1 - p))


def pooled_ece(probs: np.ndarray, events: np.ndarray, bins: int = BINS) -> np.ndarray:
    """ECE (equal-width bins) of probs [M] against each row of events [D, M] at once: [D]."""
    idx = np.minimum((probs * bins).astype(int), bins - 1)
    prob_sum = np.bincount(idx, weights=probs, minlength=bins)
    event_sum = np.stack([np.bincount(idx, weights=e, minlength=bins) for e in np.atleast_2d(events)])
    return np.abs(prob_sum - event_sum).sum(1) / max(len(probs), 1)


def verified_pairs(survival: np.ndarray, verified: np.ndarray, accepted: np.ndarray):
    """(a_k, event "n >= k") of every verified position, flattened."""
    k = np.arange(1, survival.shape[1] + 1)
    rows = verified[:, None] >= k[None, :]
    return survival[rows], (accepted[:, None] >= k[None, :])[rows].astype(np.float64)


class DriftMonitor:
    def __init__(self, temperatures: list[float], window: int = 2000, min_rows: int = 500, check_every: int = 50,
                 draws: int = 200, tolerance: float = 0.0, patience: int = 2, seed: int = 0, refit: bool = True):
        self.temperatures = list(temperatures)
        self.gamma = len(self.temperatures)
        self.window, self.min_rows, self.check_every = window, min_rows, check_every
        self.draws, self.tolerance, self.patience, self.refit = draws, tolerance, patience, refit
        self.rows: deque[tuple[list[float], int, int]] = deque(maxlen=window)
        self.rng = np.random.default_rng(seed)
        self.state = DriftState()
        self.over = 0  # checks over the bound in a row
        self.wait = min_rows  # new rows before the next check may run
        self.new_rows = 0

    @classmethod
    def for_drafter(cls, drafter, refit: bool = True, **settings) -> "DriftMonitor":
        """A monitor of a DSpark drafter's confidence head: its temperatures (1 where it has none), its offline
        ECE as the tolerance."""
        temperatures = drafter.temperatures or [1.0] * drafter.gamma
        return cls(temperatures, tolerance=getattr(drafter, "offline_ece", None) or 0.0, refit=refit, **settings)

    def observe(self, confidence: list[list[float]] | None, verified: list[int], accepted: list[int]) -> list[float] | None:
        """One engine step's calibrated confidences [R][<= γ], ℓ and n; new temperatures when a re-fit replaced them."""
        self.state.steps += 1
        if confidence:
            scale = np.asarray(self.temperatures)
            for c, v, n in zip(confidence, verified, accepted):
                if v > 0:
                    raw = 1 / (1 + np.exp(-logit(np.asarray(c, dtype=np.float64)) * scale[:len(c)]))
                    self.rows.append((np.pad(raw, (0, self.gamma - len(c)), constant_values=0.5), v, n))
                    self.new_rows += 1
        self.state.rows = len(self.rows)
        if self.state.steps % self.check_every or self.new_rows < self.wait or len(self.rows) < self.min_rows:
            return None
        return self.check()

    def data(self) -> ConfidenceData:
        conf, verified, accepted = zip(*self.rows)
        return ConfidenceData(np.stack(conf), np.asarray(verified), np.asarray(accepted))

    def check(self) -> list[float] | None:
        data = self.data()
        survival = cumulative(data, self.temperatures)
        probs, events = verified_pairs(survival, data.verified, data.accepted)
        ece = float(pooled_ece(probs, events)[0])
        null = np.log(np.maximum(pooled_ece(probs, self.null_events(survival, data.verified)), 1e-12))
        bound = float(np.exp(null.mean() + Z_ALARM * null.std()) + self.tolerance)
        s = self.state
        s.ece, s.bound = ece, bound
        self.over = self.over + 1 if ece > bound else 0
        s.exceedances += ece > bound
        if self.over < self.patience:
            return None
        s.alarms += 1
        s.events.append(DriftEvent(s.steps, "alarm", ece, bound))
        self.over = 0
        if not self.refit:
            return None
        self.temperatures = fit_sts(data)
        s.refits += 1
        s.ece = float(pooled_ece(*verified_pairs(cumulative(data, self.temperatures), data.verified,
                                                 data.accepted))[0])
        s.events.append(DriftEvent(s.steps, "refit", s.ece, bound, list(self.temperatures)))
        self.over, self.new_rows, self.wait = 0, 0, self.window // 2
        return list(self.temperatures)

    def null_events(self, survival: np.ndarray, verified: np.ndarray) -> np.ndarray:
        """[draws, M] events of the verified positions drawn as if the survivals were exact."""
        previous = np.concatenate([np.ones((len(survival), 1)), survival[:, :-1]], 1)
        step = np.divide(survival, previous, out=np.zeros_like(survival), where=previous > 0)
        u = self.rng.random((self.draws, *survival.shape))
        passed = np.cumprod(u < step, axis=2).sum(2)  # [draws, N]: leading acceptances
        n = np.minimum(passed, verified[None, :])
        k = np.arange(1, survival.shape[1] + 1)
        rows = verified[:, None] >= k[None, :]
        return (n[:, :, None] >= k[None, None, :])[:, rows].astype(np.float64)
