"""The SPS(B) cost table (docs/method.md §5): rounding up, extrapolation, the drafter's cost, online correction,
staircase detection, files, the monotone smoothing of profiled times, and profiling itself (the cached profile's
key and repair, the `dspark profile` command, profiles wider than one step's prefill budget).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import BLOCK, one_thread, tiny_drafter, tiny_target, tiny_target_dir

from dspark import LLM
from dspark.draft.dspark import DSparkDrafter
from dspark.schedule import AsyncBudgetScheduler, CostTable
from dspark.engine.profile import monotone

__all__ = ["one_thread", "tiny_target", "tiny_target_dir"]


def test_cost_table_rounds_up_extrapolates_and_adds_the_drafter():
    t = CostTable([1, 2, 4, 8], [1.0, 1.1, 1.3, 2.0], [1, 4], [0.5, 0.9])
    assert t.step_time(3, 1) == pytest.approx(1.3 + 0.5)  # B = 3 costs as the bucket of 4
    assert t.step_time(8, 2) == pytest.approx(2.0 + 0.9)  # R = 2 costs as 4
    assert t.step_time(12, 1) == pytest.approx(2.0 + 0.7 / 4 * 4 + 0.5)  # the last slope extended
    assert t.sps(1, 1) == pytest.approx(1 / 1.5)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.001, 1.0), min_size=1, max_size=40))
def test_profiled_verify_times_are_made_monotone_by_pooling(seconds):
    smooth = monotone(seconds)
    assert len(smooth) == len(seconds) and all(a <= b + 1e-12 for a, b in zip(smooth, smooth[1:]))
    assert sum(smooth) == pytest.approx(sum(seconds))  # pooled means keep the total
    assert monotone(sorted(seconds)) == pytest.approx(sorted(seconds))
    assert monotone([26.3, 32.3, 37.2, 34.5, 31.6, 28.6, 31.0, 32.0]) == pytest.approx([26.3, 32.3] + [194.9 / 6] * 6)


def test_online_correction_heals_a_stale_table():
    t = CostTable([1, 8, 16], [1.0, 1.0, 2.0])
    for _ in range(200):
        t.observe(8, 1, 3.0)  # the machine got three times slower at B = 5..8
    assert t.step_time(6) == pytest.approx(3.0, rel=1e-3)
    assert t.step_time(1) == 1.0 and t.step_time(16) == 2.0  # other buckets untouched


def test_staircase_detection_and_file_round_trip(tmp_path):
    sizes = list(range(1, 33))
    seconds = [1.0 + 0.01 * b + (0.5 if b > 16 else 0.0) for b in sizes]
    t = CostTable(sizes, seconds, meta={"machine": {"cpu": "test"}})
    assert t.staircase() == [17]
    loaded = CostTable.load(t.save(tmp_path / "cost.json"))
    assert loaded == t and loaded.meta["machine"]["cpu"] == "test"
    with pytest.raises(ValueError, match="ascending"):
        CostTable([2, 1], [1.0, 1.0])


def test_cached_profile_keys_the_drafters_groups_and_replaces_an_unreadable_file(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from dspark.engine import profile

    made = []
    monkeypatch.setattr(profile, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(profile, "profile_engine", lambda engine, max_requests: made.append(1) or
                        CostTable([1, 2], [1.0, 1.1]))
    head = torch.nn.Linear(4, 8)
    engine = SimpleNamespace(target=torch.nn.Linear(4, 4), drafter=SimpleNamespace(model=head),
                             config=SimpleNamespace(max_num_seqs=2))
    profile.cached_profile(engine, ("key",))
    profile.cached_profile(engine, ("key",))
    assert len(made) == 1  # the second call read the file
    (first,) = (tmp_path / "profiles").glob("*.json")
    head.groups = object()  # the drafter's head now reads groups: a different cost, a different file
    profile.cached_profile(engine, ("key",))
    assert len(made) == 2
    (file,) = set((tmp_path / "profiles").glob("*.json")) - {first}
    file.write_text('{"verify_sizes": [1], "verify_seconds": [1.0], "a_field_of_a_later_version": 1}')
    assert profile.cached_profile(engine, ("key",)).verify_sizes == [1, 2]  # profiled again
    assert len(made) == 3 and CostTable.load(file).verify_sizes == [1, 2]  # and replaced


@pytest.mark.usefixtures("one_thread")
def test_profile_cli_writes_a_cost_table_and_plot(tiny_target, tiny_target_dir, tmp_path):
    from dspark.cli import main
    from dspark.draft.checkpoint import save_drafter

    save_drafter(tiny_drafter(tiny_target, "vanilla"), tmp_path / "drafter")
    out = tmp_path / "cost.json"
    assert main(["profile", "--target", str(tiny_target_dir), "--drafter", str(tmp_path / "drafter"), "--gamma",
                 str(BLOCK), "--dtype", "fp32", "--max-requests", "4", "--repeats", "1", "--out", str(out)]) == 0
    table = CostTable.load(out)
    assert table.verify_sizes == [*range(1, 17), 20]  # the default sizes up to 4 requests of 1 + γ
    assert table.draft_sizes == [1, 2, 4] and table.draft_depth == BLOCK
    assert all(t > 0 for t in table.verify_seconds + table.draft_seconds + table.draft_seconds_one)
    assert table.meta["machine"]["threads"] >= 1 and table.meta["dtype"] == "float32" and table.meta["gamma"] == BLOCK
    assert (tmp_path / "cost.png").stat().st_size > 1000
    llm = LLM(str(tiny_target_dir), drafter=str(tmp_path / "drafter"), gamma=BLOCK, dtype="fp32",
              scheduler="async", cost_table=str(out))
    assert isinstance(llm.engine.scheduler, AsyncBudgetScheduler) and llm.engine.scheduler.cost == table


@pytest.mark.usefixtures("one_thread")
def test_profile_prefills_past_the_per_step_prefill_budget(tiny_target, tiny_target_dir):
    """More profiling requests than one step's prefill budget admits: they all get prefilled first."""
    from dspark.engine.profile import profile_engine

    llm = LLM(str(tiny_target_dir), drafter=DSparkDrafter(tiny_drafter(tiny_target, "vanilla")), dtype="fp32",
              gamma=BLOCK, max_num_seqs=4)
    llm.engine.max_prefill_tokens = 40  # 4 requests of 16 context tokens need two prefill steps
    table = profile_engine(llm.engine, max_requests=4, context=16, repeats=1, progress=False)
    assert table.verify_sizes[-1] == 4 * (BLOCK + 1) and all(t > 0 for t in table.verify_seconds)
    assert not llm.engine.has_unfinished() and llm.engine.cache.num_used == 0
