"""Where the time of a target verify forward goes: the weight products against everything else (norms, rotary,
KV-cache writes, attention, residuals, and PyTorch's dispatch of each of those small ops), and what running the
layers in one call to fused_layers.cpp saves.

Three forwards of the same batch after a cached context, interleaved: model.py's layer loop (Options(fused=False)), the
same loop whose products (every `Linear`, LM head included) return a precomputed tensor of the right shape
without arithmetic, and the fused layers (where the model is fusable). The second is the loop's rest; the
difference is its products. Also counts the torch calls the loop issues (TorchFunctionMode), so rest / calls is
the cost of one small op on this machine.

    python benchmarks/forward_split.py                  # bf16 and fp32, B = 1, 4, 8
    python benchmarks/forward_split.py --quick          # smoke test
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (RESULTS_DIR, Log, add_presets, apply_presets, finish, markdown_table,  # noqa: E402
                               result_header, result_preamble)
from benchmarks.step_time import VerifyBench  # noqa: E402
from dspark import LLM, options  # noqa: E402
from dspark.target import model as target_model  # noqa: E402
from dspark.kernels.fused_layers import model_weights  # noqa: E402

FULL = {"dtype": "bf16,fp32", "tokens": "1,4,8", "repeats": 5, "timings": 5, "context": 200}
QUICK = {"dtype": "bf16", "tokens": "1,2", "repeats": 1, "timings": 2, "context": 16}


@contextlib.contextmanager
def products_skipped():
    """Every target Linear returns a cached tensor of its output shape (no arithmetic) inside the block."""
    real, outputs = target_model.Linear.forward, {}

    def skipped(self, x, product=None):
        key = (x.shape[:-1], self.out_features, x.dtype)
        if key not in outputs:
            outputs[key] = torch.zeros(*x.shape[:-1], self.out_features, dtype=x.dtype)
        return outputs[key]

    target_model.Linear.forward = skipped
    try:
        yield
    finally:
        target_model.Linear.forward = real


@contextlib.contextmanager
def fused(on: bool):
    """Decode and verify forwards through fused_layers.cpp (on) or model.py's layer loop inside the block."""
    with options.using(fused=on, exact=options.current().exact and on):  # the loop as PyTorch's products run it
        yield


class CallCounter(TorchFunctionMode):
    """Counts the torch functions and tensor methods called inside the block."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_presets(p, FULL, QUICK)
    p.add_argument("--threads", type=int, default=2, help="torch threads [%(default)s]")
    p.add_argument("--out", default=str(RESULTS_DIR / "forward_split"), help="writes OUT.json and OUT.md")
    args = apply_presets(p.parse_args(argv), FULL, QUICK)
    args.dtype = [d for d in args.dtype.split(",") if d]
    args.tokens = [int(b) for b in args.tokens.split(",") if b]
    return args


def split_rows(dtype: str, args, log) -> list[dict]:
    llm = LLM(dtype=dtype, drafter="none", threads=args.threads)
    model = llm.engine.target
    context = llm.tokenizer("The quick brown fox jumps over the lazy dog. " * 60)["input_ids"][:args.context]
    bench = VerifyBench(model, context, 1, max(args.tokens))
    fusable = model_weights(model) is not None
    rows = []
    for b in args.tokens:
        whole, rest, whole_fused = [], [], []
        for _ in range(args.repeats):
            with fused(False):
                whole += bench.time([b], args.timings, warmup=1)
                with products_skipped():
                    rest += bench.time([b], args.timings, warmup=1)
            if fusable:
                with fused(True):
                    whole_fused += bench.time([b], args.timings, warmup=1)
        counter = CallCounter()
        with fused(False), counter:
            bench.time([b], 1, warmup=0)
        ms, ms_rest = 1e3 * statistics.median(whole), 1e3 * statistics.median(rest)
        ms_fused = 1e3 * statistics.median(whole_fused) if fusable else None
        rows.append({"dtype": dtype, "tokens": b, "ms_forward": ms, "ms_rest": ms_rest, "ms_products": ms - ms_rest,
                     "rest_share": ms_rest / ms, "torch_calls": counter.calls,
                     "us_per_call_of_rest": 1e3 * ms_rest / counter.calls, "ms_fused": ms_fused,
                     "fused_speedup": ms / ms_fused if fusable else None})
        log(f"{dtype} B={b}: forward {ms:.1f} ms, without products {ms_rest:.1f} ms, {counter.calls} torch calls, "
            f"fused {'-' if ms_fused is None else f'{ms_fused:.1f}'} ms")
    return rows


def markdown(result: dict) -> str:
    cols = ["dtype", "tokens", "ms_forward", "ms_products", "ms_rest", "rest_share", "torch_calls",
            "us_per_call_of_rest", "ms_fused", "fused_speedup"]
    return (result_preamble(result) + f"\nContext {result['settings']['context']} tokens; medians of "
            f"{result['settings']['repeats']} x {result['settings']['timings']} timings per column, the forwards "
            "interleaved. ms_forward: model.py's layer loop (Options(fused=False)); ms_rest: that loop with every product "
            "(LM head included) replaced by a precomputed tensor; ms_products = ms_forward - ms_rest; ms_fused: the "
            "layers in one call to fused_layers.cpp (none where the model is not fusable: the float32 weights "
            "of the bundled target are on a GGUF grid, whose groups the loop reads); fused_speedup = ms_forward / "
            "ms_fused.\n\n" + markdown_table(result["rows"], cols))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    log = Log()
    result = result_header("forward_split", __file__, sys.argv[1:] if argv is None else argv)
    result["settings"] = {k: getattr(args, k) for k in FULL} | {"threads": args.threads}
    result["rows"] = [row for dtype in args.dtype for row in split_rows(dtype, args, log)]
    one = {r["dtype"]: r for r in result["rows"] if r["tokens"] == min(args.tokens)}
    result["headline"] = {f"rest_share_{d}_b{min(args.tokens)}": r["rest_share"] for d, r in one.items()}
    result["headline"] |= {f"fused_speedup_{r['dtype']}_b{r['tokens']}": r["fused_speedup"] for r in result["rows"]
                           if r["fused_speedup"] is not None}
    return finish(result, args.out, markdown, {}, log)


if __name__ == "__main__":
    raise SystemExit(main())
