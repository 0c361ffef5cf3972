"""Confidence-scheduled verification across load: total and per-request tokens/s at R concurrent requests for
plain decoding, fixed γ, a static threshold, Algorithm 1 and the asynchronous scheduler, on the default target
with the default drafter, and (configs lookup, lookup+dspark) prompt lookup at fixed γ 7, alone or first with the
drafter elsewhere; plus the Pareto frontier (per-request speed against total throughput).

    python benchmarks/concurrency_sweep.py                 # the full sweep; writes benchmarks/results/concurrency_sweep.*
    python benchmarks/concurrency_sweep.py --quick         # smoke test

At each R the engine keeps R requests in flight (continuous batching; a finished request's place is taken by
the next) over 2R requests (at least --min-requests), prompts from the eval sets, --max-new-tokens each, at
--temperature with fixed seeds; every configuration runs the same requests, configurations interleaved per
R and repeat. The cost table is profiled once at the start (or read with --cost-table) and corrected online.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (DEFAULT_DATA_DIR, add_presets, apply_presets, finish, RESULTS_DIR, Log, load_prompts, markdown_table,  # noqa: E402
                               Partial, result_header, result_preamble)
from dspark.config import DTYPE_CHOICES  # noqa: E402
from dspark import LLM, SamplingParams  # noqa: E402
from dspark.schedule import CostTable  # noqa: E402
from dspark.engine.profile import profile_engine  # noqa: E402

DEFAULT_DRAFTER = "default"
FULL = {"concurrency": "1,2,4,8,16,32,64", "max_new_tokens": 96, "min_requests": 6, "repeats": 2,
        "configs": "plain,fixed1,fixed3,fixed5,fixed7,threshold,algorithm1,async"}
QUICK = {"concurrency": "1,3", "max_new_tokens": 8, "min_requests": 3, "repeats": 1,
         "configs": "plain,fixed3,algorithm1,async"}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_presets(p, FULL, QUICK)
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, help="drafter folder [the bundled default drafter]")
    p.add_argument("--threshold", type=float, default=0.5, help="prefix survival of the threshold baseline [%(default)s]")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", default="bf16", choices=DTYPE_CHOICES)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cost-table", default=None, help="a table from `dspark profile` (default: profile now)")
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    p.add_argument("--out", default=str(RESULTS_DIR / "concurrency_sweep"))
    p.add_argument("--resume", action="store_true", help="reuse the concurrency levels an interrupted run with the "
                   "same settings finished (kept in OUT.partial.json); needs --cost-table, so that both runs schedule "
                   "with the same table")
    args = apply_presets(p.parse_args(argv), FULL, QUICK)
    if args.resume and not args.cost_table:
        p.error("--resume needs --cost-table (profile once with `dspark profile --out FILE`)")
    return args


LOOKUP = {"lookup": "prompt-lookup", "lookup+dspark": "lookup+"}  # fixed γ 7; lookup+dspark: then the drafter


def scheduler_of(config: str) -> tuple[str, int]:
    """(scheduler name, γ) of a configuration name."""
    if config.startswith("fixed"):
        return "fixed", int(config[5:])
    return config, 7


def run(llm: LLM, prompts: list[list[int]], R: int, params: list[SamplingParams]) -> dict:
    engine = llm.engine
    engine.config.max_num_seqs = R
    engine.stats.clear()
    start = time.perf_counter()
    reqs = [engine.add_request(ids, sp) for ids, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = time.perf_counter()
    wall = time.perf_counter() - start
    errors = [r.error for r in reqs if r.finish_reason == "error"]
    if errors:
        raise RuntimeError(errors[0])
    tokens = {r.request_id: len(r.output_ids) for r in reqs}
    steps = [s for s in engine.stats if s.num_requests]
    verified = [v for s in steps for v in s.verified]
    # a request's own speed: its tokens over the time from its admission (not its wait in the queue)
    per_request = [tokens[r.request_id] / (done[r.request_id] - r.admitted_at) for r in reqs]
    expected = [s.expected_tau / s.num_requests for s in steps if s.expected_tau is not None]
    return {"total_tokens_per_s": sum(tokens.values()) / wall, "per_request_tokens_per_s": statistics.mean(per_request),
            "mean_verified": statistics.mean(verified) if verified else 0.0,
            "tau": sum(s.tokens for s in steps) / max(sum(s.num_requests for s in steps), 1),
            "expected_tau": statistics.mean(expected) if expected else None,
            "mean_B": statistics.mean(s.verify_tokens for s in steps) if steps else 0.0,
            "steps": len(steps), "seconds": wall, "tokens": sum(tokens.values())}


def pareto_plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for config in dict.fromkeys(r["config"] for r in rows):
        sel = sorted((r for r in rows if r["config"] == config), key=lambda r: r["concurrency"])
        style = "o-" if config in ("algorithm1", "async") else ".--"
        ax.plot([r["total_tokens_per_s"] for r in sel], [r["per_request_tokens_per_s"] for r in sel], style,
                label=config, lw=1.6 if style == "o-" else 0.9)
        for r in sel:
            if config == "async":
                ax.annotate(f"R={r['concurrency']}", (r["total_tokens_per_s"], r["per_request_tokens_per_s"]),
                            fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("total tokens/s")
    ax.set_ylabel("per-request tokens/s")
    ax.set_xscale("log")
    ax.set_title("Pareto frontier: per-request speed against throughput", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def headline(rows: list[dict]) -> dict:
    ratios, best_fixed = [], {}
    for R in sorted({r["concurrency"] for r in rows}):
        at = {r["config"]: r["total_tokens_per_s"] for r in rows if r["concurrency"] == R}
        fixed = {c: v for c, v in at.items() if c.startswith("fixed")}
        sched = [at[c] for c in ("algorithm1", "async") if c in at]
        if fixed and sched:
            best_fixed[R] = max(fixed, key=fixed.get)
            ratios.append(max(sched) / max(fixed.values()))
    h = {}
    if ratios:
        h["sched_over_best_fixed_min"] = min(ratios)
    top = max(r["concurrency"] for r in rows)
    at = {r["config"]: r["total_tokens_per_s"] for r in rows if r["concurrency"] == top}
    if "fixed7" in at:
        for c in ("algorithm1", "async"):
            if c in at:
                h[f"{c}_over_fixed7_at_max_concurrency"] = at[c] / at["fixed7"]
        h["sched_over_fixed7_at_max_concurrency"] = max(at.get("algorithm1", 0), at.get("async", 0)) / at["fixed7"]
    for R in sorted({r["concurrency"] for r in rows}):  # the one-stream rule of `auto`: does a drafter pay at R?
        at = {r["config"]: r["total_tokens_per_s"] for r in rows if r["concurrency"] == R}
        for c in ("async", "lookup", "lookup+dspark"):
            if c in at and "plain" in at:
                h[f"{c}_over_plain_r{R}"] = at[c] / at["plain"]
    h["best_fixed_by_concurrency"] = best_fixed
    return h


def markdown(result: dict) -> str:
    rows = result["rows"]
    table = markdown_table(rows, ["concurrency", "config", "total_tokens_per_s", "total_min", "total_max",
                                  "per_request_tokens_per_s", "mean_verified", "tau", "expected_tau", "mean_B"])
    head = {k: v for k, v in result["headline"].items() if not isinstance(v, dict)}
    partial = [] if result.get("complete", True) else [
        f"\n**Incomplete**: the run stopped after R = {max(r['concurrency'] for r in rows)}.\n"]
    return "\n".join([result_preamble(result), *partial, table, "\n## Headline\n",
                      markdown_table([{"figure": k, "value": v} for k, v in head.items()], ["figure", "value"]),
                      f"\nbest fixed γ by concurrency: {result['headline'].get('best_fixed_by_concurrency')}",
                      f"\n![Pareto frontier]({result.get('pareto_png', 'concurrency_sweep_pareto.png')})"])


def measure_level(llms: dict[str, LLM], prompts: list[list[int]], R: int, args, log, partial: Partial) -> list[dict]:
    """Every configuration at R concurrent requests, --repeats times interleaved; one row each (medians)."""
    configs = list(llms)
    n = max(2 * R, args.min_requests)
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens, seed=i, ignore_eos=True)
              for i in range(n)]
    runs = {c: [] for c in configs}
    for rep in range(args.repeats):
        for config in configs[rep % len(configs):] + configs[:rep % len(configs)]:
            runs[config].append(run(llms[config], prompts[:n], R, params))
    rows = []
    for config in configs:
        m = runs[config]
        row = {"concurrency": R, "config": config, "requests": n,
               **{k: statistics.median(x[k] for x in m) for k in m[0] if m[0][k] is not None},
               "total_min": min(x["total_tokens_per_s"] for x in m),
               "total_max": max(x["total_tokens_per_s"] for x in m)}
        rows.append(row)
        partial.add(row)
        log(f"R={R} {config}: {row['total_tokens_per_s']:.1f} tok/s total, "
            f"{row['per_request_tokens_per_s']:.1f} per request, ℓ {row['mean_verified']:.2f}, τ {row['tau']:.2f}")
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    log = Log()
    levels = [int(x) for x in args.concurrency.split(",")]
    configs = args.configs.split(",")
    drafter = None if args.drafter == DEFAULT_DRAFTER else args.drafter
    base = LLM(drafter=drafter or "default", dtype=args.dtype, max_num_seqs=max(levels))
    if args.cost_table:
        cost = CostTable.load(args.cost_table)
    else:
        log("profiling the cost table")
        cost = profile_engine(base.engine, max_requests=max(levels), progress=False)
    llms = {}
    for config in configs:
        name, gamma = scheduler_of(config)
        if name == "plain":
            llms[config] = base.sibling("none", "fixed", gamma=0)
        elif name in LOOKUP:  # prompt lookup (first), the one-stream default of `dspark generate` for lookup+dspark
            spec = LOOKUP[name] + (drafter or "default") if name == "lookup+dspark" else LOOKUP[name]
            llms[config] = base.sibling(spec, "fixed", gamma=7)
        else:
            llms[config] = base.sibling(drafter or "default", name, gamma=gamma, threshold=args.threshold,
                                        cost_table=CostTable(**{**cost.__dict__, "correction": []}))
    texts = load_prompts(args.data_dir, max(max(levels) * 2, args.min_requests))
    prompts = [base.chat_prompt(t["text"]) for t in texts]
    result = result_header("concurrency_sweep", __file__, argv)
    result["settings"] = {k: getattr(args, k) for k in (*FULL, "temperature", "dtype", "threshold", "drafter",
                                                         "cost_table", "threads")}
    result["pareto_png"] = f"{Path(args.out).name}_pareto.png"
    result["cost_table"] = {"verify_sizes": cost.verify_sizes, "verify_seconds": cost.verify_seconds,
                            "draft_sizes": cost.draft_sizes, "draft_seconds": cost.draft_seconds,
                            "draft_seconds_one": cost.draft_seconds_one, "draft_depth": cost.draft_depth,
                            "staircase": cost.staircase(), "meta": cost.meta}
    result["settings"]["cost_table_verify_seconds"] = cost.verify_seconds  # resume only on the same table
    partial = Partial(args.out, result, args.resume)
    rows = []
    for R in levels:
        if done := partial.group("config", configs, concurrency=R):
            rows += done
            log(f"R={R}: {len(done)} configurations from {partial.path.name}")
        else:
            rows += measure_level(llms, prompts, R, args, log, partial)
        # written after every R, so an interrupted sweep keeps what it measured
        result["rows"], result["headline"] = rows, headline(rows)
        result["complete"] = R == levels[-1]
        code = finish(result, args.out, markdown, {"pareto": lambda path: pareto_plot(rows, path)}, log)
    partial.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
