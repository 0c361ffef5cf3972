"""`dspark profile`: measure this engine's step time as a function of B on this machine, for the loaded
target and drafter: verify forward + LM head + sampling + rejection for B tokens, and one drafter call for
R requests. Requests with random prompts are admitted to the engine, measured, then aborted; the KV
positions written during measuring are past every committed position and are overwritten later.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch
from tqdm import tqdm

from ..proposal import Proposal
from .llm_engine import LLMEngine
from .. import options
from ..cache import cache_root
from ..kernels.skinny import kernel_name
from ..sampling import SamplingParams, param_tensors, warp
from ..verify import rejection_sample
from ..schedule.cost_table import CostTable

# part of a cached profile's key, raised when step costs change shape (2: bf16 many-row verify in float32;
# 3: that path from 7 rows; 4: drafter calls one position deep, monotone verify times)
PROFILE_VERSION = 4
DEFAULT_SIZES = (*range(1, 17), 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__}


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def profile_engine(engine: LLMEngine, max_requests: int = 64, context: int = 128, repeats: int = 3,
                   sizes=DEFAULT_SIZES, progress: bool = True, seed: int = 0) -> CostTable:
    if engine.has_unfinished():
        raise ValueError("profile an idle engine (requests are running)")
    gamma = engine.drafter.gamma
    per_request = gamma + 1
    max_requests = min(max_requests, engine.config.max_num_seqs)
    g = torch.Generator().manual_seed(seed)
    vocab = engine.target.config.vocab_size
    params = SamplingParams(temperature=1.0, max_tokens=10**6, ignore_eos=True, seed=seed)
    reqs = [engine.add_request(torch.randint(100, vocab, (context,), generator=g).tolist(), params)
            for _ in range(max_requests)]
    try:
        while any(not r.output_ids for r in reqs):  # prefill (over several steps past the prefill budget):
            engine.step()  # every request now has a committed context and a first token
        sizes = [b for b in sizes if b <= max_requests * per_request]
        drafter_counts = sorted({min(max_requests, 2 ** i) for i in range(int(math.log2(max_requests)) + 1)})
        bar = tqdm(total=len(sizes) + 2 * len(drafter_counts), desc="profile", disable=not progress)
        verify_seconds = []
        for B in sizes:
            R = math.ceil(B / per_request)
            lengths = torch.tensor([per_request - 1] * (B // per_request) + ([B % per_request - 1] if B % per_request else []))
            verify_seconds.append(_median_time(lambda: _verify(engine, reqs[:R], lengths), repeats))
            bar.update()
        verify_seconds = monotone(verify_seconds)
        draft_seconds, draft_seconds_one = [], []  # the whole block, and one position per request
        for seconds, depth in ((draft_seconds, None), (draft_seconds_one, 1)):
            for R in drafter_counts:
                seconds.append(_median_time(lambda: engine.drafter.propose(reqs[:R], depth), repeats) if gamma else 0.0)
                bar.update()
        bar.close()
    finally:
        for req in reqs:
            engine.abort(req.request_id)
    meta = {"machine": machine(), "dtype": str(engine.target.dtype).removeprefix("torch."),
            "target": getattr(engine.target.config, "_name_or_path", "") or engine.target.config.model_type,
            "drafter": type(engine.drafter).__name__, "gamma": gamma, "context": context, "repeats": repeats,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    if not gamma:
        return CostTable(list(sizes), verify_seconds, meta=meta)
    return CostTable(list(sizes), verify_seconds, drafter_counts, draft_seconds, draft_seconds_one, gamma, meta=meta)


def monotone(seconds: list[float]) -> list[float]:
    """The non-decreasing sequence nearest to `seconds` in least squares (pooling adjacent violators): a verify of
    more tokens never costs less, but a profile's noise can say so (on a busy machine especially), and a
    scheduler would then take the dips for real."""
    blocks: list[list[float]] = []  # [mean, count]
    for t in seconds:
        blocks.append([t, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def _verify(engine: LLMEngine, reqs, lengths: torch.Tensor) -> None:
    """One verify step's work for these requests, nothing committed: forward, LM head, warp, rejection."""
    R = len(reqs)
    G = max(int(lengths.max()), 0)
    drafts = torch.randint(100, engine.target.config.vocab_size, (R, G))
    batch, _, logits = engine.runner.verify(reqs, Proposal(drafts, None, lengths), lengths, len(engine.running), True)
    p = warp(logits, *param_tensors([r.params for r in reqs], (1 + lengths).tolist()))
    u = torch.rand(R, G + 1)
    rejection_sample(p, batch.starts, drafts, None, lengths, u[:, :G], u[:, G])


def cached_profile(engine: LLMEngine, key: tuple, profile: bool = True) -> CostTable:
    """The cost table for this engine, machine, product kernel, weight groups (target's and drafter's) and draft
    vocabulary from ~/.cache/dspark/profiles, profiled (about a minute) and saved there the first time; a file that
    cannot be read (cut short, or written by another version) is profiled again and replaced. profile=False: with
    no usable cached table, the provisional one (CostTable.provisional), said on stderr."""
    drafter = getattr(engine.drafter, "model", torch.nn.Module())
    groups = sum(getattr(m, "groups", None) is not None for m in [*engine.target.modules(), *drafter.modules()])
    draft_ids = getattr(drafter, "draft_ids", None)  # groups.py and a draft vocabulary change costs
    digest = hashlib.sha256(repr((*key, machine()["cpu"], kernel_name(), groups, PROFILE_VERSION,
                                  sorted(dataclasses.asdict(options.current()).items())) +
                                 (() if draft_ids is None else (len(draft_ids),))).encode()).hexdigest()[:16]
    path = cache_root() / "profiles" / f"{digest}.json"
    if path.is_file():
        try:
            return CostTable.load(path)
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # partial or foreign: profile, replace it
            print(f"cannot read the cached cost table {path} ({e}); profiling again", file=sys.stderr, flush=True)
    if not profile:
        print("no SPS(B) profile cached for this engine and machine: scheduling from a provisional cost table that "
              "measured steps correct (`dspark profile`, or --profile, measures one)", file=sys.stderr, flush=True)
        return CostTable.provisional(max_requests=engine.config.max_num_seqs)
    print(f"profiling step times for the scheduler (once; cached at {path})", file=sys.stderr, flush=True)
    table = profile_engine(engine, max_requests=engine.config.max_num_seqs)
    path.parent.mkdir(parents=True, exist_ok=True)
    return CostTable.load(table.save(path))


def plot_cost_table(table: CostTable, path) -> str:
    """Step time against B (verify + sampling), with the drafter call's cost and the staircase steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(table.verify_sizes, [1000 * t for t in table.verify_seconds], "o-", ms=3, label="verify + sampling")
    for b in table.staircase():
        ax.axvline(b, color="red", lw=0.7, ls=":")
    if table.draft_sizes:
        ax.plot(table.draft_sizes, [1000 * t for t in table.draft_seconds], "s--", ms=3, label="drafter call (x = R)")
    if table.draft_seconds_one:
        ax.plot(table.draft_sizes, [1000 * t for t in table.draft_seconds_one], "^:", ms=3,
                label="drafter call, one position (x = R)")
    m = table.meta
    ax.set_title(f"{m.get('target', '')} {m.get('dtype', '')}, {m.get('machine', {}).get('threads', '?')} threads",
                 fontsize=9)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("verify tokens B (requests R for the drafter)")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
