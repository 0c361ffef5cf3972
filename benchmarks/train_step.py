"""Seconds per `dspark train` step, per drafter type, at the settings the bundled drafters were trained with
(drafters/README.md: 2 layers, Markov rank 32, 4 sequences x 32 anchors of block 7, at most 640 tokens, one
thread, the target in bf16). With --baseline-src, the same steps also run on another checkout's `src`
folder (for example `git worktree add /tmp/base <commit>`), the two trees alternating round by round in
fresh processes, so a change's gain is measured side by side on one machine. With --variant NAME=JSON (repeated)
each tree also runs under other training settings (for example `vocab={"draft_vocab": 8192}`), side by side the
same way; every row's `first_over_this` is the first system's median over its own.

Needs the training answers: `python drafters/training_answers.py unpack --out train.jsonl` (and, for the
settings of the committed drafters, the feature cache of drafters/README.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import REPO_ROOT, RESULTS_DIR, Log, markdown_table, result_header, result_preamble  # noqa: E402
from benchmarks.common import write_result  # noqa: E402

SETTINGS = dict(num_layers=2, markov_rank=32, init="small", lr=1e-3, warmup=50, batch_size=4, num_anchors=32,
                max_len=640)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="train.jsonl", help="regenerated training answers (JSONL)")
    p.add_argument("--feature-cache", default=None, help="folder from `dspark features` (default: online)")
    p.add_argument("--target", default=None, help="target folder (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--drafter-types", default="dspark,dflash,eagle3,mtp")
    p.add_argument("--steps", type=int, default=4, help="timed steps per process, after one untimed")
    p.add_argument("--rounds", type=int, default=2, help="fresh processes per tree and drafter type")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--baseline-src", default=None, help="another checkout's src folder to time alongside")
    p.add_argument("--variant", action="append", default=None, metavar="NAME=JSON",
                   help="training settings to time alongside, e.g. 'vocab={\"draft_vocab\": 8192}' (repeatable; "
                        "default: one variant, the settings above; a --baseline-src tree must know the settings)")
    p.add_argument("--extra", default="{}", help=argparse.SUPPRESS)  # internal: a worker's variant settings
    p.add_argument("--out", default=str(RESULTS_DIR / "train_step"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one process's timing
    return p.parse_args(argv)


def worker(args) -> None:
    """Time args.steps steps of one drafter type with the dspark on sys.path; print one JSON line."""
    import torch

    from dspark.train.trainer import Trainer, TrainConfig

    torch.set_num_threads(args.threads)
    kind = args.worker
    extra = {"block_size": 1} if kind == "mtp" else {}
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(data=args.data, out=out, target=args.target, drafter_type=kind,
                          feature_cache=args.feature_cache, steps=1000, save_every=10**6, eval_every=10**6,
                          **{**SETTINGS, **extra, **json.loads(args.extra)})
        trainer = Trainer(cfg)
        trainer.train_step()
        seconds, loss = [], None
        for _ in range(args.steps):
            t0 = time.perf_counter()
            loss = trainer.train_step()["loss"]
            seconds.append(time.perf_counter() - t0)
    print(json.dumps({"seconds": seconds, "loss": loss}), flush=True)


def run_worker(src: Path, kind: str, extra: dict, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--data", args.data, "--steps", str(args.steps),
           "--threads", str(args.threads), "--extra", json.dumps(extra)]
    cmd += [x for opt in ("feature_cache", "target") if getattr(args, opt)
            for x in ("--" + opt.replace("_", "-"), getattr(args, opt))]
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} on {src} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(result: dict) -> str:
    cols = ["drafter", "tree", "variant", "s_per_step", "min", "max", "steps", "loss_after", "first_over_this"]
    return (result_preamble(result) + f"\nbaseline: {result['baseline_src'] or 'none'}\n\n"
            + markdown_table(result["rows"], cols) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv if argv is not None else sys.argv[1:])
    if args.worker:
        worker(args)
        return 0
    if not Path(args.data).is_file():
        raise SystemExit(f"training answers not found: {args.data} (see --help)")
    import torch

    torch.set_num_threads(args.threads)  # for the machine block; each worker sets its own
    log = Log()
    trees = {"this": REPO_ROOT / "src"}
    if args.baseline_src:
        trees["baseline"] = Path(args.baseline_src).resolve()
        if not (trees["baseline"] / "dspark").is_dir():
            raise SystemExit(f"--baseline-src must be a src folder holding dspark/: {trees['baseline']}")
    variants = dict(parse_variant(v) for v in args.variant) if args.variant else {"default": {}}
    kinds = args.drafter_types.split(",")
    systems = [(t, v) for t in trees for v in variants]
    times = {(k, s): [] for k in kinds for s in systems}
    losses = {}
    for r in range(args.rounds):
        for kind in kinds:
            for tree, variant in (systems if r % 2 == 0 else systems[::-1]):
                got = run_worker(trees[tree], kind, variants[variant], args)
                times[kind, (tree, variant)] += got["seconds"]
                losses[kind, (tree, variant)] = got["loss"]
                log(f"round {r + 1} {kind} {tree} {variant}: median {statistics.median(got['seconds']):.2f} s/step")
    rows = []
    for kind in kinds:
        first = statistics.median(times[kind, systems[0]])
        for tree, variant in systems:
            s = times[kind, (tree, variant)]
            rows.append({"drafter": kind, "tree": tree, "variant": variant, "s_per_step": statistics.median(s),
                         "min": min(s), "max": max(s), "steps": len(s), "loss_after": losses[kind, (tree, variant)],
                         "first_over_this": first / statistics.median(s)})
    result = {**result_header("train_step", __file__, argv if argv is not None else sys.argv[1:]),
              "settings": {**SETTINGS, "threads": args.threads, "feature_cache": bool(args.feature_cache),
                           "target": args.target or "bundled"},
              "baseline_src": str(args.baseline_src or ""), "variants": variants, "rows": rows}
    json_path, md_path = write_result(args.out, result, markdown(result))
    log(f"wrote {json_path} and {md_path}")
    return 0


def parse_variant(text: str) -> tuple[str, dict]:
    name, sep, settings = text.partition("=")
    try:
        extra = json.loads(settings) if sep else None
    except json.JSONDecodeError as e:
        raise SystemExit(f"--variant {text!r}: the settings are not JSON ({e})")
    if not name or not isinstance(extra, dict):
        raise SystemExit(f"--variant must be NAME=JSON object, got {text!r}")
    return name, extra


if __name__ == "__main__":
    sys.exit(main())
