"""What the AMX-era kernels buy on this CPU, side by side: (1) all of the target's layer products plus its LM
head for M rows, over the weights' copies packed for AMX's tiles (skinny.tiles) against the same products without
them (vdpbf16ps, or the float32 path elsewhere); (2) each row's argmax of M rows of bf16 logits, argmax.cpp against
torch.argmax; (3) whole verify forwards of R requests x 8 tokens, fused_layers.cpp against model.py's layer loop;
(4) fused verify forwards of one request's M tokens (M > 1) with attention on the tiles (tile_attention.h) against
the vector loops (Options.tile_attention=False). Each pair is timed interleaved, in rotated order; medians. Where the
CPU runs no tiles, the two columns of (1) and of (4) measure the same thing.

    python benchmarks/tiles.py            # bf16, M = 1, 2, 4, 8, 16, 32; R = 4, 8, 16, 32
    python benchmarks/tiles.py --quick    # smoke test
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
from benchmarks.common import (RESULTS_DIR, Log, add_presets, apply_presets, finish, markdown_table,  # noqa: E402
                               result_header, result_preamble)
from benchmarks.step_time import VerifyBench  # noqa: E402
from benchmarks.forward_split import fused  # noqa: E402
from dspark import LLM, options  # noqa: E402
from dspark.kernels import fused_layers  # noqa: E402
from dspark.kernels.argmax import argmax_rows  # noqa: E402
from dspark.kernels.skinny import runs_tiles, skinny_linear, tiles  # noqa: E402

FULL = {"rows": "1,2,4,8,16,32", "requests": "4,8,16,32", "repeats": 10, "timings": 5, "context": 200}
QUICK = {"rows": "1,4", "requests": "2", "repeats": 1, "timings": 2, "context": 16}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_presets(p, FULL, QUICK)
    p.add_argument("--threads", type=int, default=2, help="torch threads [%(default)s]")
    p.add_argument("--out", default=str(RESULTS_DIR / "tiles"), help="writes OUT.json and OUT.md")
    args = apply_presets(p.parse_args(argv), FULL, QUICK)
    args.rows = [int(m) for m in args.rows.split(",") if m]
    args.requests = [int(r) for r in args.requests.split(",") if r]
    return args


def median_ms(fns: dict, args) -> dict:
    """{name: median ms} of the callables, timed `timings` times per repeat, the order rotated each repeat."""
    times = {name: [] for name in fns}
    names = list(fns)
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            fns[name]()
            for _ in range(args.timings):
                start = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def product_rows(model, args, log) -> list[dict]:
    linears = [m for layer in model.layers for m in fused_layers.linears(layer)] + [model.lm_head]
    packed = [tiles(m) for m in linears]
    rows = []
    for M in args.rows:
        xs = {m.in_features: torch.randn(M, m.in_features).bfloat16() for m in linears}

        def products(copies):
            for m, p in zip(linears, copies):
                skinny_linear(xs[m.in_features], m.weight, None, packed=p)
        ms = median_ms({"packed": lambda: products(packed), "in_place": lambda: products([None] * len(linears))}, args)
        rows.append({"part": "products", "size": M, "ms_new": ms["packed"], "ms_old": ms["in_place"],
                     "speedup": ms["in_place"] / ms["packed"]})
        log(f"products of {M} rows: packed tiles {ms['packed']:.2f} ms, without {ms['in_place']:.2f} ms")
    return rows


def argmax_rows_timed(model, args, log) -> list[dict]:
    rows = []
    for M in args.rows:
        logits = torch.randn(M, model.config.vocab_size).bfloat16()
        ms = median_ms({"kernel": lambda: argmax_rows(logits), "torch": lambda: logits.argmax(-1)}, args)
        rows.append({"part": "argmax", "size": M, "ms_new": ms["kernel"], "ms_old": ms["torch"],
                     "speedup": ms["torch"] / ms["kernel"]})
        log(f"argmax of {M} rows: argmax.cpp {ms['kernel']:.3f} ms, torch {ms['torch']:.3f} ms")
    return rows


@contextlib.contextmanager
def tile_attention(on: bool):
    """Fused forwards with attention on AMX's tiles or on the vector loops (Options.tile_attention; the tiles attend
    only without Options.exact, so both sides run inexact)."""
    with options.using(tile_attention=on, exact=False), fused(True):
        yield


def verify_rows(llm, args, log, part: str, queries: dict[int, list[int]], way) -> list[dict]:
    """Verify forwards after args.context cached tokens, of query lengths queries[size] (one per request), timed
    under the context manager way(True) (ms_new) against way(False) (ms_old)."""
    model = llm.engine.target
    context = llm.tokenizer("The quick brown fox jumps over the lazy dog. " * 60)["input_ids"][:args.context]
    rows = []
    for size, lengths in queries.items():
        bench = VerifyBench(model, context, len(lengths), max(lengths))

        def forward(on):
            with way(on):
                bench.time(lengths, 1, warmup=0)
        ms = median_ms({"new": lambda: forward(True), "old": lambda: forward(False)}, args)
        rows.append({"part": part, "size": size, "ms_new": ms["new"], "ms_old": ms["old"],
                     "speedup": ms["old"] / ms["new"]})
        log(f"{part}, {len(lengths)} x {max(lengths)} tokens: {ms['new']:.2f} ms new, {ms['old']:.2f} ms old")
    return rows


def forward_rows(llm, args, log) -> list[dict]:
    """fused_layers.cpp against model.py's layer loop, R requests x 8 tokens."""
    return verify_rows(llm, args, log, "forward", {8 * R: [8] * R for R in args.requests}, fused)


def attention_rows(llm, args, log) -> list[dict]:
    """Fused forwards of one request's M > 1 tokens, attention on the tiles against the vector loops."""
    return verify_rows(llm, args, log, "attention", {T: [T] for T in args.rows if T > 1}, tile_attention)


def markdown(result: dict) -> str:
    s = result["settings"]
    return (result_preamble(result) + f"\nAMX tiles here: {result['tiles']}. bf16, medians of {s['repeats']} x "
            f"{s['timings']} timings, each pair interleaved. products: all of the target's layer products and its LM "
            "head for `size` rows, ms_new over the packed copies (skinny.tiles), ms_old without them. argmax: "
            "`size` rows of bf16 logits, ms_new argmax.cpp, ms_old torch.argmax. forward: a verify forward of "
            f"`size` tokens (requests of 8, after {s['context']} cached tokens, LM head included), ms_new "
            "fused_layers.cpp, ms_old model.py's layer loop (Options.fused=False). attention: a fused verify forward of "
            f"one request's `size` tokens after {s['context']} cached tokens (LM head included), ms_new with attention "
            "on AMX's tiles (tile_attention.h), ms_old on the vector loops (Options.tile_attention=False). "
            "speedup = ms_old / ms_new.\n\n"
            + markdown_table(result["rows"], ["part", "size", "ms_new", "ms_old", "speedup"]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    log = Log()
    result = result_header("tiles", __file__, sys.argv[1:] if argv is None else argv)
    result["settings"] = {k: getattr(args, k) for k in FULL} | {"threads": args.threads}
    llm = LLM(dtype="bf16", drafter="none", threads=args.threads, max_num_seqs=max(args.requests))
    model = llm.engine.target
    result["tiles"] = runs_tiles()
    result["rows"] = (product_rows(model, args, log) + argmax_rows_timed(model, args, log) + forward_rows(llm, args, log)
                      + attention_rows(llm, args, log))
    result["headline"] = {f"{r['part']}_speedup_{r['size']}": r["speedup"] for r in result["rows"]}
    return finish(result, args.out, markdown, {}, log)


if __name__ == "__main__":
    raise SystemExit(main())
