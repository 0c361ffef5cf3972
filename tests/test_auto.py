"""The "auto" policy (auto.py) is one table: every (load, target) case has exactly one row, each row names the
committed result it rests on, and LLM builds what the row says."""
from __future__ import annotations

import itertools
from pathlib import Path

from dspark.auto import POLICY, choose_drafter, scheduler_for
from dspark.draft import NoDrafter
from dspark.draft.lookup_first import LookupFirstDrafter

ROOT = Path(__file__).resolve().parents[1]


def test_every_case_has_one_row_resting_on_a_committed_result():
    cases = [(c.one_stream, c.bundled_fits) for c in POLICY]
    assert sorted(cases) == sorted(itertools.product([False, True], repeat=2))
    for choice in POLICY:
        assert (ROOT / choice.measured.split(":")[0].split(",")[0]).is_file(), choice.measured


def test_auto_resolves_by_the_table_and_named_choices_stay():
    assert choose_drafter("auto", "auto", 1, True) == "lookup+default"
    assert choose_drafter("auto", "fixed", 1, True) == "default"  # a named scheduler: not one stream's policy
    assert choose_drafter("auto", "auto", 8, True) == "default"
    assert choose_drafter("auto", "auto", 1, False) == "prompt-lookup"
    assert choose_drafter("prompt-lookup", "auto", 1, True) == "prompt-lookup"
    assert scheduler_for("auto", NoDrafter()) == "fixed" and scheduler_for("threshold", NoDrafter()) == "threshold"


def test_one_stream_of_the_bundled_target_looks_up_first(base_llm_fp32):
    llm = base_llm_fp32.sibling("auto", "auto", max_num_seqs=1)
    assert isinstance(llm.engine.drafter, LookupFirstDrafter) and llm.engine.scheduler.name == "fixed"
