"""Time to first token of one request on the bundled target (greedy, one request at a time): dspark's prefill as
it runs by default (bf16 on AMX: fused_layers.cpp, `fused_layers.fuses_prefill`) against the same engine with
Options(fused=False, exact=False) (PyTorch's layer loop with oneDNN products), transformers and llama.cpp where installed, each prompt
through every system in turn (the order rotating), --repeats rounds.

    python benchmarks/prefill.py            # writes benchmarks/results/prefill.json and .md
    python benchmarks/prefill.py --quick    # smoke test

Prompts: the first user turns of --prompt-sets (the chat template applied), --prompts of each, and --long prompts
that each join --join consecutive ones (round robin over the sets) with blank lines, long enough to run in several
chunks of fused_layers.MAX_TOKENS. A system's time to first token is one generate call of one token (prefill, LM
head, sampling and the engine around them). Reported per group: the median over prompts (each prompt's median over
rounds), prompt tokens per second over the group, and the median over prompts of each system's time over the
default's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (DEFAULT_DATA_DIR, RESULTS_DIR, Log, add_presets, apply_presets, finish,  # noqa: E402
                               load_prompts, markdown_table, result_header, result_preamble, timed)
from benchmarks.peers import (DsparkPeer, LlamaCppPeer, TransformersPeer, llama_cpp_problem,  # noqa: E402
                              load_transformers)
from dspark import LLM, options  # noqa: E402
from dspark.kernels.fused_layers import MAX_TOKENS, fuses_prefill  # noqa: E402
from dspark.target.loading import bundled_gguf  # noqa: E402

FULL = {"prompts": 10, "long": 6, "join": 4, "repeats": 3}
QUICK = {"prompts": 1, "long": 1, "join": 2, "repeats": 1}
FUSED, LOOP, HF, LLAMA = "dspark", "dspark, layer loop (inexact)", "transformers", "llama.cpp"


class LayerLoopPeer(DsparkPeer):
    """The same engine with Options(fused=False, exact=False) while it runs: its prefill (and any step) in PyTorch's
    layer loop with oneDNN's (or upcast.py's float32) products, as before the numerics contract."""

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        with options.using(fused=False, exact=False):
            return super().generate(prompts, n)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_presets(p, FULL, QUICK)
    p.add_argument("--prompt-sets", default="gsm8k,humaneval,mt-bench", help="eval sets the prompts come from "
                   "(first user turn of eval_NAME.jsonl) [%(default)s]")
    p.add_argument("--dtype", default="bf16",
                   help="the target's dtype (the fused prefill runs bf16 on AMX) [%(default)s]")
    p.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads [%(default)s]")
    p.add_argument("--no-transformers", action="store_true", help="leave transformers out")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out even where installed")
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR), help="folder of eval_*.jsonl [../shared/data]")
    p.add_argument("--out", default=str(RESULTS_DIR / "prefill"), help="result path without suffix [%(default)s]")
    return apply_presets(p.parse_args(argv), FULL, QUICK)


def prompt_groups(llm, args) -> dict[str, list[list[int]]]:
    """{group: prompt token ids}: each set's first turns, and the joined long ones."""
    sets = tuple(s for s in args.prompt_sets.split(",") if s)
    rows = load_prompts(args.data_dir, len(sets) * max(args.prompts, args.long * args.join), sets)
    groups = {s: [llm.chat_prompt(r["text"]) for r in rows if r["set"] == s][:args.prompts] for s in sets}
    texts = [r["text"] for r in rows]
    groups[f"long ({args.join} joined)"] = [llm.chat_prompt("\n\n".join(texts[i * args.join:(i + 1) * args.join]))
                                            for i in range(args.long)]
    return {g: ids for g, ids in groups.items() if ids}


def time_to_first_token(peers: list, groups: dict[str, list[list[int]]], repeats: int, log) -> dict:
    """{(system, group): [each prompt's median seconds over the rounds]}, prompts through the peers in turn."""
    times: dict[tuple[str, str, int], list[float]] = {}
    turn = 0
    for round_ in range(repeats):
        for group, prompts in groups.items():
            for i, ids in enumerate(prompts):
                order = peers[turn % len(peers):] + peers[:turn % len(peers)]
                turn += 1
                for peer in order:
                    _, seconds = timed(peer.generate, [ids], 1)
                    times.setdefault((peer.name, group, i), []).append(seconds)
        log(f"round {round_ + 1}/{repeats} done")
    out: dict[tuple[str, str], list[float]] = {}
    for (system, group, _), values in times.items():
        out.setdefault((system, group), []).append(statistics.median(values))
    return out


def rows_of(times: dict, groups: dict, peers: list) -> list[dict]:
    rows = []
    for group, prompts in groups.items():
        lengths = [len(p) for p in prompts]
        base = times[FUSED, group]
        for peer in peers:
            ttft = times[peer.name, group]
            rows.append({"system": peer.name, "group": group, "prompts": len(prompts),
                         "prompt_tokens_mean": statistics.mean(lengths), "prompt_tokens_max": max(lengths),
                         "ttft_ms_median": 1e3 * statistics.median(ttft), "ttft_ms_min": 1e3 * min(ttft),
                         "ttft_ms_max": 1e3 * max(ttft), "prompt_tokens_per_s": sum(lengths) / sum(ttft),
                         "over_dspark": statistics.median(t / b for t, b in zip(ttft, base))})
    return rows


def headline(times: dict, peers: list) -> dict:
    """Each peer's time over the default's, the median over every prompt of every group."""
    names = {LOOP: "ttft_loop_over_fused", HF: "ttft_transformers_over_dspark", LLAMA: "ttft_llamacpp_over_dspark"}
    out = {}
    for peer in peers:
        if peer.name in names:
            ratios = [t / b for (system, group), ttft in times.items() if system == peer.name
                      for t, b in zip(ttft, times[FUSED, group])]
            out[names[peer.name]] = statistics.median(ratios)
    return out


def markdown(result: dict) -> str:
    s = result["settings"]
    fused = ("runs through fused_layers.cpp (bf16 on AMX)" if s["fused_prefill"] else
             "runs in the layer loop on this machine too (no AMX or not bf16), so the first two rows are one path")
    return "\n".join([
        result_preamble(result),
        f"Time to first token, one request at a time, {s['dtype']} target; dspark's default prefill {fused}, in chunks "
        f"of at most {s['max_tokens_per_chunk']} tokens. Medians over prompts of each prompt's median over "
        f"{s['repeats']} rounds; over_dspark: the median over prompts of the system's time over dspark's.\n",
        markdown_table(result["rows"], ["system", "group", "prompts", "prompt_tokens_mean", "ttft_ms_median",
                                        "ttft_ms_min", "ttft_ms_max", "prompt_tokens_per_s", "over_dspark"]),
        "", "Headline: " + ", ".join(f"{k} {v:.3g}" for k, v in result["headline"].items())])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    log = Log()
    llm = LLM(dtype=args.dtype, drafter="none", max_num_seqs=1)
    groups = prompt_groups(llm, args)
    peers = [DsparkPeer(llm, FUSED), LayerLoopPeer(llm, LOOP)]
    if not args.no_transformers:
        model, tokenizer = load_transformers(llm.target_path, llm.config.torch_dtype)
        peers.append(TransformersPeer(model, tokenizer, HF))
    problem = None if args.no_llama_cpp else llama_cpp_problem()
    if not args.no_llama_cpp and not problem:
        longest = max(len(p) for prompts in groups.values() for p in prompts)
        peers.append(LlamaCppPeer(bundled_gguf(), args.threads, n_ctx=longest + 64))
    elif problem:
        log(f"llama.cpp left out: {problem}")
    for peer in peers:  # warm-up: every path once
        peer.generate([next(iter(groups.values()))[0]], 1)
    times = time_to_first_token(peers, groups, args.repeats, log)
    result = result_header("prefill", __file__, argv)
    result["settings"] = {**vars(args), "fused_prefill": fuses_prefill(llm.engine.target),
                          "max_tokens_per_chunk": MAX_TOKENS, "systems": [p.name for p in peers],
                          "llama_cpp_problem": problem}
    result["rows"] = rows_of(times, groups, peers)
    result["headline"] = headline(times, peers)
    return finish(result, args.out, markdown, {}, log)


if __name__ == "__main__":
    sys.exit(main())
