"""The committed drafters for SmolLM2-135M-Instruct (the bundled DSpark default and the DFlash, Eagle3-style
and MTP-1 baselines) keep the engine lossless: greedy output equals plain greedy (fp32) with every drafter
and every scheduler, and at temperature 1 the joint distribution of the first tokens equals plain sampling
(G-test against the exact target tree, as in test_lossless_distribution) with the trained drafters and the
confidence schedulers. They also load as the released layout says and stay under 25 MB, and draft from their
committed draft vocabularies (draft_vocab.py), so every test here runs with them.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from stats_utils import g_test
from target_tree import TargetTree

from dspark.config import EngineConfig
from dspark.draft import DEFAULT_DRAFTER_DIR, make_drafter
from dspark.draft.draft_vocab import load_draft_vocab
from dspark.engine.llm_engine import LLMEngine
from dspark.sampling import SamplingParams
from dspark.schedule import CostTable, make_scheduler
from dspark.schedule.drift import DriftMonitor
from test_lossless_distribution import ALPHA, REAL_PROMPT

REPO_DRAFTERS = DEFAULT_DRAFTER_DIR.parents[3] / "drafters"
# the committed drafters
DRAFTERS = {"dspark": DEFAULT_DRAFTER_DIR, "dflash": REPO_DRAFTERS / "smollm2-135m-dflash",
            "eagle3": REPO_DRAFTERS / "smollm2-135m-eagle3", "mtp": REPO_DRAFTERS / "smollm2-135m-mtp1"}
# a cost table of this machine's shape (verify time flat to B = 8, then growing), so the schedulers trim
COST = CostTable(list(range(1, 513)), [0.04 + 0.0015 * max(0, b - 8) for b in range(1, 513)], [1, 512], [0.005, 0.5])
# verification nearly free, as on a GPU (5 µs per extra verified token on a 40 ms step), and taken as given (no
# online correction from this CPU's step times): the async scheduler drafts every step and its confidence budget
# trims the drafts whose survival is below ~0.1, so verified lengths vary by request and step
NEARLY_FREE = CostTable([1, 4096], [0.04, 0.04 + 5e-6 * 4095], [1, 512], [0.001, 0.001], correction_rate=0.0)
SAMPLES = 20_000
TOKENS = 4  # compared per request: the prefill's token, then a verify step of up to 2 drafts and its bonus


def drafter_dir(name: str):
    folder = DRAFTERS[name]
    assert (folder / "config.json").is_file(), f"the {name} drafter is not committed at {folder}"
    return folder


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_committed_drafter_layout_and_size(name):
    folder = drafter_dir(name)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert size < 25 * 2**20, f"{name}: {size / 2**20:.1f} MB"
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == 49152 and config["hidden_size"] == 576
    assert config["architectures"] == (["LlamaForCausalLMEagle3"] if name in ("eagle3", "mtp") else ["Qwen3DSparkModel"])
    assert config["block_size"] == (1 if name == "mtp" else 7)
    ids = load_draft_vocab(folder, config["vocab_size"])  # every test below drafts from it
    assert ids is not None and len(ids) == 8192


GREEDY_CASES = [(d, "fixed") for d in DRAFTERS] + [("dspark", s) for s in ("threshold", "algorithm1", "async")] + [
    ("lookup+dspark", "fixed")]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name,scheduler", GREEDY_CASES)
def test_greedy_equals_plain_with_trained_drafters(name, scheduler, dtype, make_llm, llm_bf16, chat_ids, solo_greedy,
                                                  solo_greedy_bf16, greedy):
    """Four prompts at once (verify widths differ by request and step) against each decoded alone without drafts,
    token for token, in float32 and in bf16 (the numerics contract, test_exactness.py)."""
    spec = ("lookup+" + str(drafter_dir(name.removeprefix("lookup+")))) if name.startswith("lookup+") else str(
        drafter_dir(name))
    if dtype == "fp32":
        llm, expected = make_llm(spec, scheduler, cost_table=COST, max_num_seqs=4), solo_greedy
    else:
        llm, expected = llm_bf16.sibling(spec, scheduler, cost_table=COST, max_num_seqs=4), solo_greedy_bf16
    outs = llm.generate(chat_ids, greedy)
    assert [o.token_ids for o in outs] == expected
    accepted = sum(o.drafts_accepted for o in outs)
    assert accepted > 0  # the drafter really drafted and was right sometimes


# (drafter, scheduler, sampling, requests): the async scheduler at temperature 1 (20,000 requests, about 18 min on a
# 2-core machine: `make test-long`), and DSpark verifying every draft at temperature 0.7 under a top-p cut, where a
# token near the cut's edge is kept or dropped by the last bit of its logit: speculation computes that logit in a
# verify forward, plain sampling in a decode forward, so this case holds only because they round alike (Options.exact)
DISTRIBUTION_CASES = [
    pytest.param("dspark", "async", SamplingParams(temperature=1.0), SAMPLES, False, marks=pytest.mark.long,
                 id="t1-async"),
    pytest.param("dspark", "fixed", SamplingParams(temperature=0.7, top_p=0.9), 4_000, False, marks=pytest.mark.slow,
                 id="t0.7-top_p0.9-fixed"),
    pytest.param("dspark", "async", SamplingParams(temperature=1.0), 4_000, True, marks=pytest.mark.slow,
                 id="t1-async-online-refit")]


@pytest.mark.parametrize("name,scheduler,sampling,samples,refit", DISTRIBUTION_CASES)
def test_joint_matches_plain_sampling(name, scheduler, sampling, samples, refit, llm_bf16):
    """bf16: the joint of the first TOKENS tokens over `samples` seeded requests against the exact plain-sampling
    joint (G-test). refit: online calibration re-fits the STS temperatures again and again while the requests run
    (a monitor that finds drift at every check), so the drafts verified change mid-run."""
    target, tokenizer = llm_bf16.engine.target, llm_bf16.tokenizer
    params = dataclasses.replace(sampling, max_tokens=TOKENS, ignore_eos=True)
    prompt = tokenizer.encode(REAL_PROMPT, add_special_tokens=False)
    tree = TargetTree(target, prompt, params, samples, depth=TOKENS)
    config = EngineConfig(dtype="bf16", max_num_seqs=512, max_model_len=len(prompt) + TOKENS + 8)
    drafter = make_drafter(str(drafter_dir(name)), target=target, max_model_len=config.max_model_len)
    engine = LLMEngine(target, tokenizer, drafter, make_scheduler(scheduler, drafter.gamma, cost=NEARLY_FREE), config)
    monitor = DriftMonitor(drafter.temperatures, window=400, min_rows=50, check_every=1, patience=1, tolerance=-1.0)
    if refit:
        engine.watch_calibration(monitor)
    requests = [engine.add_request(prompt, dataclasses.replace(params, seed=i)) for i in range(samples)]
    while engine.has_unfinished():
        engine.step()
    assert (monitor.state.refits >= 3) == refit
    assert all(r.finish_reason == "length" for r in requests)
    keys, probs = tree.cells()
    index = {key: i for i, key in enumerate(keys)}
    counts = np.bincount([index[tree.cell_of(r.output_ids)] for r in requests], minlength=len(keys))
    verified = sum(sum(st.verified) for st in engine.stats)
    accepted = sum(sum(st.accepted) for st in engine.stats)
    trimmed = sum(sum(st.drafted) - sum(st.verified) for st in engine.stats)
    assert verified > samples / 2 and 0 < accepted < verified  # drafts verified, some accepted
    assert trimmed > 0 or scheduler != "async"  # the async budget cuts some
    p_value = g_test(counts, probs)
    print(f"{name} {scheduler} {sampling}: G-test p = {p_value:.4f} over {samples} requests")
    assert p_value > ALPHA
