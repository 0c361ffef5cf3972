"""Command line, measuring side: `dspark calibrate` (STS) and `dspark profile` (the SPS(B) cost table)."""
from __future__ import annotations

import sys

from .cli_args import add_engine_args, add_target_args, llm_from_args


def cmd_calibrate(args) -> int:
    import json
    from pathlib import Path

    from . import LLM, SamplingParams
    from .calibrate import collect, fit_sts, metrics, reliability_plot, save_calibration
    from .train.prompts import build_prompts, load_pools

    folder = Path(args.drafter)
    exclude = set()
    if args.exclude:
        with open(args.exclude) as f:
            exclude = {json.loads(line)["id"] for line in f if line.strip()}
    records = [r for r in build_prompts(args.num_prompts + len(exclude), seed=args.seed, pools=load_pools(args.data_dir))
               if r["id"] not in exclude][:args.num_prompts]
    llm = LLM(args.target, drafter=str(folder), dtype=args.dtype, threads=args.threads, max_num_seqs=args.max_num_seqs)
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed * 100_003 + i)
              for i in range(len(records))]
    data = collect(llm, [llm.chat_prompt(r["messages"]) for r in records], params)
    temps = fit_sts(data)
    before, after = metrics(data, [1.0] * len(temps)), metrics(data, temps)
    plot = reliability_plot(data, temps, args.plot or folder / "reliability.png")
    report = {"before": before, "after": after, "samples": int(len(data.verified)), "prompts": len(records),
              "temperature": args.temperature, "max_tokens": args.max_tokens, "seed": args.seed,
              "prompt_ids": [r["id"] for r in records]}
    path = save_calibration(folder, temps, report)
    print(f"STS temperatures {[round(t, 3) for t in temps]} -> {path}; reliability diagram {plot}", file=sys.stderr)
    print(f"ECE (cumulative) {before['ece']:.4f} -> {after['ece']:.4f} | Brier {before['brier']:.4f} -> "
          f"{after['brier']:.4f} | AUC {after['auc']:.3f} per position, "
          f"{after['auc_pooled']:.3f} pooled | {report['samples']} request-steps", file=sys.stderr)
    return 0


def add_calibrate_parser(sub):
    ca = sub.add_parser("calibrate", help="fit STS temperatures of a drafter's confidence head",
                        description="Run held-out training-pool prompts through the engine verifying every draft, "
                                    "record the raw confidences and the acceptance events, fit one temperature per "
                                    "position left to right (sequential temperature scaling, minimising the ECE of "
                                    "the cumulative product), and write calibration.json (temperatures, ECE, AUC and "
                                    "Brier before and after) and a reliability diagram beside the drafter; the "
                                    "temperatures apply whenever the drafter is loaded.")
    ca.add_argument("--drafter", required=True, help="the DSpark drafter folder")
    ca.add_argument("--num-prompts", type=int, default=64, help="held-out prompts (default: %(default)s)")
    ca.add_argument("--exclude", default=None, help="regenerated training JSONL whose prompt ids are skipped")
    ca.add_argument("--data-dir", default=None, help="folder with gsm8k_train.jsonl and the eval sets to exclude "
                                                      "(default: $DSPARK_DATA, else ../shared/data)")
    ca.add_argument("--seed", type=int, default=1, help="draws the prompts and seeds sampling (default: %(default)s)")
    ca.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: %(default)s)")
    ca.add_argument("--max-tokens", type=int, default=128, help="answer tokens per prompt (default: %(default)s)")
    ca.add_argument("--max-num-seqs", type=int, default=16, help="requests at once (default: %(default)s)")
    ca.add_argument("--plot", default=None, help="reliability diagram PNG (default: DRAFTER/reliability.png)")
    add_target_args(ca)
    ca.set_defaults(func=cmd_calibrate)


def cmd_profile(args) -> int:
    from .engine.profile import profile_engine, plot_cost_table

    llm = llm_from_args(args, max_num_seqs=args.max_requests)
    table = profile_engine(llm.engine, max_requests=args.max_requests, context=args.context, repeats=args.repeats)
    table.meta.update(drafter=args.drafter, command=" ".join(sys.argv))
    path = table.save(args.out)
    plot = plot_cost_table(table, args.plot or str(path).removesuffix(".json") + ".png")
    t1 = table.step_time(1, 1)
    print(f"cost table -> {path} (plot {plot}); step time at B=1: {1000 * t1:.1f} ms, B=8: "
          f"{1000 * table.step_time(8, 1):.1f} ms, B={table.max_size}: {1000 * table.step_time(table.max_size, 1):.1f} "
          f"ms; staircase steps at B = {table.staircase()}", file=sys.stderr)
    return 0


def add_profile_parser(sub):
    pr = sub.add_parser("profile", help="measure the SPS(B) cost table of this machine for the schedulers",
                        description="Measure this engine's step time as a function of the verify batch B (verify "
                                    "forward + sampling, for B = 1 .. max-requests·(γ+1)) and of the drafter call "
                                    "(for R requests), on the loaded target and drafter; detect staircase steps; "
                                    "save the table with the hardware, dtype and model (JSON) and a plot (PNG). "
                                    "Give it to `generate`/`serve` with --cost-table; serving corrects it online.")
    pr.add_argument("--out", default="cost_table.json", help="output JSON (default: %(default)s)")
    pr.add_argument("--plot", default=None, help="plot PNG (default: beside --out)")
    pr.add_argument("--max-requests", type=int, default=64, help="largest number of requests (default: %(default)s)")
    pr.add_argument("--context", type=int, default=128, help="committed tokens per request (default: %(default)s)")
    pr.add_argument("--repeats", type=int, default=3, help="timed repeats per size, median kept (default: %(default)s)")
    add_engine_args(pr)
    pr.set_defaults(func=cmd_profile, scheduler="fixed")  # the scheduler plays no part in measuring
