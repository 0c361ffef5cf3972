"""Draft vocabularies side by side: each drafter with its draft vocabulary (draft_vocab.json: heads cut to the most
frequent answer tokens) and with the whole vocabulary (Options(draft_vocab=False)), single request, greedy, every system
interleaved prompt by prompt with plain decoding: tokens/s, τ and the median drafting call.

    python benchmarks/draft_vocab.py                      # the four committed drafters, fixed γ, and DSpark's default
    python benchmarks/draft_vocab.py --quick              # smoke test
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
                               markdown_table, result_header, result_preamble, run_interleaved)
from benchmarks.drafters import eval_rows  # noqa: E402
from benchmarks.peers import DsparkPeer  # noqa: E402
from dspark import LLM, options  # noqa: E402
from dspark.config import DTYPE_CHOICES  # noqa: E402
from dspark.draft import DEFAULT_DRAFTER_DIR  # noqa: E402

REPO_DRAFTERS = DEFAULT_DRAFTER_DIR.parents[3] / "drafters"
DRAFTERS = (f"dspark={DEFAULT_DRAFTER_DIR},dflash={REPO_DRAFTERS / 'smollm2-135m-dflash'},"
            f"eagle3={REPO_DRAFTERS / 'smollm2-135m-eagle3'},mtp={REPO_DRAFTERS / 'smollm2-135m-mtp1'}")
FULL = {"speed_sets": "gsm8k,humaneval", "prompts": 4, "max_new_tokens": 256}
QUICK = {"speed_sets": "gsm8k", "prompts": 1, "max_new_tokens": 8}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafters", default=DRAFTERS, help="comma-separated name=folder pairs [the committed four]")
    p.add_argument("--async-drafter", default="dspark", help="also run this one under the async scheduler "
                   "(`dspark generate`'s default) ['' for none; default: %(default)s]")
    add_presets(p, FULL, QUICK)
    p.add_argument("--dtype", default="bf16", choices=DTYPE_CHOICES)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    p.add_argument("--out", default=str(RESULTS_DIR / "draft_vocab"))
    args = apply_presets(p.parse_args(argv), FULL, QUICK)
    args.drafter_dirs = dict(pair.split("=", 1) for pair in args.drafters.split(","))
    return args


def systems(plain: LLM, args) -> dict[str, tuple[LLM, str, bool]]:
    """name -> (engine, drafter, draft vocabulary used): every drafter at fixed γ, cut and whole."""
    out = {}
    runs = [(name, folder, "fixed") for name, folder in args.drafter_dirs.items()]
    if args.async_drafter:
        runs.append((f"{args.async_drafter}-async", args.drafter_dirs[args.async_drafter], "async"))
    for name, folder, scheduler in runs:
        for cut in (True, False):
            with options.using(draft_vocab=cut):  # read when the drafter loads
                llm = plain.sibling(folder, scheduler, max_num_seqs=1)
            if cut and llm.engine.drafter.model.draft_ids is None:
                raise SystemExit(f"{folder} has no draft_vocab.json (dspark draft-vocab writes one)")
            out[name + ("" if cut else " (whole vocabulary)")] = (llm, name, cut)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    log = Log()
    plain = LLM(drafter="none", dtype=args.dtype, max_num_seqs=1)
    result = result_header("draft_vocab", __file__, argv)
    result["settings"] = {k: getattr(args, k) for k in (*FULL, "dtype", "async_drafter")} | {
        "drafters": args.drafter_dirs}
    engines = systems(plain, args)
    peers = [DsparkPeer(plain, "plain")] + [DsparkPeer(llm, name) for name, (llm, _, _) in engines.items()]
    texts = [t[0] for s in args.speed_sets.split(",") for t in eval_rows(args.data_dir, s, args.prompts)]
    prompts = [plain.chat_prompt(t) for t in texts]
    for peer in peers:  # warm-up (and the async scheduler's cost profile, once per drafter and vocabulary)
        peer.generate([prompts[0]], 8)
        peer.history.clear()
        peer.llm.engine.stats.clear()
    timed = run_interleaved(peers, [[p] for p in prompts], args.max_new_tokens, rotation=0)
    plain_tps = len(timed["plain"][0]) * args.max_new_tokens / timed["plain"][1]
    rows = []
    for peer in peers:
        outs, seconds = timed[peer.name]
        tps = len(outs) * args.max_new_tokens / seconds
        _, drafter, cut = engines.get(peer.name, (None, None, None))
        drafted = [st.t_draft for st in peer.llm.engine.stats if max(st.drafted, default=0) > 0]
        rows.append({"system": peer.name, "drafter": drafter, "draft_vocab": cut, "requests": len(outs),
                     "new_tokens": args.max_new_tokens, "tokens_per_s": tps, "vs_plain": tps / plain_tps,
                     "tau": sum(len(o.token_ids) - 1 for o in peer.history) / max(sum(o.steps for o in peer.history),
                                                                                   1),
                     "draft_ms": 1000 * statistics.median(drafted) if drafted else None})
        log(f"{peer.name}: {tps:.1f} tok/s, {rows[-1]['vs_plain']:.3f}x plain, τ {rows[-1]['tau']:.2f}")
    by = {(r["drafter"], r["draft_vocab"]): r for r in rows if r["drafter"]}
    result["rows"] = rows
    result["headline"] = {f"{d}_cut_over_whole": by[(d, True)]["tokens_per_s"] / by[(d, False)]["tokens_per_s"]
                          for d in dict.fromkeys(d for d, _ in by)}
    return finish(result, args.out, markdown, {}, log)


def markdown(result: dict) -> str:
    return "\n\n".join([
        result_preamble(result),
        f"Single request, greedy, {result['settings']['max_new_tokens']} tokens per prompt, prompts "
        f"{result['settings']['prompts']} each of {result['settings']['speed_sets']}, every system interleaved "
        "prompt by prompt. draft_ms: the median drafting call of the steps that drafted.",
        markdown_table(result["rows"], ["system", "tokens_per_s", "vs_plain", "tau", "draft_ms"]),
        "## Headline (tokens/s with the draft vocabulary over without)",
        markdown_table([{"figure": k, "value": v} for k, v in result["headline"].items()], ["figure", "value"]),
    ]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
