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
from dspark.train.prompts import build_prompts
from dspark.train.regenerate import record_line

SCRIPT = Path(__file__).resolve().parent.parent / "drafters" / "training_answers.py"


def load_script():
    spec = importlib.util.spec_from_file_location("training_answers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pack_then_unpack_gives_the_same_file(tmp_path):
    ta, llm = load_script(), LLM(max_num_seqs=1)
    prompts = build_prompts(40, seed=3)
    lines = []
    for i, record in enumerate(prompts[::-7]):  # file order is finish order, not draw order
        answer = [(17 * i + j) % 4000 + 100 for j in range(5 + i)] + ([min(llm.engine.eos_ids)] if i % 2 else [])
        done = argparse.Namespace(token_ids=answer, finish_reason="stop" if i % 2 else "length",
                                  text=llm.tokenizer.decode(answer, skip_special_tokens=True))
        lines.append(record_line(record, llm.chat_prompt(record["messages"]), done))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(lines))
    meta = {"temperature": 0.8, "seed": 3, "max_tokens": 384}
    (tmp_path / "train.jsonl.meta.json").write_text(json.dumps(meta))
    ta.main(["pack", "--data", str(data), "--num-prompts", "40", "--out", str(tmp_path / "a.npz")])
    ta.main(["unpack", "--answers", str(tmp_path / "a.npz"), "--out", str(tmp_path / "back.jsonl")])
    assert (tmp_path / "back.jsonl").read_text() == data.read_text()
    assert json.loads((tmp_path / "back.jsonl.meta.json").read_text()) == meta

    z = dict(np.load(tmp_path / "a.npz"))
    z["prompt_hash"][2] += 1
    np.savez_compressed(tmp_path / "b.npz", **z)
    with pytest.raises(ValueError, match="tokenizes differently"):
        ta.main(["unpack", "--answers", str(tmp_path / "b.npz"), "--out", str(tmp_path / "x.jsonl")])
