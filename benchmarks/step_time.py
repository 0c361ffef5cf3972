"""Step time of one verify forward (target forward + LM head over every query token), measured on the
target directly: B query tokens of one request after a cached context, or R requests of one token each."""
from __future__ import annotations

import statistics
import time

import torch

from dspark.target.kv_cache import KVCache
from dspark.target.model import FlatBatch, TargetModel

PREFILL_CHUNK = 8  # requests per prefill forward


def new_cache(model: TargetModel, max_len: int) -> KVCache:
    """An empty KV cache for the model, as the engine builds one."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return KVCache(c.num_hidden_layers, c.num_key_value_heads, head_dim, model.dtype, max_len)


class VerifyBench:
    """`requests` slots, each holding the same cached context, ready for verify forwards after it."""

    def __init__(self, model: TargetModel, context: list[int], requests: int, max_query: int):
        self.model, self.context_len = model, len(context)
        self.cache = new_cache(model, len(context) + max_query + 1)
        for _ in range(requests):
            self.cache.allocate()
        self.cache.reserve(requests, len(context) + max_query + 1)
        n = len(context)
        for first in range(0, requests, PREFILL_CHUNK):
            r = min(PREFILL_CHUNK, requests - first)
            model(FlatBatch(torch.tensor(context * r), torch.arange(n).repeat(r), [n] * r, slot_start=first),
                  self.cache)
        self.filler = torch.tensor(context)

    def batch(self, query_lens: list[int]) -> FlatBatch:
        """Request r (slot r) verifies query_lens[r] tokens right after the context."""
        toks = torch.cat([self.filler[torch.arange(q) % self.context_len] for q in query_lens])
        pos = torch.cat([torch.arange(self.context_len, self.context_len + q) for q in query_lens])
        return FlatBatch(toks, pos, list(query_lens))

    def time(self, query_lens: list[int], timings: int, warmup: int = 2) -> list[float]:
        """Seconds of each of `timings` verify forwards (after `warmup` untimed ones)."""
        batch = self.batch(query_lens)
        times = []
        for i in range(warmup + timings):
            t0 = time.perf_counter()
            out = self.model(batch, self.cache)
            self.model.logits(out.hidden)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return times


def step_time_curve(model: TargetModel, context: list[int], query_sizes: list[int], request_counts: list[int],
                    timings: int, progress=print) -> list[dict]:
    """Rows {curve, requests, tokens, ms (median), ms_min, ms_max, ms_per_token}: one request verifying B tokens
    for B in query_sizes, then R requests of one token for R in request_counts. The shapes are timed round-robin
    (each of `timings` rounds times every shape once, after one untimed warm-up round), so a machine whose speed
    drifts over the minutes of the curve shifts every point alike instead of tilting the curve."""
    bench = VerifyBench(model, context, max(request_counts, default=1), max(query_sizes, default=1))
    shapes = [("one_request", [b]) for b in query_sizes] + [("many_requests", [1] * r) for r in request_counts]
    times: list[list[float]] = [[] for _ in shapes]
    for round_ in range(1 + timings):
        for i, (_, lens) in enumerate(shapes):
            t = bench.time(lens, 1, warmup=1 if round_ == 0 else 0)
            if round_:
                times[i] += t
        if round_:
            progress(f"  verify curve: round {round_}/{timings}")
    rows = []
    for (curve, lens), t in zip(shapes, times):
        ms = 1e3 * statistics.median(t)
        rows.append({"curve": curve, "requests": len(lens), "tokens": sum(lens), "ms": ms, "ms_min": 1e3 * min(t),
                     "ms_max": 1e3 * max(t), "ms_per_token": ms / sum(lens), "timings": timings})
        progress(f"  verify R={len(lens):3d} B={sum(lens):4d}: {ms:7.2f} ms")
    return rows
