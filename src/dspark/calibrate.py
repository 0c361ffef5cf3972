"""Sequential temperature scaling (STS, docs/method.md) and the confidence metrics.

Data: per request and verify step, the drafter's raw confidences c_1..c_γ, the drafts verified ℓ and the
drafts accepted n. The event "x_1..x_k all accepted" is n >= k, known where ℓ >= k. STS fits T_1..T_γ left
to right: T_k minimises the ECE of the cumulative product Π_{i<=k} σ(logit(c_i)/T_i) against that event,
with T_1..T_{k-1} held fixed. Temperature scaling preserves order, so per-position AUC is unchanged.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BINS = 15  # equal-width bins of the ECE
GRID = np.exp(np.linspace(np.log(0.05), np.log(20.0), 241))  # temperatures searched
CALIBRATION_FILE = "calibration.json"
MIN_CLASS = 20  # accepted and rejected drafts a position needs for its ROC-AUC to enter the mean


@dataclass
class ConfidenceData:
    confidence: np.ndarray  # [N, γ] raw c_k
    verified: np.ndarray  # [N] ℓ
    accepted: np.ndarray  # [N] n

    def position(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(row mask, events) for position k (1-based): rows where x_k was verified; event n >= k."""
        rows = self.verified >= k
        return rows, (self.accepted[rows] >= k).astype(np.float64)


def scale(c: np.ndarray, temperature: float) -> np.ndarray:
    c = np.clip(c, 1e-7, 1 - 1e-7)
    return 1.0 / (1.0 + np.exp(-np.log(c / (1 - c)) / temperature))


def ece(probs: np.ndarray, events: np.ndarray, bins: int = BINS) -> float:
    """Expected calibration error with equal-width bins."""
    if len(probs) == 0:
        return float("nan")
    idx = np.minimum((probs * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            total += m.sum() * abs(probs[m].mean() - events[m].mean())
    return float(total / len(probs))


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties); nan with one class only."""
    labels = labels.astype(bool)
    pos, neg = labels.sum(), (~labels).sum()
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):  # average ranks over ties
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def brier(probs: np.ndarray, events: np.ndarray) -> float:
    return float(np.mean((probs - events) ** 2)) if len(probs) else float("nan")


def cumulative(data: ConfidenceData, temperatures) -> np.ndarray:
    """[N, γ] Π_{i<=k} σ(logit(c_i)/T_i)."""
    scaled = np.stack([scale(data.confidence[:, k], t) for k, t in enumerate(temperatures)], 1)
    return np.cumprod(scaled, 1)


def fit_sts(data: ConfidenceData, grid=GRID) -> list[float]:
    G = data.confidence.shape[1]
    temps: list[float] = []
    for k in range(1, G + 1):
        rows, events = data.position(k)
        if rows.sum() == 0:
            temps.append(1.0)
            continue
        prev = cumulative(data, temps)[rows, -1] if temps else np.ones(rows.sum())
        c = data.confidence[rows, k - 1]
        errors = [ece(prev * scale(c, t), events) for t in grid]
        temps.append(float(grid[int(np.argmin(errors))]))
    return temps


def metrics(data: ConfidenceData, temperatures) -> dict:
    """Per position k: ECE and Brier of the cumulative product against "x_1..x_k accepted", ROC-AUC of the
    per-position confidence c_k for "x_k accepted given x_1..x_{k-1} were"; their means over positions (the AUC's
    over the positions with at least MIN_CLASS accepted and MIN_CLASS rejected drafts: with a weak drafter the last
    positions see a handful of acceptances, and an AUC from two positives is noise, listed but not averaged); and
    auc_pooled, the ROC-AUC of the cumulative product a_k against "x_1..x_k accepted" over every verified
    (request-step, k): the one global ranking that Algorithm 1 and the asynchronous scheduler sort by."""
    cum = cumulative(data, temperatures)
    rows_out, pooled_scores, pooled_events = [], [], []
    for k in range(1, data.confidence.shape[1] + 1):
        rows, events = data.position(k)
        pooled_scores.append(cum[rows, k - 1])
        pooled_events.append(events)
        cond_rows = rows & (data.accepted >= k - 1)
        cond_events = (data.accepted[cond_rows] >= k).astype(np.float64)
        rows_out.append({"position": k, "samples": int(rows.sum()), "ece": ece(cum[rows, k - 1], events),
                         "brier": brier(cum[rows, k - 1], events),
                         "auc": roc_auc(data.confidence[cond_rows, k - 1], cond_events),
                         "auc_positives": int(cond_events.sum()), "auc_negatives": int(len(cond_events) - cond_events.sum()),
                         "accept_rate": float(events.mean()) if len(events) else float("nan")})
    mean = {m: float(np.nanmean([r[m] for r in rows_out])) for m in ("ece", "brier")}
    counted = [r["auc"] for r in rows_out if min(r["auc_positives"], r["auc_negatives"]) >= MIN_CLASS]
    mean["auc"] = float(np.mean(counted)) if counted else float("nan")
    return {"positions": rows_out, **mean, "auc_pooled": roc_auc(np.concatenate(pooled_scores),
                                                                   np.concatenate(pooled_events))}


def reliability_plot(data: ConfidenceData, temperatures, path: str | Path, bins: int = 10) -> Path:
    """Reliability diagrams of the cumulative survival per position, before and after STS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    G = data.confidence.shape[1]
    fig, axes = plt.subplots(1, G, figsize=(2.6 * G, 2.9), sharey=True)
    for k, ax in enumerate(np.atleast_1d(axes), start=1):
        rows, events = data.position(k)
        for temps, label, style in ((np.ones(G), "raw", "o--"), (temperatures, "STS", "s-")):
            probs = cumulative(data, temps)[rows, k - 1]
            idx = np.minimum((probs * bins).astype(int), bins - 1)
            xs = [probs[idx == b].mean() for b in range(bins) if (idx == b).sum() >= 5]
            ys = [events[idx == b].mean() for b in range(bins) if (idx == b).sum() >= 5]
            ax.plot(xs, ys, style, ms=3, label=f"{label} (ECE {ece(probs, events):.3f})")
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8)
        ax.set_title(f"k = {k}", fontsize=9)
        ax.set_xlabel("predicted Π c", fontsize=8)
        ax.legend(fontsize=6, loc="upper left")
    np.atleast_1d(axes)[0].set_ylabel("accepted x_1..x_k", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def save_calibration(folder: str | Path, temperatures, report: dict) -> Path:
    path = Path(folder) / CALIBRATION_FILE
    tmp = path.with_suffix(".json.part")
    tmp.write_text(json.dumps({"method": "sequential temperature scaling", "temperatures": list(temperatures),
                               **report}, indent=1))
    os.replace(tmp, path)
    return path


def load_calibration(folder: str | Path) -> dict | None:
    """calibration.json (temperatures, the report before and after), or None."""
    path = Path(folder) / CALIBRATION_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def load_temperatures(folder: str | Path) -> list[float] | None:
    calibration = load_calibration(folder)
    return calibration["temperatures"] if calibration else None


def collect(llm, prompts: list, params, progress: bool = True) -> ConfidenceData:
    """Run the prompts through the engine verifying every draft (fixed γ), with the drafter's raw (not yet
    calibrated) confidences, and record (c, ℓ, n) per request and step."""
    from .schedule import FixedLength

    engine, drafter = llm.engine, llm.engine.drafter
    if not hasattr(drafter, "temperatures"):
        raise ValueError("this drafter has no confidence head to calibrate")
    saved = drafter.temperatures, engine.scheduler, engine.record_confidence
    drafter.temperatures, engine.scheduler, engine.record_confidence = None, FixedLength(drafter.gamma), True
    engine.stats.clear()
    try:
        llm.generate(prompts, params, use_tqdm=progress)
        conf, verified, accepted = [], [], []
        G = drafter.gamma
        for st in engine.stats:
            if st.confidence is None:
                continue  # a step that drafted nothing (every request at its last token)
            # fewer than γ columns when the requests had room for fewer drafts; the padding is never read
            conf += [row + [0.5] * (G - len(row)) for row in st.confidence]
            verified += st.verified
            accepted += st.accepted
        if not conf:
            raise ValueError("the drafter returned no confidences (no confidence head)")
    finally:
        drafter.temperatures, engine.scheduler, engine.record_confidence = saved
    return ConfidenceData(np.array(conf), np.array(verified), np.array(accepted))
