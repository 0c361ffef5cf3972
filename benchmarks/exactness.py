"""Speculative greedy output against plain greedy output, prompt by prompt, in bf16 and float32.

Plain decoding answers each prompt alone (the reference). Then every drafter (the bundled DSpark drafter, the DFlash,
Eagle3-style and MTP-1 baselines, prompt lookup, and the default of `dspark generate`: lookups first, DSpark
elsewhere) answers the same prompts under each scheduler it runs with (fixed γ; DSpark also threshold, Algorithm 1
and async), `--batch` requests at a time, so verify forwards hold requests of different widths; the default runs one
stream, as `dspark generate` does. A prompt counts as a mismatch when its tokens differ from the reference anywhere;
the first differing position is kept. Headline: greedy_mismatch_bf16 and greedy_mismatch_fp32, the prompts that
differ over all systems of that dtype (the numerics contract makes both 0; docs/method.md, "Exactness").

    python benchmarks/exactness.py                    # 50 prompts (10 from each of five eval sets), 256 tokens
    python benchmarks/exactness.py --quick            # a smoke run
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (DEFAULT_DATA_DIR, RESULTS_DIR, Log, Partial, add_presets, apply_presets, finish,  # noqa: E402
                               load_prompts, markdown_table, result_header, result_preamble)

SETS = ("gsm8k", "humaneval", "mt-bench", "math500", "mbpp")
REPO_DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"
# (system name, drafter, scheduler, one stream)
SYSTEMS = [("dspark fixed", "default", "fixed", False), ("dspark threshold", "default", "threshold", False),
           ("dspark algorithm1", "default", "algorithm1", False), ("dspark async", "default", "async", False),
           ("dflash fixed", str(REPO_DRAFTERS / "smollm2-135m-dflash"), "fixed", False),
           ("eagle3 fixed", str(REPO_DRAFTERS / "smollm2-135m-eagle3"), "fixed", False),
           ("mtp1 fixed", str(REPO_DRAFTERS / "smollm2-135m-mtp1"), "fixed", False),
           ("prompt lookup fixed", "prompt-lookup", "fixed", False),
           ("default (generate)", "auto", "auto", True)]
FULL = {"prompts": 50, "max_tokens": 256, "batch": 8}
QUICK = {"prompts": 5, "max_tokens": 12, "batch": 3}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run(args) -> dict:
    from dspark import LLM, SamplingParams, options
    from dspark.schedule import CostTable

    torch.set_num_threads(args.threads)
    log = Log()
    prompts = load_prompts(args.data_dir, args.prompts, SETS)
    result = result_header("exactness", __file__, sys.argv[1:])
    result["settings"] = {"prompts": len(prompts), "sets": list(SETS), "max_tokens": args.max_tokens,
                          "batch": args.batch, "dtypes": args.dtypes, "systems": [s[0] for s in SYSTEMS],
                          "options": dataclasses.asdict(options.current())}
    # the cost-table schedulers run on a fixed table of this machine's shape (not profiled: the answer must not
    # depend on it, and a profile costs minutes)
    cost = CostTable(list(range(1, 513)), [0.04 + 0.0015 * max(0, b - 8) for b in range(1, 513)], [1, 512],
                     [0.005, 0.5])
    partial = Partial(args.out, result, args.resume)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for dtype in args.dtypes:
        base = LLM(dtype=dtype, max_num_seqs=1)
        ids = [base.chat_prompt(p["text"]) for p in prompts]
        plain = partial.find(dtype=dtype, system="plain")
        if plain is None:
            log(f"{dtype}: plain decoding, {len(ids)} prompts alone")
            outs = [base.generate(x, greedy)[0].token_ids for x in ids]
            partial.add({"dtype": dtype, "system": "plain", "outputs": outs, "tokens": sum(map(len, outs))})
            plain = partial.find(dtype=dtype, system="plain")
        for name, drafter, scheduler, one_stream in SYSTEMS:
            if partial.find(dtype=dtype, system=name):
                continue
            llm = base.sibling(drafter, scheduler, cost_table=cost, max_num_seqs=1 if one_stream else args.batch)
            outs = llm.generate(ids, greedy)
            diffs = [first_difference(o.token_ids, p) for o, p in zip(outs, plain["outputs"])]
            row = {"dtype": dtype, "system": name, "drafter": drafter.rsplit("/", 1)[-1], "scheduler": scheduler,
                   "batch": 1 if one_stream else args.batch, "mismatches": sum(d is not None for d in diffs),
                   "first_differences": [[prompts[i]["set"], prompts[i]["index"], d] for i, d in enumerate(diffs)
                                         if d is not None],
                   "tokens": sum(len(o.token_ids) for o in outs),
                   "accepted_per_step": sum(o.drafts_accepted for o in outs) / max(1, sum(o.steps for o in outs))}
            log(f"{dtype} {name}: {row['mismatches']} of {len(ids)} prompts differ")
            partial.add(row)
    rows = [r for r in partial.rows if r["system"] != "plain"]
    result["rows"] = rows
    result["headline"] = {f"greedy_mismatch_{d}": len({(s, i) for r in rows if r["dtype"] == d
                                                       for s, i, _ in r["first_differences"]})
                          for d in args.dtypes}
    partial.close()
    return result


def markdown(result: dict) -> str:
    s = result["settings"]
    o = s["options"]
    return (result_preamble(result) + f"\n{s['prompts']} prompts ({', '.join(s['sets'])}, the first of each in turn), "
            f"greedy, {s['max_tokens']} tokens at most; each system against plain decoding of each prompt alone, "
            f"{s['batch']} requests at a time (the default: one stream). Options: exact={o['exact']}, "
            f"kernels={o['kernels']}, fused={o['fused']}, tiles={o['tiles']}.\n\n"
            + markdown_table(result["rows"], ["dtype", "system", "batch", "mismatches", "tokens", "accepted_per_step"])
            + "\n\nHeadline: " + ", ".join(f"{k} = {v}" for k, v in result["headline"].items()) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR), help="eval sets folder (default: %(default)s)")
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], help="(default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    p.add_argument("--out", default=str(RESULTS_DIR / "exactness"), help="result path without suffix")
    p.add_argument("--resume", action="store_true", help="go on from OUT.partial.json after a kill")
    add_presets(p, FULL, QUICK)
    args = apply_presets(p.parse_args(argv), FULL, QUICK)
    result = run(args)
    return finish(result, args.out, markdown, {}, Log())


if __name__ == "__main__":
    sys.exit(main())
