"""The engine-speed benchmark still runs end to end (tiny settings) and writes the result files it promises."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPT = BENCHMARKS / "engine_speed.py"


def load_script(path: Path = SCRIPT):
    spec = importlib.util.spec_from_file_location(f"{path.stem}_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_engine_speed_quick_writes_result(tmp_path):
    script = load_script()
    out = tmp_path / "engine_speed"
    argv = ["--quick", "--dtype", "fp32", "--prompts", "2", "--max-new-tokens", "6", "--concurrency", "1,2",
            "--verify-tokens", "1,8", "--verify-requests", "2", "--verify-timings", "1", "--threads", "1",
            "--out", str(out)]
    threads = torch.get_num_threads()
    try:
        assert script.main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # the script sets the process-wide thread count

    result = json.loads(out.with_suffix(".json").read_text())
    assert {"benchmark", "command", "commit", "date", "machine", "settings", "rows", "headline"} <= set(result)
    assert result["benchmark"] == "engine_speed"
    assert result["command"].startswith("python benchmarks/engine_speed.py --quick")
    assert {"cpu", "threads", "torch", "transformers"} <= set(result["machine"])
    assert result["settings"]["max_new_tokens"] == 6 and result["settings"]["dtype"] == ["fp32"]

    systems = {(r["section"], r["system"], r.get("concurrency")) for r in result["rows"]}
    for system in ("dspark plain", "transformers generate"):
        assert {("plain", system, 1), ("plain", system, 2)} <= systems
    assert {("prompt_lookup", "dspark prompt-lookup", 1), ("prompt_lookup", "transformers prompt-lookup", 1)} <= systems
    steps = [(r["curve"], r["requests"], r["tokens"]) for r in result["rows"] if r["section"] == "verify_step"]
    assert steps == [("one_request", 1, 1), ("one_request", 1, 8), ("many_requests", 2, 2)]
    for row in result["rows"]:
        if row["section"] != "verify_step":
            assert row["tokens_per_s"] > 0 and row["new_tokens"] == 6

    headline = result["headline"]
    for name in ("plain_vs_transformers_bs1", "plain_vs_transformers_bs2", "prompt_lookup_vs_transformers_bs1",
                 "verify8_over_verify1", "plain_vs_transformers_bs1_fp32", "fp32_greedy_agreement"):
        assert headline[name] > 0, name
    assert headline["fp32_greedy_agreement"] == 1.0  # prompt lookup is lossless: greedy output equals plain greedy

    table = out.with_suffix(".md").read_text()
    assert "dspark plain" in table and "verify8_over_verify1" in table
    if script.llama_cpp_available():  # optional peer: checked where llama-cpp-python is installed
        assert headline["llamacpp_ms_per_token"] > 0 and headline["plain_vs_llamacpp_bs1"] > 0
    else:
        assert any("llama.cpp skipped" in note for note in result["notes"])


@pytest.mark.slow
def test_drafters_quick_writes_result(tmp_path, base_llm_fp32):
    """Untrained DSpark and Eagle3-style drafters for SmolLM2 through the drafter benchmark's smoke settings."""
    from dspark.draft.checkpoint import draft_config, save_drafter
    from dspark.draft.dspark_model import DSparkModel
    from dspark.draft.eagle3_model import Eagle3Model, eagle3_config

    config = base_llm_fp32.engine.target.config.to_dict()
    torch.manual_seed(0)
    save_drafter(DSparkModel(draft_config(config, markov_rank=8)), tmp_path / "dspark", dtype=torch.bfloat16)
    save_drafter(Eagle3Model(eagle3_config(config)), tmp_path / "eagle3", dtype=torch.bfloat16)
    out = tmp_path / "drafters"
    argv = ["--quick", "--no-llama-cpp", "--threads", "1", "--max-new-tokens", "6",
            "--drafters", f"dspark={tmp_path / 'dspark'},eagle3={tmp_path / 'eagle3'}", "--out", str(out)]
    threads = torch.get_num_threads()
    try:
        assert load_script(BENCHMARKS / "drafters.py").main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.with_suffix(".json").read_text())
    acc = [r for r in result["rows"] if r["section"] == "acceptance"]
    assert {(r["drafter"], r["temperature"], r["set"]) for r in acc} == {
        (d, t, s) for d in ("dspark", "eagle3") for t in (0.0, 1.0) for s in ("gsm8k", "mt-bench")}
    assert all(r["tau"] >= 1.0 and len(r["position_accept"]) == 7 for r in acc)
    assert [r["system"] for r in result["rows"] if r["section"] == "speed"] == ["plain", "dspark", "eagle3"]
    assert result["headline"]["tau_dspark_over_eagle3"] > 0 and result["headline"]["dspark_vs_plain_bs1"] > 0
    assert (tmp_path / "drafters_positions.png").stat().st_size > 1000
