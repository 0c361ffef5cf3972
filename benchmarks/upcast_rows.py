"""bf16 target forwards with and without upcast.py's float32 path, side by side in one process, on a CPU
without a bf16 matrix unit: (a) one verify forward (target + LM head) after a cached context, for B tokens of
one request and for R requests of one token, the two paths interleaved; (b) plain decoding of 16 concurrent
requests through the engine, the paths alternated. Shows where the path pays (upcast.MANY_ROWS).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (DEFAULT_DATA_DIR, RESULTS_DIR, Log, load_prompts, markdown_table,  # noqa: E402
                               result_header, result_preamble, write_result)
from benchmarks.step_time import VerifyBench  # noqa: E402
from dspark import LLM, SamplingParams  # noqa: E402
from dspark.kernels import upcast  # noqa: E402

NEVER = 10**9  # MANY_ROWS that keeps every verify forward in bf16 (the path before 6a1165c)
CHOSEN = upcast.MANY_ROWS


@contextlib.contextmanager
def many_rows(rows: int):
    """upcast.MANY_ROWS = rows inside the block; the chosen value again afterwards, also on an error."""
    upcast.MANY_ROWS = rows
    try:
        yield
    finally:
        upcast.MANY_ROWS = CHOSEN


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,2,4,6,8,12,16", help="B, tokens of one request per verify forward")
    p.add_argument("--requests", default="4,8,16", help="R, requests of one token per verify forward")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (2 timings per path per round)")
    p.add_argument("--context", type=int, default=200, help="cached tokens before the verified ones")
    p.add_argument("--concurrency", type=int, default=16, help="requests decoded together in (b); 0 skips (b)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per request in (b)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    p.add_argument("--out", default=str(RESULTS_DIR / "upcast_rows"))
    return p.parse_args(argv)


def verify_rows(model, tok, args) -> list[dict]:
    ctx = tok("The quick brown fox jumps over the lazy dog. " * 60)["input_ids"][:args.context]
    shapes = [[int(b)] for b in args.tokens.split(",")] + [[1] * int(r) for r in args.requests.split(",")]
    bench = VerifyBench(model, ctx, max(len(s) for s in shapes), max(max(s) for s in shapes))
    times = {}
    for _ in range(args.repeats):
        for s in shapes:
            for rows in (NEVER, CHOSEN):
                with many_rows(rows):
                    times.setdefault((rows, len(s), sum(s)), []).extend(bench.time(s, 2, warmup=1))
    out = []
    for s in shapes:
        bf16, f32 = (1e3 * statistics.median(times[rows, len(s), sum(s)]) for rows in (NEVER, upcast.MANY_ROWS))
        out.append({"requests": len(s), "tokens": sum(s), "ms_bf16": bf16, "ms_with_path": f32,
                    "speedup": bf16 / f32, "path_taken": sum(s) >= upcast.MANY_ROWS})
    return out


def decode_rows(args, log) -> list[dict]:
    llm = LLM(dtype="bf16", drafter="none", max_num_seqs=args.concurrency)
    prompts = [llm.chat_prompt(p["text"]) for p in load_prompts(args.data_dir, args.concurrency, ("gsm8k",))]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))
    runs = {}
    for _ in range(args.repeats):
        for rows in (NEVER, CHOSEN):
            llm.engine.stats.clear()
            with many_rows(rows):
                t0 = time.perf_counter()
                llm.generate(prompts, params)
                wall = time.perf_counter() - t0
            steps = sum(s.t_total - s.t_prefill for s in llm.engine.stats)
            runs.setdefault(rows, []).append((wall, steps))
            log(f"  decode, MANY_ROWS={rows}: {wall:.1f} s")
    n = args.concurrency * args.new_tokens
    out = []
    for rows, name in ((NEVER, "bf16"), (upcast.MANY_ROWS, "with path")):
        wall = statistics.median(w for w, _ in runs[rows])
        steps = statistics.median(s for _, s in runs[rows])
        out.append({"path": name, "tokens_per_s": n / wall, "decode_steps_s": steps})
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    log = Log()
    result = result_header("upcast_rows", __file__, argv)
    result["settings"] = vars(args) | {"many_rows": upcast.MANY_ROWS, "upcast_helps": upcast.UPCAST_HELPS}
    llm = LLM(dtype="bf16", drafter="none", max_num_seqs=1)
    log("verify forwards")
    result["verify"] = verify_rows(llm.engine.target, llm.tokenizer, args)
    result["decode"] = decode_rows(args, log) if args.concurrency else []
    md = [result_preamble(result),
          f"bf16 SmolLM2-135M-Instruct; MANY_ROWS = {upcast.MANY_ROWS}; the path is used on this CPU: "
          f"{upcast.UPCAST_HELPS}.\n\n## (a) Verify forward after {args.context} cached tokens (ms, medians)\n",
          markdown_table(result["verify"], ["requests", "tokens", "ms_bf16", "ms_with_path", "speedup", "path_taken"])]
    if result["decode"]:
        md += [f"\n## (b) Plain decoding, {args.concurrency} requests x {args.new_tokens} tokens (prefill included)\n",
               markdown_table(result["decode"], ["path", "tokens_per_s", "decode_steps_s"])]
    paths = write_result(args.out, result, "\n".join(md))
    log(f"wrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
