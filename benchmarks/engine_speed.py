"""Engine speed on the default target: dspark plain decoding and prompt lookup against transformers `generate`
(and llama.cpp where llama-cpp-python is installed), plus the verify step-time curve. One run, side by side:
the same chat prompts from ../shared/data, the same dtype, greedy, exactly --max-new-tokens per request.

    python benchmarks/engine_speed.py           # the full run: bf16 and fp32, writes benchmarks/results/engine_speed.*
    python benchmarks/engine_speed.py --quick   # smoke test, under a minute

(a) plain decoding tokens/s at each --concurrency (1 = the prompts one after another; c > 1 = c distinct
    prompts in one batch: transformers pads on the left; distinct, so that dspark's shared prefill of equal
    prompts never applies); (b) prompt lookup at batch 1 and its greedy
    agreement with plain decoding; (c) time of one verify forward for B tokens of one request and for R
    requests of one token; (d) llama.cpp on the same GGUF at batch 1, interleaved with (a) and (b).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (DEFAULT_DATA_DIR, RESULTS_DIR, Log, cycle, fmt, load_prompts,  # noqa: E402
                               markdown_table, result_header, result_preamble, run_interleaved, spread,
                               write_result)
from benchmarks.peers import (DsparkPeer, LlamaCppPeer, TransformersPeer, llama_cpp_problem,  # noqa: E402
                              load_transformers)
from benchmarks.step_time import step_time_curve  # noqa: E402
from dspark import LLM  # noqa: E402
from dspark.config import DTYPE_CHOICES  # noqa: E402
from dspark.draft import PromptLookupDrafter  # noqa: E402
from dspark.target.loading import bundled_gguf  # noqa: E402

FULL = {"dtype": "bf16,fp32", "prompts": 10, "max_new_tokens": 128, "concurrency": "1,16,64", "repeats": 3,
        "verify_tokens": "1,2,3,4,5,6,7,8,12,16,24,32,48,64,96,128", "verify_requests": "1,2,4,8,16,32,64",
        "verify_context": 200, "verify_timings": 10}
QUICK = {"dtype": "bf16", "prompts": 2, "max_new_tokens": 8, "concurrency": "1,3", "repeats": 1,
         "verify_tokens": "1,2,8", "verify_requests": "1,2", "verify_context": 32, "verify_timings": 3}
WARMUP_TOKENS = 8
PLAIN, HF, LOOKUP, HF_LOOKUP, LLAMA = ("dspark plain", "transformers generate", "dspark prompt-lookup",
                                       "transformers prompt-lookup", "llama.cpp")


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny settings for a smoke test (defaults below in [])")
    p.add_argument("--dtype", help=f"comma-separated: bf16, fp32, q4_1 (transformers runs bf16 there) [{FULL['dtype']}; quick {QUICK['dtype']}]")
    p.add_argument("--prompts", type=int, help=f"chat prompts at batch 1, round-robin over the eval sets (a batch of c takes the first c) "
                   f"[{FULL['prompts']}]")
    p.add_argument("--prompt-sets", default="gsm8k,humaneval,mt-bench", help="eval sets the prompts come from "
                   "(first user turn of eval_NAME.jsonl) [%(default)s]")
    p.add_argument("--max-new-tokens", type=int, help=f"tokens per request, forced [{FULL['max_new_tokens']}]")
    p.add_argument("--concurrency", help=f"comma-separated batch sizes for (a) [{FULL['concurrency']}]")
    p.add_argument("--repeats", type=int, help=f"timed repeats of (a), (b), (d); medians reported [{FULL['repeats']}]")
    p.add_argument("--lookup-tokens", type=int, default=7, help="prompt-lookup draft length, both "
                   "systems [%(default)s]")
    p.add_argument("--lookup-ngram", type=int, default=3, help="longest n-gram prompt lookup matches [%(default)s]")
    p.add_argument("--verify-tokens", help=f"B for (c), one request [{FULL['verify_tokens']}]")
    p.add_argument("--verify-requests", help=f"R for (c), one token each [{FULL['verify_requests']}]")
    p.add_argument("--verify-context", type=int, help="cached tokens before the "
                   f"verified ones [{FULL['verify_context']}]")
    p.add_argument("--verify-timings", type=int,
                   help=f"timed rounds of (c), each timing every point once [{FULL['verify_timings']}]")
    p.add_argument("--threads", type=int, default=2, help="torch (and llama.cpp) threads [%(default)s]")
    p.add_argument("--no-llamacpp", action="store_true", help="skip (d) even when llama-cpp-python is installed")
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR), help="folder of eval_*.jsonl [../shared/data]")
    p.add_argument("--out", default=str(RESULTS_DIR / "engine_speed"), help="writes OUT.json and OUT.md "
                   "[benchmarks/results/engine_speed]")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = [d.strip() for d in args.dtype.split(",") if d.strip()]
    args.concurrency = int_list(args.concurrency)
    args.verify_tokens, args.verify_requests = int_list(args.verify_tokens), int_list(args.verify_requests)
    args.prompt_sets = tuple(s.strip() for s in args.prompt_sets.split(",") if s.strip())
    if not args.dtype or any(d not in DTYPE_CHOICES for d in args.dtype):
        p.error(f"--dtype takes {', '.join(DTYPE_CHOICES)}, got {args.dtype}")
    if 1 not in args.concurrency:
        p.error("--concurrency must include 1 (prompt lookup and llama.cpp are measured at batch 1)")
    if min(args.repeats, args.prompts, args.max_new_tokens, args.verify_timings, *args.concurrency) < 1:
        p.error("counts must be >= 1")
    return args


def speed_row(section: str, system: str, dtype: str, concurrency: int, requests: int, n: int,
              seconds: list[float], **extra) -> dict:
    """Tokens/s (median over repeats and its range); ms_per_token is the time per token of one request."""
    rates = spread([requests * n / s for s in seconds])
    per_request = rates["median"] / concurrency
    return {"section": section, "system": system, "dtype": dtype, "concurrency": concurrency, "requests": requests,
            "new_tokens": n, "seconds": statistics.median(seconds), "tokens_per_s": rates["median"],
            "tokens_per_s_min": rates["min"], "tokens_per_s_max": rates["max"],
            "per_request_tokens_per_s": per_request, "ms_per_token": 1e3 / per_request, "repeats": len(seconds),
            **extra}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of prompts whose outputs are identical."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def prefix_agreement(ours: list[list[int]], theirs: list[list[int]], eos_ids: set[int]) -> float:
    """Like agreement, up to our first EOS (we generate past it, transformers' min_new_tokens forbids it)."""
    def cut(x):
        return next((i for i, t in enumerate(x) if t in eos_ids), len(x))

    return sum(x[:cut(x)] == y[:cut(x)] for x, y in zip(ours, theirs, strict=True)) / len(ours)


def acceptance_length(outputs) -> float:
    """Tokens per verify step over all requests (the prefill's first token excluded)."""
    return sum(len(o.token_ids) - 1 for o in outputs) / max(sum(o.steps for o in outputs), 1)


def bench_dtype(dtype: str, args, texts: list[str], llama: LlamaCppPeer | None, log) -> tuple[list[dict], dict]:
    """(a), (b), (c) and, when llama is given, (d) in one dtype. Returns (rows, figures)."""
    n, concurrency = args.max_new_tokens, args.concurrency
    log(f"{dtype}: loading dspark (plain, prompt lookup) and transformers")
    plain_llm = LLM(drafter="none", dtype=dtype, max_num_seqs=max(concurrency))
    lookup_llm = LLM(drafter=PromptLookupDrafter(gamma=args.lookup_tokens, max_ngram=args.lookup_ngram),
                     gamma=args.lookup_tokens, dtype=dtype, max_num_seqs=1)
    hf_model, hf_tokenizer = load_transformers(plain_llm.target_path, plain_llm.config.torch_dtype)
    prompts = [plain_llm.chat_prompt(t) for t in texts]  # max(--prompts, concurrency) distinct
    plain, lookup = DsparkPeer(plain_llm, PLAIN), DsparkPeer(lookup_llm, LOOKUP)
    hf = TransformersPeer(hf_model, hf_tokenizer, HF)
    hf_lookup = TransformersPeer(hf_model, hf_tokenizer, HF_LOOKUP, prompt_lookup_num_tokens=args.lookup_tokens,
                                 max_matching_ngram_size=args.lookup_ngram)
    bs1_peers = [plain, hf, lookup, hf_lookup] + ([llama] if llama else [])
    batches = {c: [[p] for p in prompts[:args.prompts]] if c == 1 else [prompts[:c]] for c in concurrency}

    log(f"{dtype}: warm-up")
    for c in concurrency:
        run_interleaved(bs1_peers if c == 1 else [plain, hf], [batches[c][0]], min(n, WARMUP_TOKENS), 0)

    seconds = {}  # (system, concurrency) -> [seconds per repeat]
    first = {}  # (system, concurrency) -> outputs of the first repeat
    accept = []
    for rep in range(args.repeats):
        for c in concurrency:
            lookup.history.clear()
            got = run_interleaved(bs1_peers if c == 1 else [plain, hf], batches[c], n, rep)
            for name, (outs, secs) in got.items():
                seconds.setdefault((name, c), []).append(secs)
                first.setdefault((name, c), outs)
            if c == 1:
                accept.append(acceptance_length(lookup.history))
            log(f"{dtype} repeat {rep + 1}/{args.repeats} concurrency {c}: " + ", ".join(
                f"{name} {len(batches[c]) * len(batches[c][0]) * n / s:.1f} tok/s" for name, (_, s) in got.items()))

    figures = {"greedy_agreement": agreement(first[LOOKUP, 1], first[PLAIN, 1]),
               "transformers_greedy_agreement": agreement(first[HF_LOOKUP, 1], first[HF, 1]),
               "plain_transformers_prefix_agreement": prefix_agreement(first[PLAIN, 1], first[HF, 1],
                                                                plain_llm.engine.eos_ids),
               "prompt_lookup_acceptance_length": statistics.median(accept)}
    rows = []
    for c in concurrency:
        requests = args.prompts if c == 1 else c
        for name in (PLAIN, HF):
            rows.append(speed_row("plain", name, dtype, c, requests, n, seconds[name, c]))
    rows.append(speed_row("prompt_lookup", LOOKUP, dtype, 1, args.prompts, n, seconds[LOOKUP, 1],
                          acceptance_length=figures["prompt_lookup_acceptance_length"],
                          greedy_agreement=figures["greedy_agreement"]))
    rows.append(speed_row("prompt_lookup", HF_LOOKUP, dtype, 1, args.prompts, n, seconds[HF_LOOKUP, 1],
                          greedy_agreement=figures["transformers_greedy_agreement"]))
    if llama:
        rows.append(speed_row("llamacpp", LLAMA, f"{llama.gguf.stem.rsplit('.', 1)[-1]} (GGUF)", 1, args.prompts, n,
                              seconds[LLAMA, 1], interleaved_with=dtype))

    log(f"{dtype}: verify step-time curve")
    context = cycle([t for p in prompts[:args.prompts] for t in p], args.verify_context)
    for row in step_time_curve(plain_llm.engine.target, context, args.verify_tokens, args.verify_requests,
                               args.verify_timings, progress=log):
        rows.append({"section": "verify_step", "system": "dspark verify forward", "dtype": dtype, **row})
    return rows, figures


def headline_dtype(dtypes: list[str]) -> str:
    return "bf16" if "bf16" in dtypes else dtypes[0]


def headline(rows: list[dict], figures: dict[str, dict], dtypes: list[str]) -> dict:
    """Flat name -> number, per dtype with a _bf16 / _fp32 suffix, unsuffixed for the headline dtype."""
    def rate(system, dtype, c=1):
        return next((r["tokens_per_s"] for r in rows if r["system"] == system and r["dtype"] == dtype
                     and r.get("concurrency") == c and r["section"] != "verify_step"), None)

    def step_ms(dtype, tokens):
        return next((r["ms"] for r in rows if r["section"] == "verify_step" and r["dtype"] == dtype
                     and r["curve"] == "one_request" and r["tokens"] == tokens), None)

    llama_row = next((r for r in rows if r["system"] == LLAMA), None)
    out = {}
    for dtype in dtypes:
        f = {}
        for c in sorted({r["concurrency"] for r in rows if r["section"] == "plain"}):
            f[f"plain_vs_transformers_bs{c}"] = rate(PLAIN, dtype, c) / rate(HF, dtype, c)
        f["prompt_lookup_vs_transformers_bs1"] = rate(LOOKUP, dtype) / rate(HF_LOOKUP, dtype)
        f["prompt_lookup_vs_plain_bs1"] = rate(LOOKUP, dtype) / rate(PLAIN, dtype)
        f["plain_ms_per_token_bs1"] = 1e3 / rate(PLAIN, dtype)
        if step_ms(dtype, 1) and step_ms(dtype, 8):
            f["verify8_over_verify1"] = step_ms(dtype, 8) / step_ms(dtype, 1)
        f.update(figures[dtype])
        if llama_row:
            f["plain_vs_llamacpp_bs1"] = rate(PLAIN, dtype) / llama_row["tokens_per_s"]
            f["prompt_lookup_vs_llamacpp_bs1"] = rate(LOOKUP, dtype) / llama_row["tokens_per_s"]
            f["plain_ms_over_llamacpp_ms_bs1"] = f["plain_ms_per_token_bs1"] / llama_row["ms_per_token"]
        out.update({f"{k}_{dtype}": v for k, v in f.items()})
        out[f"{dtype}_greedy_agreement"] = f["greedy_agreement"]
    main_dtype = headline_dtype(dtypes)
    out.update({k.removesuffix(f"_{main_dtype}"): v for k, v in list(out.items()) if k.endswith(f"_{main_dtype}")})
    if llama_row:
        out["llamacpp_tokens_per_s"] = llama_row["tokens_per_s"]
        out["llamacpp_ms_per_token"] = llama_row["ms_per_token"]
    return dict(sorted(out.items()))


def headline_table(figures: dict, dtypes: list[str]) -> list[dict]:
    """One row per figure with a column per dtype; the unsuffixed copies are left out."""
    table: dict[str, dict] = {}
    for name, value in figures.items():
        dtype = next((d for d in dtypes if name.endswith(f"_{d}")), None)
        if dtype:
            table.setdefault(name.removesuffix(f"_{dtype}"), {"figure": name.removesuffix(f"_{dtype}")})[dtype] = value
    for name, value in figures.items():
        copy = name in table or any(name.endswith(f"_{d}") or name.startswith(f"{d}_") for d in dtypes)
        if not copy:
            table[name] = {"figure": name, "any dtype": value}
    return list(table.values())


def markdown(result: dict) -> str:
    s, rows = result["settings"], result["rows"]
    speed = [dict(r, range=f"{fmt(r['tokens_per_s_min'])}-{fmt(r['tokens_per_s_max'])}") for r in rows
             if r["section"] != "verify_step"]
    steps: dict[tuple, dict] = {}
    for r in rows:
        if r["section"] == "verify_step":
            steps.setdefault((r["curve"], r["requests"], r["tokens"]), {
                "curve": r["curve"], "requests": r["requests"], "tokens": r["tokens"]})[f"ms {r['dtype']}"] = r["ms"]
    parts = [result_preamble(result),
             f"Target {s['target']}, {s['prompts']} chat prompts ({', '.join(s['prompt_sets'])}), "
             f"{s['max_new_tokens']} new tokens each (forced), greedy; medians over {s['repeats']} repeats.\n",
             "## Decoding speed (tokens/s, all requests together)\n",
             markdown_table(speed, ["dtype", "system", "concurrency", "tokens_per_s", "range",
                                    "per_request_tokens_per_s", "ms_per_token", "acceptance_length",
                                    "greedy_agreement"]),
             f"\n## Verify step time (ms, median of {s['verify_timings']} round-robin rounds; "
             f"{s['verify_context']} cached tokens)\n",
             markdown_table(list(steps.values()), ["curve", "requests", "tokens"] + [f"ms {d}" for d in s["dtype"]]),
             "\n## Headline\n",
             markdown_table(headline_table(result["headline"], s["dtype"]), ["figure", *s["dtype"], "any dtype"]),
             *[f"\n{note}" for note in result.get("notes", [])]]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    main_dtype = headline_dtype(args.dtype)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    log = Log()
    texts = [p["text"] for p in load_prompts(args.data_dir, max(args.prompts, *args.concurrency), args.prompt_sets)]
    result = result_header("engine_speed", __file__, argv)
    notes = []
    llama = None
    if args.no_llamacpp:
        notes.append("llama.cpp skipped (--no-llamacpp).")
    elif problem := llama_cpp_problem():
        notes.append(f"llama.cpp skipped: {problem}.")
    else:
        import llama_cpp

        gguf = bundled_gguf()
        llama = LlamaCppPeer(gguf, args.threads, n_ctx=4096)
        result["machine"]["llama_cpp_python"] = llama_cpp.__version__
        notes.append(f"llama.cpp: {gguf.name} via llama-cpp-python {llama_cpp.__version__}, {args.threads} threads, "
                     f"greedy, batch 1, same prompt token ids; interleaved with the {main_dtype} runs.")
    if "q4_1" in args.dtype:
        notes.append("q4_1: dspark with 4-bit layer weights (exactly the GGUF's own Q4_1) and bf16 activations; the "
                     "transformers rows under q4_1 run bf16 (transformers has no CPU Q4_1 path), so q4_1's ratios "
                     "compare with bf16 transformers.")
    result["settings"] = {
        "target": "SmolLM2-135M-Instruct", "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
        "prompts": args.prompts, "prompt_sets": list(args.prompt_sets), "concurrency": args.concurrency,
        "repeats": args.repeats, "threads": args.threads, "lookup_tokens": args.lookup_tokens,
        "lookup_ngram": args.lookup_ngram, "verify_tokens": args.verify_tokens,
        "verify_requests": args.verify_requests, "verify_context": args.verify_context,
        "verify_timings": args.verify_timings, "greedy": True, "ignore_eos": True,
        "headline_dtype": main_dtype,
        "quick": args.quick}
    rows, figures = [], {}
    for dtype in args.dtype:
        dtype_rows, figures[dtype] = bench_dtype(dtype, args, texts, llama if dtype == main_dtype else None, log)
        rows += dtype_rows
    result["rows"] = rows
    result["headline"] = headline(rows, figures, args.dtype)
    result["notes"] = notes
    result["settings"]["wall_s"] = round(time.perf_counter() - log.t0, 1)
    json_path, md_path = write_result(args.out, result, markdown(result))
    log(f"wrote {json_path} and {md_path}")
    for k, v in result["headline"].items():
        print(f"  {k}: {v:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
