"""What one DSpark block call costs against one plain decode step, single request: the bundled drafter at fixed
γ = 7 (each call drafts the whole block) and plain decoding answer the same prompts, interleaved prompt by prompt
(the order alternating), at T = 0 and T = 1. Per call, the time splits into the context update (the features of the
tokens committed since the last call projected into the drafter's cache), the backbone (its layers over the block),
the LM head over the block (its draft-vocabulary rows) and the rest (the sequential Markov and confidence heads,
sampling, glue).

Headline: dspark_block_over_plain_step (T = 1) and dspark_block_over_plain_step_t0: the median block call over the
median plain decode step, both measured in the same run.

    python benchmarks/drafter_cost.py                 # 10 prompts of the five eval sets, 128 tokens, 2 repeats
    python benchmarks/drafter_cost.py --quick         # smoke test
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (DEFAULT_DATA_DIR, RESULTS_DIR, Log, add_presets, apply_presets, finish,  # noqa: E402
                               load_prompts, markdown_table, result_header, result_preamble, spread)
from dspark import LLM, SamplingParams  # noqa: E402
from dspark.config import DTYPE_CHOICES  # noqa: E402

FULL = {"sets": "gsm8k,humaneval,mt-bench,math500,mbpp", "prompts": 10, "max_new_tokens": 128, "repeats": 2}
QUICK = {"sets": "gsm8k", "prompts": 1, "max_new_tokens": 8, "repeats": 1}
PARTS = ("flush", "backbone", "base_logits")  # timed drafter methods; "rest" is the call less these
PART_NAMES = {"flush": "context", "backbone": "backbone", "base_logits": "lm_head"}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_presets(p, FULL, QUICK)
    p.add_argument("--drafter", default="default", help="the DSpark drafter (default: the bundled one)")
    p.add_argument("--dtype", default="bf16", choices=DTYPE_CHOICES)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    p.add_argument("--out", default=str(RESULTS_DIR / "drafter_cost"))
    return apply_presets(p.parse_args(argv), FULL, QUICK)


class CallTimer:
    """Seconds of each call of the drafter's propose and of the parts it calls, call by call."""

    def __init__(self, drafter):
        self.calls: list[dict] = []
        self.current: dict | None = None
        for name in PARTS:
            owner = drafter if hasattr(type(drafter), name) else drafter.model
            setattr(owner, name, self.part(name, getattr(owner, name)))
        drafter.propose = self.whole(drafter.propose)

    def part(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.current is not None:
                self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - t0
            return out
        return timed

    def whole(self, fn):
        def timed(*args, **kwargs):
            self.current = {}
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.current["total"] = time.perf_counter() - t0
            if out.lengths.numel() and int(out.lengths.max()):
                self.calls.append(self.current)
            self.current = None
            return out
        return timed


def decode_steps(llm: LLM) -> list[float]:
    """Seconds of each decode step (prefill excluded) since the stats were last cleared."""
    return [s.t_total - s.t_prefill for s in llm.engine.stats if s.num_requests]


def measure(plain: LLM, spec: LLM, timer: CallTimer, prompts: list[str], temperature: float, args, log) -> dict:
    steps, per_prompt = [], []
    for rep in range(args.repeats):
        for i, prompt in enumerate(prompts):
            sp = SamplingParams(temperature=temperature, max_tokens=args.max_new_tokens, seed=i)
            first = len(timer.calls)
            order = (plain, spec) if (rep + i) % 2 == 0 else (spec, plain)
            for llm in order:
                llm.engine.stats.clear()
                llm.generate([prompt], sp, chat=True)
            mine = decode_steps(plain)
            calls = [c["total"] for c in timer.calls[first:]]
            steps += mine
            if calls and mine:
                per_prompt.append(statistics.median(calls) / statistics.median(mine))
        log(f"T = {temperature}: repeat {rep + 1}/{args.repeats}, {len(timer.calls)} block calls")
    calls = timer.calls
    row = {"temperature": temperature, "block_calls": len(calls), "plain_steps": len(steps),
           "ms_plain_step": 1e3 * statistics.median(steps), "ms_block_call": 1e3 * statistics.median(c["total"] for c in calls)}
    for name in PARTS:
        row[f"ms_{PART_NAMES[name]}"] = 1e3 * statistics.median(c.get(name, 0.0) for c in calls)
    row["ms_rest"] = 1e3 * statistics.median(c["total"] - sum(c.get(n, 0.0) for n in PARTS) for c in calls)
    row["block_over_plain_step"] = row["ms_block_call"] / row["ms_plain_step"]
    row["per_prompt_ratio"] = spread(per_prompt)
    return row


def markdown(result: dict) -> str:
    cols = ["temperature", "block_calls", "plain_steps", "ms_plain_step", "ms_block_call", "block_over_plain_step",
            "ratio_min", "ratio_max", "ms_context", "ms_backbone", "ms_lm_head", "ms_rest"]
    rows = [{**r, "ratio_min": r["per_prompt_ratio"]["min"], "ratio_max": r["per_prompt_ratio"]["max"]}
            for r in result["rows"]]
    s = result["settings"]
    return (result_preamble(result) + f"\nThe drafter `{s['drafter']}` at fixed γ = 7 against plain decoding, one "
            f"request, {s['prompts']} prompts of {s['sets']}, {s['max_new_tokens']} tokens, {s['repeats']} repeats, "
            "interleaved prompt by prompt. Medians over every call and step; ratio_min/max: the range of the "
            "per-prompt ratios of medians. The call splits into the context update (committed tokens' features into "
            "the drafter's cache), the backbone over the block, the LM head over the block, and the rest (sequential "
            "heads, sampling, glue); each part's median is over the calls, so the parts need not add up to the "
            "call's median.\n\n" + markdown_table(rows, cols) + "\n\nHeadline: " +
            ", ".join(f"`{k}` {v:.3f}" for k, v in result["headline"].items()) + " (goal: at most 0.25).\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    log = Log()
    prompts = [p["text"] for p in load_prompts(args.data_dir, args.prompts, tuple(args.sets.split(",")))]
    plain = LLM(dtype=args.dtype, max_num_seqs=1, threads=args.threads, profile=False)
    spec = plain.sibling(drafter=args.drafter, scheduler="fixed", max_num_seqs=1)
    drafter = spec.engine.drafter
    if not hasattr(drafter, "backbone"):
        raise SystemExit(f"{args.drafter} is not a DSpark or DFlash drafter (no backbone to time)")
    timer = CallTimer(drafter)
    rows = []
    for temperature in (0.0, 1.0):
        timer.calls.clear()
        rows.append(measure(plain, spec, timer, prompts, temperature, args, log))
    result = result_header("drafter_cost", __file__, sys.argv[1:] if argv is None else argv)
    result["settings"] = {k: getattr(args, k) for k in ("drafter", "dtype", "threads", "sets", "prompts",
                                                        "max_new_tokens", "repeats")}
    result["rows"] = rows
    result["headline"] = {"dspark_block_over_plain_step": rows[1]["block_over_plain_step"],
                          "dspark_block_over_plain_step_t0": rows[0]["block_over_plain_step"]}
    return finish(result, args.out, markdown, {}, log)


if __name__ == "__main__":
    sys.exit(main())
