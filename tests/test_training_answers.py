"""drafters/training_answers.py: the committed answers of the shipped drafters' training set come back as the
very same regenerated JSONL (prompts redrawn and re-templated, answers from the file), and a prompt that
tokenizes differently from the packed run's is refused."""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from dspark import LLM
from dspark.train.prompts import build_prompts, parse_mix
from dspark.train.regenerate import record_line

SCRIPT = Path(__file__).resolve().parent.parent / "drafters" / "training_answers.py"


@pytest.fixture(autouse=True)
def fixture_data(monkeypatch):
    """The prompt pools' data folder: the tests' stand-in (GSM8K train rows and eval sets to exclude)."""
    monkeypatch.setenv("DSPARK_DATA", str(Path(__file__).resolve().parent / "fixtures" / "data"))


def load_script():
    spec = importlib.util.spec_from_file_location("training_answers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def regenerated(tmp_path, llm, prompts: list[dict], name: str = "train.jsonl") -> Path:
    """A regenerated JSONL of made-up answers to some of `prompts` (file order is finish order, not draw order)."""
    lines = []
    for i, record in enumerate(prompts[::-7]):
        answer = [(17 * i + j) % 4000 + 100 for j in range(5 + i)] + ([min(llm.engine.eos_ids)] if i % 2 else [])
        done = argparse.Namespace(token_ids=answer, finish_reason="stop" if i % 2 else "length",
                                  text=llm.tokenizer.decode(answer, skip_special_tokens=True))
        lines.append(record_line(record, llm.chat_prompt(record["messages"]), done))
    data = tmp_path / name
    data.write_text("".join(lines))
    (tmp_path / f"{name}.meta.json").write_text(json.dumps({"temperature": 0.8, "seed": 3, "max_tokens": 384}))
    return data


def test_pack_then_unpack_gives_the_same_file(tmp_path):
    ta, llm = load_script(), LLM(max_num_seqs=1)
    data = regenerated(tmp_path, llm, build_prompts(40, seed=3))
    meta = json.loads((tmp_path / "train.jsonl.meta.json").read_text())
    ta.main(["pack", "--data", str(data), "--num-prompts", "40", "--out", str(tmp_path / "a.npz")])
    ta.main(["unpack", "--answers", str(tmp_path / "a.npz"), "--out", str(tmp_path / "back.jsonl")])
    assert (tmp_path / "back.jsonl").read_text() == data.read_text()
    assert json.loads((tmp_path / "back.jsonl.meta.json").read_text()) == meta

    z = dict(np.load(tmp_path / "a.npz"))
    z["prompt_hash"][2] += 1
    np.savez_compressed(tmp_path / "b.npz", **z)
    with pytest.raises(ValueError, match="tokenizes differently"):
        ta.main(["unpack", "--answers", str(tmp_path / "b.npz"), "--out", str(tmp_path / "x.jsonl")])


def test_a_mix_comes_back_and_datastores_join_files(tmp_path):
    """Answers of a code-only draw (regenerate --mix code=1) unpack only with that mix; a datastore of two answers
    files holds both files' answers in order."""
    ta, llm = load_script(), LLM(max_num_seqs=1)
    prompts = build_prompts(30, seed=3, mix=parse_mix("code=1"))
    assert {r["domain"] for r in prompts} == {"code"}
    data = regenerated(tmp_path, llm, prompts, "code.jsonl")
    ta.main(["pack", "--data", str(data), "--num-prompts", "30", "--mix", "code=1", "--out", str(tmp_path / "c.npz")])
    ta.main(["unpack", "--answers", str(tmp_path / "c.npz"), "--out", str(tmp_path / "back.jsonl")])
    assert (tmp_path / "back.jsonl").read_text() == data.read_text()
    z = dict(np.load(tmp_path / "c.npz"))
    z["meta"] = np.array(json.dumps({k: v for k, v in json.loads(str(z["meta"])).items() if k != "mix"}))
    np.savez_compressed(tmp_path / "nomix.npz", **z)
    with pytest.raises(ValueError, match="not in today's draw"):
        ta.main(["unpack", "--answers", str(tmp_path / "nomix.npz"), "--out", str(tmp_path / "x.jsonl")])

    ta.main(["pack", "--data", str(regenerated(tmp_path, llm, build_prompts(40, seed=3))), "--num-prompts", "40",
             "--out", str(tmp_path / "a.npz")])
    ta.main(["datastore", "--answers", str(tmp_path / "a.npz"), str(tmp_path / "c.npz"),
             "--out", str(tmp_path / "ds.npz")])
    a, c, ds = (np.load(tmp_path / f) for f in ("a.npz", "c.npz", "ds.npz"))
    assert ds["tokens"].tolist() == a["tokens"].tolist() + c["tokens"].tolist()
    assert ds["lengths"].tolist() == a["lengths"].tolist() + c["lengths"].tolist()
    with pytest.raises(ValueError, match="unknown domain"):
        parse_mix("code=1,maths=2")
