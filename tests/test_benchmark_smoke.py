"""The benchmark scripts still run end to end (tiny settings) and write the result files they promise. The longer
ones (most: each loads the bundled target and runs every system it compares) are `long` tests: `make test-long`."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_target_dir, write_train_data

__all__ = ["tiny_target_dir"]  # a fixture used here

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPT = BENCHMARKS / "engine_speed.py"
sys.path.insert(0, str(BENCHMARKS.parent))
import benchmarks.common as common  # noqa: E402

# the smoke runs read the test fixtures' stand-in eval sets, never a data folder outside the repository
common.DEFAULT_DATA_DIR = Path(__file__).resolve().parent / "fixtures" / "data"


def load_script(path: Path = SCRIPT):
    spec = importlib.util.spec_from_file_location(f"{path.stem}_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.long
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
    if not script.llama_cpp_problem():  # optional peer: checked where llama-cpp-python is installed and works
        assert headline["llamacpp_ms_per_token"] > 0 and headline["plain_vs_llamacpp_bs1"] > 0
    else:
        assert any("llama.cpp skipped" in note for note in result["notes"])


@pytest.fixture(scope="module")
def random_drafters(tmp_path_factory, base_llm_fp32):
    """Untrained DSpark and Eagle3-style drafters for SmolLM2 (bf16 files)."""
    from dspark.draft.checkpoint import draft_config, save_drafter
    from dspark.draft.dspark_model import DSparkModel
    from dspark.draft.eagle3_model import Eagle3Model, eagle3_config

    folder = tmp_path_factory.mktemp("drafters")
    config = base_llm_fp32.engine.target.config.to_dict()
    torch.manual_seed(0)
    save_drafter(DSparkModel(draft_config(config, markov_rank=8)), folder / "dspark", dtype=torch.bfloat16)
    save_drafter(Eagle3Model(eagle3_config(config)), folder / "eagle3", dtype=torch.bfloat16)
    return folder


def run_script(name: str, argv: list[str]) -> int:
    threads = torch.get_num_threads()
    try:
        return load_script(BENCHMARKS / name).main(argv)
    finally:
        torch.set_num_threads(threads)  # the scripts set the process-wide thread count


@pytest.mark.long
def test_drafters_quick_writes_result(tmp_path, random_drafters):
    out = tmp_path / "drafters"
    argv = ["--quick", "--no-llama-cpp", "--threads", "1", "--max-new-tokens", "6", "--tau-dtype", "fp32",
            "--drafters", f"dspark={random_drafters / 'dspark'},eagle3={random_drafters / 'eagle3'}", "--out", str(out)]
    assert run_script("drafters.py", argv) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    acc = [r for r in result["rows"] if r["section"] == "acceptance"]
    assert {(r["drafter"], r["temperature"], r["set"]) for r in acc} == {
        (d, t, s) for d in ("dspark", "eagle3") for t in (0.0, 1.0) for s in ("gsm8k", "mt-bench")}
    assert all(r["tau"] >= 1.0 and len(r["position_accept"]) == 7 for r in acc)
    assert result["settings"]["dtype"] == "bf16" and result["settings"]["tau_dtype"] == "fp32"
    speed = [r for r in result["rows"] if r["section"] == "speed"]
    assert [r["system"] for r in speed] == ["plain", "dspark", "eagle3", "dspark-async", "prompt-lookup",
                                             "lookup+dspark"]
    assert all(1 <= r["new_tokens"] <= 6 for r in speed) and not result["settings"]["speed_past_eos"]
    h = result["headline"]
    assert h["dspark_vs_plain_bs1"] == speed[-1]["vs_plain"] > 0  # the default of `dspark generate`: lookup first
    assert h["tau_dspark_over_eagle3"] > 0 and h["dspark_fixed_vs_plain_bs1"] == speed[1]["vs_plain"]
    assert h["prompt_lookup_vs_plain_bs1"] > 0 and h["dspark_async_vs_plain_bs1"] > 0
    assert (tmp_path / "drafters_positions.png").stat().st_size > 1000

    partial = tmp_path / "drafters.partial.json"
    assert not partial.exists()  # removed once the result is written
    # an interrupted run's rows (marked) are reused by --resume; the one it lacks (the last τ row) is measured
    last = len(acc) - 1
    kept = [r | {"commit": "abc1234"} for i, r in enumerate(result["rows"]) if i != last]
    kept[0]["tau"] = 99.0
    partial.write_text(json.dumps({"settings": result["settings"], "rows": kept}))
    with pytest.raises(SystemExit, match="add --resume"):  # never overwritten by a fresh run
        run_script("drafters.py", argv)
    assert run_script("drafters.py", argv + ["--resume"]) == 0
    resumed = json.loads(out.with_suffix(".json").read_text())
    assert resumed["rows"][0] == kept[0] and resumed["resumed_rows_from_commits"] == ["abc1234"]
    assert [(r["drafter"], r["temperature"], r["set"]) for r in resumed["rows"][:len(acc)]] == [
        (r["drafter"], r["temperature"], r["set"]) for r in acc]
    assert [r["commit"] == "abc1234" for r in resumed["rows"]] == [i != last for i in range(len(resumed["rows"]))]
    assert "rows measured at abc1234" in out.with_suffix(".md").read_text()
    partial.write_text(json.dumps({"settings": result["settings"] | {"prompts": 3}, "rows": kept}))
    with pytest.raises(SystemExit, match="other settings"):
        run_script("drafters.py", argv + ["--resume"])


@pytest.mark.long
def test_concurrency_sweep_runs_prompt_lookup_configs(tmp_path, random_drafters):
    out = tmp_path / "lookup"
    assert run_script("concurrency_sweep.py", ["--quick", "--threads", "1", "--drafter", str(random_drafters / "dspark"),
                                               "--configs", "plain,lookup,lookup+dspark", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert {(r["concurrency"], r["config"]) for r in rows} == {(R, c) for R in (1, 3)
                                                               for c in ("plain", "lookup", "lookup+dspark")}
    assert all(r["mean_verified"] > 0 for r in rows if r["config"] == "lookup+dspark")  # the drafter drafts too


@pytest.mark.long
def test_concurrency_sweep_quick_writes_result(tmp_path, random_drafters):
    out = tmp_path / "sweep"
    assert run_script("concurrency_sweep.py", ["--quick", "--threads", "1", "--drafter", str(random_drafters / "dspark"),
                                               "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    configs = {(r["concurrency"], r["config"]) for r in result["rows"]}
    assert configs == {(R, c) for R in (1, 3) for c in ("plain", "fixed3", "algorithm1", "async")}
    for row in result["rows"]:
        assert row["total_tokens_per_s"] > 0 and row["tau"] >= 1.0
        assert row["mean_verified"] == 0 if row["config"] == "plain" else row["mean_verified"] <= 7
    assert "sched_over_best_fixed_min" in result["headline"] and result["cost_table"]["verify_sizes"]
    assert (tmp_path / "sweep_pareto.png").stat().st_size > 1000

    # an interrupted sweep's finished levels (one row marked) are reused by --resume with the same cost table
    from dspark.schedule import CostTable
    table = CostTable(**{k: result["cost_table"][k] for k in ("verify_sizes", "verify_seconds", "draft_sizes",
                                                              "draft_seconds", "meta")}).save(tmp_path / "cost.json")
    rows = result["rows"]
    rows[0]["tau"] = 99.0
    settings = result["settings"] | {"cost_table": str(table)}
    (tmp_path / "sweep.partial.json").write_text(json.dumps({"settings": settings, "rows": rows}))
    argv = ["--quick", "--threads", "1", "--drafter", str(random_drafters / "dspark"), "--out", str(out),
            "--cost-table", str(table), "--resume"]
    assert run_script("concurrency_sweep.py", argv) == 0
    resumed = json.loads(out.with_suffix(".json").read_text())
    assert resumed["rows"] == rows and not (tmp_path / "sweep.partial.json").exists()
    with pytest.raises(SystemExit):  # resuming needs the table the rows were scheduled with
        run_script("concurrency_sweep.py", argv[:-3] + ["--resume"])


@pytest.mark.long
def test_forward_split_quick_writes_result(tmp_path):
    from dspark.layers import Linear

    real = Linear.forward
    out = tmp_path / "split"
    assert run_script("forward_split.py", ["--quick", "--threads", "1", "--out", str(out)]) == 0
    assert Linear.forward is real  # the products are restored
    result = json.loads(out.with_suffix(".json").read_text())
    assert [(r["dtype"], r["tokens"]) for r in result["rows"]] == [("bf16", 1), ("bf16", 2)]
    assert all(0 < r["ms_rest"] < r["ms_forward"] and r["torch_calls"] > 100 for r in result["rows"])
    assert 0 < result["headline"]["rest_share_bf16_b1"] < 1


@pytest.mark.long
def test_tiles_quick_writes_result(tmp_path):
    out = tmp_path / "tiles"
    assert run_script("tiles.py", ["--quick", "--threads", "1", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert [(r["part"], r["size"]) for r in result["rows"]] == [("products", 1), ("products", 4), ("argmax", 1),
                                                                 ("argmax", 4), ("forward", 16), ("attention", 4)]
    assert all(r["ms_new"] > 0 and r["ms_old"] > 0 for r in result["rows"])
    assert "forward_speedup_16" in result["headline"]


@pytest.mark.long
def test_serve_load_quick_loses_nothing(tmp_path):
    out = tmp_path / "load"
    assert run_script("serve_load.py", ["--quick", "--threads", "1", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    row = result["rows"][0]
    assert row["lost_or_corrupted"] == 0 and row["engine_idle_after"] is True
    assert row["greedy_equal_alone"] == 1.0 and row["dropped_streams_started"] == row["dropped_streams"] > 0
    assert row["kv_back_to_idle_s"] <= 1.0 and result["headline"]["server_kv_leaked_blocks"] == 0
    assert result["headline"]["server_over_offline_throughput"] > 0 and result["headline"]["server_lost_responses"] == 0


@pytest.mark.long
def test_train_step_times_trees_and_variants_side_by_side(tmp_path, tiny_target_dir):
    """Both trees (here the same src) train the same steps, each also over a draft vocabulary: rows per drafter,
    tree and variant, equal losses across trees, another loss over the vocabulary, ratios to the first."""
    data = write_train_data(tmp_path / "data.jsonl", [(4 + i % 5, 30 + i) for i in range(24)])
    out = tmp_path / "steps"
    src = Path(__file__).resolve().parent.parent / "src"
    argv = ["--data", str(data), "--target", str(tiny_target_dir), "--drafter-types", "dspark,mtp", "--steps", "1",
            "--rounds", "1", "--baseline-src", str(src), "--variant", "whole={}",
            "--variant", 'vocab={"draft_vocab": 32}', "--out", str(out)]
    assert run_script("train_step.py", argv) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    systems = [("this", "whole"), ("this", "vocab"), ("baseline", "whole"), ("baseline", "vocab")]
    assert [(r["drafter"], r["tree"], r["variant"]) for r in rows] == [(k, *s) for k in ("dspark", "mtp")
                                                                       for s in systems]
    for kind in (rows[:4], rows[4:]):
        assert [r["loss_after"] == kind[0]["loss_after"] for r in kind] == [True, False, True, False]
        assert kind[1]["loss_after"] == kind[3]["loss_after"]
        assert kind[0]["first_over_this"] == 1.0 and all(r["s_per_step"] > 0 for r in kind)
    with pytest.raises(SystemExit, match="NAME=JSON"):
        run_script("train_step.py", [*argv[:-2], "--variant", "bad", "--out", str(out)])


@pytest.mark.long
def test_draft_vocab_quick_writes_result(tmp_path):
    from dspark.draft import DEFAULT_DRAFTER_DIR

    script = load_script(BENCHMARKS / "draft_vocab.py")
    out = tmp_path / "draft_vocab"
    threads = torch.get_num_threads()
    try:
        assert script.main(["--quick", "--drafters", f"dspark={DEFAULT_DRAFTER_DIR}", "--max-new-tokens", "4",
                            "--threads", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.with_suffix(".json").read_text())
    systems = [r["system"] for r in result["rows"]]
    assert systems == ["plain", "dspark", "dspark (whole vocabulary)", "dspark-async", "dspark-async (whole vocabulary)"]
    assert all(r["tokens_per_s"] > 0 for r in result["rows"])
    assert set(result["headline"]) == {"dspark_cut_over_whole", "dspark-async_cut_over_whole"}
    assert "whole vocabulary" in out.with_suffix(".md").read_text()


@pytest.mark.long
def test_heldout_engine_scores_what_the_engine_drafts(tmp_path):
    """Training's c*_1 at the positions where the engine's cycles began equals the engine's own Σ min(p, q) for
    those first drafts (the bundled drafter, a few real prompts): training and inference see the same blocks."""
    from dspark import LLM

    llm = LLM()
    pairs = [("What is 12 times 7?", "12 times 7 is 84."), ("Write a Python function that adds two numbers.",
             "def add(a, b):\n    return a + b"), ("Name three colours.", "Red, green and blue."),
             ("What is the capital of France?", "The capital of France is Paris.")]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "prompt_ids": llm.chat_prompt(q),
                                        "answer_ids": llm.tokenizer.encode(a)}) + "\n" for i, (q, a) in enumerate(pairs)))
    out = tmp_path / "heldout"
    script = load_script(BENCHMARKS / "heldout_engine.py")
    threads = torch.get_num_threads()
    try:
        assert script.main(["--data", str(data), "--quick", "--max-new-tokens", "48", "--threads", "1",
                            "--out", str(out)]) == 0
        with pytest.raises(SystemExit, match="fewer than 2 x --prompts"):
            script.main(["--data", str(data), "--prompts", "3", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["prompts"] for r in rows] == ["held out", "trained on"]
    for r in rows:
        assert r["cycles_scored"] > 5 and r["engine_tau"] >= 1 and 0 < r["c1_cycles"] < 1
        assert r["c1_engine"] == pytest.approx(r["c1_cycles"], rel=0.03)


def test_dspark_peer_stops_at_eos_only_when_asked(base_llm_fp32):
    from benchmarks.peers import DsparkPeer, check_lengths

    prompt = [base_llm_fp32.chat_prompt("Say hello.")]
    full = DsparkPeer(base_llm_fp32, "plain").generate(prompt, 48)[0]
    eos = next(i for i, t in enumerate(full) if t in base_llm_fp32.engine.eos_ids)  # the answer ends inside 48
    assert len(full) == 48
    assert DsparkPeer(base_llm_fp32, "plain", stop_at_eos=True).generate(prompt, 48) == [full[:eos + 1]]
    with pytest.raises(RuntimeError, match="instead of 48"):
        check_lengths("x", [full[:eos + 1]], 48)
    with pytest.raises(RuntimeError, match="instead of 4"):
        check_lengths("x", [full[:5]], 4, stop_at_eos=True)


def test_prefill_quick_writes_result(tmp_path):
    """benchmarks/prefill.py (time to first token, the default prefill against the inexact layer loop) end to end on
    the bundled target, tiny settings; the options in force are as before afterwards."""
    from dspark import options

    script = load_script(BENCHMARKS / "prefill.py")
    out = tmp_path / "prefill"
    threads, before = torch.get_num_threads(), options.current()
    try:
        assert script.main(["--quick", "--no-transformers", "--no-llama-cpp", "--threads", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert options.current() == before
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["benchmark"] == "prefill" and result["settings"]["systems"] == ["dspark",
                                                                                 "dspark, layer loop (inexact)"]
    groups = [r["group"] for r in result["rows"]]
    assert groups == [g for g in ("gsm8k", "humaneval", "mt-bench", "long (2 joined)") for _ in range(2)]
    mean = {r["group"]: r["prompt_tokens_mean"] for r in result["rows"]}
    assert mean["long (2 joined)"] > max(mean["gsm8k"], mean["humaneval"])  # their first turns joined
    for row in result["rows"]:
        assert row["ttft_ms_median"] > 0 and row["prompt_tokens_per_s"] > 0 and row["over_dspark"] > 0
    assert result["headline"]["ttft_loop_over_fused"] > 0
    assert "ttft_loop_over_fused" in out.with_suffix(".md").read_text()


def quick_result(name: str, tmp_path) -> dict:
    """Run benchmarks/NAME.py --quick at one thread into tmp_path; its JSON result."""
    out = tmp_path / name
    threads = torch.get_num_threads()
    try:
        assert load_script(BENCHMARKS / f"{name}.py").main(["--quick", "--threads", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)  # the script sets the process-wide thread count
    return json.loads(out.with_suffix(".json").read_text())


@pytest.mark.long
def test_drafter_cost_quick_writes_result(tmp_path):
    result = quick_result("drafter_cost", tmp_path)
    assert set(result["headline"]) == {"dspark_block_over_plain_step", "dspark_block_over_plain_step_t0"}
    for row in result["rows"]:
        assert row["block_calls"] > 0 and row["ms_backbone"] > 0 and row["block_over_plain_step"] > 0


@pytest.mark.long
def test_drift_quick_writes_result(tmp_path):
    result = quick_result("drift", tmp_path)
    assert set(result["headline"]) == {"drift_ece_static", "drift_ece_refit", "drift_refit_over_static_throughput",
                                       "drift_detection_steps", "drift_false_alarms", "page_overhead",
                                       "page_cpu_share"}
    assert {r["arm"] for r in result["rows"]} == {"static", "refit"} and (tmp_path / "drift_ece.png").is_file()
