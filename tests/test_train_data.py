"""Training data: the seeded prompt mix, the exclusion of evaluation prompts, and resumable regeneration."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from dspark.cli import main
from dspark.train.prompts import (MATH_SUFFIX, MIX, EvalFilter, build_prompts, classify, default_data_dir,
                                  load_pools, normalise, quotas, read_sharegpt)
from dspark.train.regenerate import RegenSettings, read_done, record_seed, regenerate

LEAKED_QUESTION = "Tom's basket has 3 apples and he adds 4 more. How many apples are in Tom's basket now?"
LEAKED_CHAT = "Compose an engaging travel blog post about a recent trip to Hawaii."


# ---- a small data folder ------------------------------------------------------------------------
def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def conversation(cid, *turns):
    return {"id": cid, "conversations": [{"from": who, "value": text} for who, text in turns]}


@pytest.fixture
def tiny_data(tmp_path):
    """(data_dir, sharegpt_path): two evaluation files, three GSM8K rows and a truncated ShareGPT file."""
    write_jsonl(tmp_path / "eval_gsm8k.jsonl", [{"turns": [LEAKED_QUESTION.replace("'", "\u2019") + MATH_SUFFIX]}])
    write_jsonl(tmp_path / "eval_mt-bench.jsonl", [{"turns": [LEAKED_CHAT, "Now rewrite it as a limerick."]}])
    write_jsonl(tmp_path / "gsm8k_train.jsonl", [
        {"question": "A train travels 60 km in 1.5 hours. What is its average speed?", "answer": "#### 40"},
        {"question": "  " + LEAKED_QUESTION.upper() + " ", "answer": "#### 7"},
        {"question": "Sara reads 12 pages a day. How many pages does she read in a week?", "answer": "#### 84"}])
    convs = [
        conversation("a_0", ("human", "Write a python function that reverses a linked list."), ("gpt", "def ...")),
        conversation("b_0", ("human", "Describe your ideal weekend   in 3 bullet points."), ("gpt", "- ...")),
        conversation("c_0", ("human", "What makes a good friendship last for many years?"), ("gpt", "Trust.")),
        conversation("d_0", ("human", "compose an engaging travel blog post about a recent trip to hawaii.")),
        conversation("e_3", ("human", "And what about the second part of your answer?")),  # mid-conversation
        conversation("f_0", ("gpt", "Hello! How can I help you today with anything?")),  # not opened by the user
        conversation("g_0", ("human", "hi")),  # too short
        conversation("h_0", ("human", "What makes a good friendship last for many years?")),  # duplicate
    ]
    text = "[\n" + ",\n".join(json.dumps(c) for c in convs) + ',\n{"id": "z_0", "conversations": [{"from": "hu'
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(text)
    return tmp_path, sharegpt


# ---- prompts ------------------------------------------------------------------------------------
def test_truncated_sharegpt_is_read_conversation_by_conversation(tiny_data):
    assert [c["id"] for c in read_sharegpt(tiny_data[1])] == ["a_0", "b_0", "c_0", "d_0", "e_3", "f_0", "g_0", "h_0"]


def test_sharegpt_prompts_get_one_domain_each():
    assert classify("How do I sort a dict by value in Python?") == "code"
    assert classify("Fix this code:\n```\nfor i in range(3) print(i)\n```") == "code"
    assert classify("Summarise the French revolution in under 100 words.") == "instruction"
    assert classify("Give me the pros and cons as a table.") == "instruction"
    assert classify("What is the meaning of life?") == "chat"


def test_evaluation_prompts_never_enter_training(tiny_data):
    pools = load_pools(*tiny_data)
    ids = {d: [pid for pid, _ in p] for d, p in pools.pools.items()}
    assert ids == {"chat": ["sharegpt/c_0"], "math": ["gsm8k/0", "gsm8k/2"], "code": ["sharegpt/a_0"],
                   "instruction": ["sharegpt/b_0"]}
    assert pools.dropped == {"chat": 1, "math": 1, "code": 0, "instruction": 0}
    math = dict(pools.pools["math"])
    assert math["gsm8k/0"].endswith(MATH_SUFFIX)


def test_quotas_follow_the_mix_sum_to_n_and_grow_with_n():
    previous = quotas(0, MIX)
    for n in range(1, 1500):
        share = quotas(n, MIX)
        assert sum(share.values()) == n
        assert all(abs(share[d] - n * w) < 1 for d, w in MIX.items())
        assert all(share[d] >= previous[d] for d in MIX)
        previous = share


def test_prompt_list_is_seeded_and_mixed_as_the_paper():
    data_dir = default_data_dir()
    if not (data_dir / "gsm8k_train.jsonl").is_file():
        pytest.skip(f"training data not found at {data_dir} (set DSPARK_DATA)")
    first, again, other = (build_prompts(1000, seed=s, data_dir=data_dir) for s in (1, 1, 2))
    assert first == again and first != other
    assert {r["id"] for r in build_prompts(300, seed=1, data_dir=data_dir)} < {r["id"] for r in first}
    assert len({r["id"] for r in first}) == 1000
    counts = Counter(r["domain"] for r in first)
    assert all(abs(counts[d] / 1000 - w) < 0.002 for d, w in MIX.items()), counts
    evals = EvalFilter.from_data_dir(data_dir)
    assert not any(normalise(r["messages"][0]["content"]) in evals.exact for r in first + other)


# ---- regeneration -------------------------------------------------------------------------------
RECORDS = [{"id": f"t/{i}", "domain": "chat", "messages": [{"role": "user", "content": text}]} for i, text in
           enumerate(["Name a colour.", "What is 2+2?", "Say hello.", "Write a haiku about rain.",
                      "List three fruits."])]
SETTINGS = RegenSettings(max_tokens=4, seed=3)


def read_records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_record_seeds_differ_by_id_and_global_seed():
    assert record_seed("a", 0) == record_seed("a", 0)
    assert len({record_seed("a", 0), record_seed("b", 0), record_seed("a", 1)}) == 3


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_interrupted_regeneration_resumes_to_the_same_records(dtype, make_llm, llm_bf16, tmp_path, capsys):
    """Batches of 3, then of 2 and 3: each resumed answer shares its batches with other requests than before, and is
    the same record for record, in bf16 too (the numerics contract); a torn last line is cut off with a message."""
    make = (lambda n: make_llm(max_num_seqs=n)) if dtype == "fp32" else (lambda n: llm_bf16.sibling(max_num_seqs=n))
    wide, narrow = make(3), make(2)
    whole, pieces = tmp_path / "whole.jsonl", tmp_path / "pieces.jsonl"
    summary = regenerate(wide, RECORDS, whole, SETTINGS, progress=False)
    assert summary.written == len(RECORDS) and summary.answer_tokens > 0

    first = regenerate(narrow, RECORDS, pieces, SETTINGS, limit=1, progress=False)  # stopped with requests in flight
    assert 1 <= first.written < len(RECORDS) and not narrow.engine.has_unfinished()
    with open(pieces, "a") as f:
        f.write('{"id": "t/4", "domain": "ch')  # a line torn by a kill
    second = regenerate(wide, RECORDS, pieces, SETTINGS, progress=False)
    assert second.already_done == first.written and first.written + second.written == len(RECORDS)
    assert "torn record" in capsys.readouterr().err

    got, want = read_records(pieces), read_records(whole)
    assert len({r["id"] for r in got}) == len(got) == len(RECORDS)
    assert sorted(got, key=lambda r: r["id"]) == sorted(want, key=lambda r: r["id"])
    r = want[0]
    assert r["prompt_ids"] == wide.chat_prompt(RECORDS[int(r["id"][2:])]["messages"])
    assert 1 <= len(r["answer_ids"]) <= 4 and r["finish_reason"] in ("stop", "length")
    assert read_done(pieces) == {r["id"] for r in RECORDS}
    assert regenerate(wide, RECORDS, pieces, SETTINGS, progress=False).written == 0


def test_resuming_with_other_settings_is_refused(make_llm, tmp_path):
    llm = make_llm(max_num_seqs=2)
    out = tmp_path / "out.jsonl"
    regenerate(llm, [], out, SETTINGS, progress=False)  # writes the settings beside the (empty) output
    with pytest.raises(ValueError, match="temperature"):
        regenerate(llm, RECORDS, out, RegenSettings(max_tokens=4, seed=3, temperature=1.0), progress=False)
    assert not llm.engine.has_unfinished() and out.read_text() == ""


def test_cli_dry_run_reports_the_pools(tiny_data, capsys):
    assert main(["regenerate", "--out", str(tiny_data[0] / "out.jsonl"), "--num-prompts", "3",
                 "--data-dir", str(tiny_data[0]), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "math 2 (dropped as evaluation prompts: 1)" in err and "3 prompts (seed 0)" in err
