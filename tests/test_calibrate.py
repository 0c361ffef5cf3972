"""STS calibration (docs/method.md §4): the metrics against hand computations, STS recovering known
temperatures on synthetic data (and the check failing without it), collection through the engine, and
temperatures stored beside a drafter applied when it is loaded."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_drafter import committed_request
from tiny_models import BLOCK, one_thread, tiny_drafter, tiny_target, tiny_target_dir

from dspark import LLM, SamplingParams
from dspark.calibrate import (ConfidenceData, collect, cumulative, ece, fit_sts, load_temperatures, metrics,
                              reliability_plot, roc_auc, save_calibration, scale)
from dspark.draft import make_drafter
from dspark.draft.checkpoint import save_drafter
from dspark.draft.dspark import DSparkDrafter
from dspark.train.features import target_features

__all__ = ["one_thread", "tiny_target", "tiny_target_dir"]


def test_metrics_by_hand():
    probs, events = np.array([0.1, 0.2, 0.8, 0.9]), np.array([0.0, 1.0, 1.0, 1.0])
    # bins of width 0.5: {0.1, 0.2} predicts 0.15, sees 0.5; {0.8, 0.9} predicts 0.85, sees 1.0
    assert ece(probs, events, bins=2) == pytest.approx(0.5 * 0.35 + 0.5 * 0.15)
    assert roc_auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.75)
    assert roc_auc(np.array([0.5, 0.5, 0.5]), np.array([0, 1, 1])) == pytest.approx(0.5)  # ties count half
    assert np.isnan(roc_auc(np.array([0.2, 0.3]), np.array([1, 1])))


def test_pooled_auc_ranks_across_positions():
    """Within each position the confidences carry no signal (per-position AUC 0.5), but the cumulative
    product falls with k as the survival does, so the pooled ranking the scheduler uses is informative."""
    n = 2000
    conf = np.tile([0.9, 0.5], (n, 1))
    accepted = np.where(np.arange(n) % 10 < 8, 1, 0)  # 80% survive position 1, none position 2
    accepted[:200] = 2  # 10% survive both
    m = metrics(ConfidenceData(conf, np.full(n, 2), accepted), [1.0, 1.0])
    assert m["positions"][0]["auc"] == pytest.approx(0.5)
    expected = roc_auc(np.r_[np.full(n, 0.9), np.full(n, 0.45)], np.r_[accepted >= 1, accepted >= 2].astype(float))
    assert m["auc_pooled"] == pytest.approx(expected) and m["auc_pooled"] > 0.75


def test_mean_auc_leaves_out_positions_with_few_acceptances():
    """Position 2 has 3 acceptances, ranked worst: its AUC (0) is listed but stays out of the mean."""
    n = 1000
    conf = np.tile([0.5, 0.5], (n, 1))
    conf[: n // 2, 0] = 0.9  # position 1: the confident half survives
    accepted = np.where(np.arange(n) < n // 2, 1, 0)
    conf[:3, 1], accepted[:3] = 0.1, 2
    m = metrics(ConfidenceData(conf, np.full(n, 2), accepted), [1.0, 1.0])
    assert [r["auc_positives"] for r in m["positions"]] == [n // 2, 3]
    assert m["positions"][0]["auc"] == pytest.approx(1.0) and m["positions"][1]["auc"] == pytest.approx(0.0)
    assert m["auc"] == pytest.approx(1.0)


def synthetic(n: int, true_temps, seed: int = 0) -> ConfidenceData:
    """Raw confidences whose real conditional survival is σ(logit(c)/T_k): over-confident when T_k > 1."""
    rng = np.random.default_rng(seed)
    G = len(true_temps)
    conf = 1 / (1 + np.exp(-rng.normal(1.0, 1.5, (n, G))))
    survive = rng.random((n, G)) < np.stack([scale(conf[:, k], t) for k, t in enumerate(true_temps)], 1)
    accepted = np.where(survive.all(1), G, np.argmin(survive, 1))  # drafts accepted before the first rejection
    verified = np.where(rng.random(n) < 0.1, rng.integers(0, G + 1, n), G)  # some rows verify fewer
    return ConfidenceData(conf, verified, np.minimum(accepted, verified))


def test_sts_recovers_the_temperatures_and_fixes_the_ece():
    true = [2.0, 1.5, 3.0, 0.7]
    data = synthetic(40_000, true)
    temps = fit_sts(data)
    before, after = metrics(data, [1.0] * 4), metrics(data, temps)
    assert before["ece"] > 0.04  # raw: badly calibrated
    assert after["ece"] < 0.012
    for got, want in zip(temps, true):
        assert got == pytest.approx(want, rel=0.15)
    assert after["auc"] == pytest.approx(before["auc"])  # order-preserving: AUC unchanged
    assert 0.6 < after["auc"] < 1.0


def test_sts_is_sequential():
    """T_k is fitted on the product with the already fitted T_1..T_{k-1}: fitting position 2 alone, as
    if position 1 were calibrated by T = 1, gives another temperature."""
    data = synthetic(30_000, [3.0, 1.0])
    temps = fit_sts(data)
    prev_raw = cumulative(data, [1.0])[:, 0]
    rows, events = data.position(2)
    grid = np.exp(np.linspace(np.log(0.05), np.log(20.0), 241))
    naive = grid[int(np.argmin([ece(prev_raw[rows] * scale(data.confidence[rows, 1], t), events) for t in grid]))]
    assert temps[1] == pytest.approx(1.0, rel=0.15) and abs(naive - temps[1]) > 0.2


@pytest.mark.usefixtures("one_thread")
def test_collect_through_the_engine_and_apply_at_load(tiny_target, tiny_target_dir, tmp_path):
    model = tiny_drafter(tiny_target, "vanilla", seed=5)
    save_drafter(model, tmp_path)
    llm = LLM(str(tiny_target_dir), drafter=str(tmp_path), gamma=BLOCK, dtype="fp32")
    assert llm.engine.drafter.temperatures is None  # no calibration.json yet
    prompts = [[5 + i, 40, 41, 42] * 3 for i in range(6)]
    params = [SamplingParams(temperature=1.0, max_tokens=30, seed=i, ignore_eos=True) for i in range(6)]
    data = collect(llm, prompts, params, progress=False)
    drafted = [s for s in llm.engine.stats if s.confidence is not None]  # steps that drafted something
    assert sum(s.num_requests for s in drafted) == len(data.verified)  # one row per request and step
    assert llm.engine.record_confidence is False and llm.engine.scheduler.gamma == BLOCK  # settings restored
    assert data.confidence.shape[1] == BLOCK and len(data.verified) == len(data.accepted) > 30
    assert bool((data.accepted <= data.verified).all()) and bool((data.verified <= BLOCK).all())
    assert bool(((data.confidence > 0) & (data.confidence < 1)).all())
    temps = [0.5, 1.0, 2.0, 4.0]
    save_calibration(tmp_path, temps, metrics(data, temps))
    assert load_temperatures(tmp_path) == temps
    plot = reliability_plot(data, temps, tmp_path / "rel.png")
    assert plot.stat().st_size > 1000
    calibrated = make_drafter(str(tmp_path), target=tiny_target)
    raw = DSparkDrafter(calibrated.model)  # the same loaded weights (and head groups), no temperatures
    assert calibrated.temperatures == temps
    seq = prompts[0]
    feats = target_features(tiny_target, [seq], model.target_layer_ids)
    c_cal = calibrated.propose([committed_request(calibrated, 0, feats.features[0, :-1], seq[-1], params[0])]).confidence
    c_raw = raw.propose([committed_request(raw, 0, feats.features[0, :-1], seq[-1], params[0])]).confidence
    want = torch.tensor([scale(c_raw[0, k].double().numpy(), t) for k, t in enumerate(temps)], dtype=torch.float32)
    torch.testing.assert_close(c_cal[0], want, rtol=1e-4, atol=1e-6)
