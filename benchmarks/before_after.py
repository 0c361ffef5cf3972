"""This checkout's speed against another checkout's, side by side: one stream, greedy, on the bundled target.

Each tree (this one, and --baseline-src: another checkout's src folder) runs in a worker process of its own that
loads the bundled target once and keeps one engine per system: plain decoding, the default of `dspark generate`
(lookups first, the bundled DSpark drafter elsewhere), the DSpark drafter verifying every draft (fixed γ), and
plain decoding of --batch requests at once. Prompts are interleaved: prompt i runs on every (tree, system) before
prompt i + 1, in an order that rotates with i, so drifts of the machine's speed fall on every row alike. Each row is
a median over prompts of tokens/s (decode and prefill, wall time per answer) with its spread; the headline is this
tree over the baseline for each system (`after_over_before_SYSTEM`).

    git worktree add ../before <commit>     # the checkout to compare against
    python benchmarks/before_after.py --baseline-src ../before/src
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (DEFAULT_DATA_DIR, REPO_ROOT, RESULTS_DIR, Log, add_presets, apply_presets, finish,  # noqa: E402
                               load_prompts, markdown_table, result_header, result_preamble)

SYSTEMS = {"plain": ("none", "fixed", 1), "default": ("auto", "auto", 1), "dspark_fixed": ("default", "fixed", 1),
           "plain_batch": ("none", "fixed", None)}
FULL = {"prompts": 24, "max_tokens": 256, "batch": 16}
QUICK = {"prompts": 2, "max_tokens": 8, "batch": 2}


def worker(args) -> None:
    """Serve timing requests on stdin: {"system", "prompts": [texts]} -> {"seconds", "tokens"} on stdout."""
    import torch

    from dspark import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    base = LLM(max_num_seqs=1)
    engines = {name: base.sibling(drafter, scheduler, max_num_seqs=seqs or args.batch)
               for name, (drafter, scheduler, seqs) in SYSTEMS.items()}
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for llm in engines.values():  # warm: kernels built, drafters loaded, tables made
        llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), chat=True)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        t0 = time.perf_counter()
        outs = engines[ask["system"]].generate(ask["prompts"], greedy, chat=True)
        seconds = time.perf_counter() - t0
        print(json.dumps({"seconds": seconds, "tokens": sum(len(o.token_ids) for o in outs),
                          "ids": [o.token_ids for o in outs]}), flush=True)


class Worker:
    def __init__(self, src: Path, args):
        cmd = [sys.executable, __file__, "--worker", "--threads", str(args.threads), "--max-tokens",
               str(args.max_tokens), "--batch", str(args.batch)]
        self.proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(src)}, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        if not json.loads(self.proc.stdout.readline()).get("ready"):
            raise SystemExit(f"the worker on {src} did not start")

    def time(self, system: str, prompts: list[str]) -> dict:
        self.proc.stdin.write(json.dumps({"system": system, "prompts": prompts}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def run(args, argv) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    log = Log()
    prompts = [p["text"] for p in load_prompts(args.data_dir, max(args.prompts, args.batch))]
    trees = {"after": REPO_ROOT / "src", "before": Path(args.baseline_src).resolve()}
    if not (trees["before"] / "dspark").is_dir():
        raise SystemExit(f"--baseline-src must be a src folder holding dspark/: {trees['before']}")
    workers = {name: Worker(src, args) for name, src in trees.items()}
    pairs = [(t, s) for s in SYSTEMS for t in trees]
    speed = {pair: [] for pair in pairs}
    same = {s: 0 for s in SYSTEMS}
    for i in range(args.prompts):
        k = i % len(pairs)
        outs = {}
        for tree, system in pairs[k:] + pairs[:k]:
            batch = prompts[i:i + 1] if SYSTEMS[system][2] == 1 else [prompts[(i + j) % len(prompts)]
                                                                      for j in range(args.batch)]
            got = workers[tree].time(system, batch)
            speed[tree, system].append(got["tokens"] / got["seconds"])
            outs[tree, system] = got["ids"]
        for system in SYSTEMS:
            same[system] += outs["after", system] == outs["before", system]
        log(f"prompt {i + 1}/{args.prompts}: " + ", ".join(
            f"{s} {speed['after', s][-1] / speed['before', s][-1]:.3f}" for s in SYSTEMS))
    for w in workers.values():
        w.close()
    rows = []
    for system in SYSTEMS:
        ratios = [a / b for a, b in zip(speed["after", system], speed["before", system])]
        for tree in trees:
            v = speed[tree, system]
            rows.append({"system": system, "tree": tree, "tokens_per_s": statistics.median(v), "min": min(v),
                         "max": max(v), "prompts": len(v)})
        rows.append({"system": system, "tree": "after / before", "tokens_per_s": statistics.median(ratios),
                     "min": min(ratios), "max": max(ratios), "prompts": len(ratios),
                     "same_output": same[system] / args.prompts})
    result = {**result_header("before_after", __file__, argv),
              "settings": {"prompts": args.prompts, "max_tokens": args.max_tokens, "batch": args.batch,
                           "threads": args.threads, "baseline_src": str(trees["before"]),
                           "baseline_commit": baseline_commit(trees["before"]), "systems": SYSTEMS},
              "rows": rows}
    result["headline"] = {f"after_over_before_{r['system']}": r["tokens_per_s"] for r in rows
                          if r["tree"] == "after / before"}
    return result


def baseline_commit(src: Path) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=src, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(result: dict) -> str:
    s = result["settings"]
    return (result_preamble(result) + f"\nbaseline: {s['baseline_src']} at {s['baseline_commit']}; {s['prompts']} "
            f"prompts, greedy, {s['max_tokens']} tokens at most, one stream (plain_batch: {s['batch']} requests at "
            "once); tokens/s per answer (prefill included), medians over prompts with min and max; the ratio rows "
            "are medians of per-prompt ratios.\n\n"
            + markdown_table(result["rows"], ["system", "tree", "tokens_per_s", "min", "max", "prompts",
                                              "same_output"]))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-src", help="another checkout's src folder (required)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each worker (default: %(default)s)")
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR), help="eval sets folder (default: %(default)s)")
    p.add_argument("--out", default=str(RESULTS_DIR / "before_after"), help="result path without suffix")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    add_presets(p, FULL, QUICK)
    args = apply_presets(p.parse_args(argv), FULL, QUICK)
    if args.worker:
        worker(args)
        return 0
    if not args.baseline_src:
        p.error("--baseline-src is required")
    return finish(run(args, argv), args.out, markdown, {}, Log())


if __name__ == "__main__":
    sys.exit(main())
