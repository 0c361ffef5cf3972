"""Held-out expected τ (what `dspark train` reports) against the engine's τ on the same prompts, and where the two part.

`dspark train` scores a drafter on its held-out answers (the last 16 records of the data file) by teacher forcing:
c*_k = 1 - ½‖q_k - p_k‖₁ at anchors drawn uniformly over each answer, τ = 1 + Σ_k Π_{i<=k} c*_i. The engine draws
its own text and starts a block only where the last cycle ended. This script runs both on the same prompts (the
held-out ones and as many trained-on ones), one request at a time at fixed γ, and reports:

- engine_tau: τ the engine reached (accepted drafts + 1 per cycle);
- tau_data / tau_engine_text: training's expected τ at every anchor of the data's answers / of the engine's answers;
- c1_every / c1_cycles: training's c*_1 over every anchor of the engine's answers / only where its cycles began;
- c1_engine: the engine's own Σ min(p, q) for the first draft of each of those cycles (from the p and q it verified
  with), which should equal c1_cycles; c1_realized: the share of those cycles that accepted the first draft.

    python drafters/training_answers.py unpack --out train.jsonl     # the committed drafters' training answers
    python benchmarks/heldout_engine.py --data train.jsonl
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (RESULTS_DIR, Log, add_presets, apply_presets, finish, markdown_table,  # noqa: E402
                               result_header, result_preamble)
import dspark.engine.llm_engine as llm_engine  # noqa: E402
from dspark import LLM  # noqa: E402
from dspark.config import DTYPE_CHOICES  # noqa: E402
from dspark.draft import DEFAULT_DRAFTER_DIR  # noqa: E402
from dspark.draft.checkpoint import load_drafter  # noqa: E402
from dspark.draft.draft_vocab import TrainingVocab, load_draft_vocab  # noqa: E402
from dspark.sampling import SamplingParams  # noqa: E402
from dspark.train.anchors import AnchorBatch  # noqa: E402
from dspark.train.features import target_features  # noqa: E402
from dspark.train.forward import forward_for  # noqa: E402
from dspark.train.trainer import load_sequences  # noqa: E402

FULL = {"prompts": 16, "max_new_tokens": 384}
QUICK = {"prompts": 2, "max_new_tokens": 24}
ANCHOR_CHUNK = 64  # anchors per teacher-forced drafter forward


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="the drafter's training data (regenerated JSONL); its last "
                   "--prompts records are the held-out ones, as `dspark train` holds them out")
    p.add_argument("--drafter", default=str(DEFAULT_DRAFTER_DIR), help="a DSpark or DFlash drafter folder "
                   "[the bundled one]")
    add_presets(p, FULL, QUICK)
    p.add_argument("--temperature", type=float, default=1.0, help="the engine's sampling temperature [1.0]")
    p.add_argument("--seed", type=int, default=0, help="request r samples with seed + r [0]")
    p.add_argument("--max-len", type=int, default=640, help="tokens per sequence scored, as `dspark train --max-len` "
                   "(the committed drafters: 640) [640]")
    p.add_argument("--dtype", default="bf16", choices=DTYPE_CHOICES)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS_DIR / "heldout_engine"))
    return apply_presets(p.parse_args(argv), FULL, QUICK)


@contextlib.contextmanager
def first_draft_log(log: list):
    """While open, each verify step of a single request logs (Σ min(p, q) of its first draft, or None where it
    verified none; drafts accepted)."""
    original = llm_engine.rejection_sample

    def logged(p, starts, drafts, q, lengths, u_accept, u_sample):
        verdict = original(p, starts, drafts, q, lengths, u_accept, u_sample)
        drafted = q is not None and drafts.shape[1] and int(lengths[0]) > 0
        overlap = float(torch.minimum(p[starts[0]].float(), q[0, 0].float()).sum()) if drafted else None
        log.append((overlap, int(verdict.num_accepted[0])))
        return verdict

    llm_engine.rejection_sample = logged
    try:
        yield log
    finally:
        llm_engine.rejection_sample = original


def engine_runs(llm: LLM, records: list[dict], args) -> list[dict]:
    """Each prompt alone through the engine: its answer and, per cycle, (first-draft overlap, accepted)."""
    runs = []
    for i, rec in enumerate(records):
        with first_draft_log([]) as cycles:
            out = llm.generate([rec["prompt_ids"]], SamplingParams(temperature=args.temperature,
                                                                   max_tokens=args.max_new_tokens, seed=args.seed + i))[0]
        if out.finish_reason == "error":
            raise RuntimeError(f"the engine failed on record {rec['id']}: {out.error}")
        runs.append({"prompt_ids": rec["prompt_ids"], "answer_ids": list(out.token_ids), "cycles": cycles})
    return runs


class TeacherForced:
    """Training's scoring (the loss code's c*_k) of a drafter at chosen anchors of a sequence."""

    def __init__(self, drafter_dir: str, target, max_len: int):
        self.target, self.max_len = target, max_len
        self.model = load_drafter(drafter_dir, target, dtype=torch.float32)
        ids = load_draft_vocab(drafter_dir, self.model.c.vocab_size, honour_options=False)
        self.vocab = TrainingVocab(ids, self.model.lm_head) if ids is not None else None

    def score(self, ids: list[int], *anchor_sets: list[int]) -> list[tuple[float, float, int]]:
        """Per set of anchors (one target forward for them all): (Σ c*_1, Σ expected τ, anchors scored); anchors past
        the last full block are dropped."""
        ids = ids[:self.max_len]
        last = len(ids) - 1 - self.model.block_size
        feats = target_features(self.target, [ids], self.model.target_layer_ids) if last >= 0 else None
        out = []
        for anchors in anchor_sets:
            anchors, c1, tau = [a for a in anchors if a <= last], 0.0, 0.0
            for i in range(0, len(anchors), ANCHOR_CHUNK):
                chunk = torch.tensor(anchors[i:i + ANCHOR_CHUNK])[None]
                batch = AnchorBatch(chunk, torch.ones_like(chunk, dtype=torch.bool), self.model.block_size)
                with torch.no_grad():
                    parts = forward_for(self.model)(self.model, self.target, torch.tensor([ids]), feats, batch,
                                                    vocab=self.vocab).loss()
                c1 += float(parts.accept[0]) * chunk.shape[1]  # the loss code averages over the chunk's blocks
                tau += float(parts.tau) * chunk.shape[1]
            out.append((c1, tau, len(anchors)))
        return out


class Means:
    """Running means of named quantities: add(name, total, count)."""

    def __init__(self):
        self.totals = {}

    def add(self, name: str, total: float, count: int):
        t, n = self.totals.get(name, (0.0, 0))
        self.totals[name] = (t + total, n + count)

    def __getitem__(self, name: str) -> float:
        t, n = self.totals[name]
        return t / n if n else float("nan")


def engine_tau(runs: list[dict]) -> float:
    """Tokens per verify cycle (the first answer token comes from the prefill, not from a cycle)."""
    return sum(len(r["answer_ids"]) - 1 for r in runs) / max(sum(len(r["cycles"]) for r in runs), 1)


def group_row(name: str, records: list[dict], runs: list[dict], scorer: TeacherForced) -> dict:
    m = Means()
    for rec, run in zip(records, runs):
        start = rec["start"]  # `dspark train`'s first anchor: the last prompt token
        [(_, tau, n)] = scorer.score(rec["ids"], list(range(start, len(rec["ids"]))))
        m.add("tau_data", tau, n)
        anchors, drafted, pos = [], [], len(run["prompt_ids"])  # the engine's first anchor: the first answer token
        for o, accepted in run["cycles"]:
            if o is not None:  # cycles that verified a first draft
                anchors.append(pos)
                drafted.append((o, accepted))
            pos += accepted + 1
        ids = run["prompt_ids"] + run["answer_ids"]
        (c1, tau, n), (c1_cycles, _, n_cycles) = scorer.score(ids, list(range(start, len(ids))), anchors)
        m.add("tau_engine_text", tau, n)
        m.add("c1_every", c1, n)
        m.add("c1_cycles", c1_cycles, n_cycles)
        kept = drafted[:n_cycles]  # those whose block lies inside the scored sequence
        m.add("c1_engine", sum(o for o, _ in kept), len(kept))
        m.add("c1_realized", sum(a > 0 for _, a in kept), len(kept))
    return {"prompts": name, "requests": len(runs), "engine_tau": engine_tau(runs)} | {
        k: m[k] for k in ("tau_data", "tau_engine_text", "c1_every", "c1_cycles", "c1_engine", "c1_realized")} | {
        "cycles_scored": m.totals["c1_engine"][1]}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    log = Log()
    records = load_sequences(args.data, args.max_len)
    if len(records) < 2 * args.prompts:
        raise SystemExit(f"{args.data} holds {len(records)} records: fewer than 2 x --prompts {args.prompts}")
    for rec in records:
        rec["prompt_ids"] = rec["ids"][:rec["start"] + 1]
    groups = {"held out": records[-args.prompts:], "trained on": records[:args.prompts]}
    llm = LLM(drafter=args.drafter, scheduler="fixed", dtype=args.dtype, max_num_seqs=1)
    llm.generate([groups["held out"][0]["prompt_ids"]], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    scorer = TeacherForced(args.drafter, llm.engine.target, args.max_len)
    result = result_header("heldout_engine", __file__, argv)
    result["settings"] = {"data": args.data, "drafter": args.drafter, "prompts": args.prompts,
                          "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed,
                          "max_len": args.max_len, "dtype": args.dtype}
    rows = []
    for name, recs in groups.items():
        runs = engine_runs(llm, recs, args)
        log(f"{name}: engine τ {engine_tau(runs):.3f}")
        rows.append(group_row(name, recs, runs, scorer))
        log(f"{name}: {rows[-1]}")
    result["rows"] = rows
    held = rows[0]
    result["headline"] = {"heldout_tau_over_engine_tau": held["tau_data"] / held["engine_tau"],
                          "c1_engine_over_training_at_cycles": held["c1_engine"] / held["c1_cycles"],
                          "c1_cycles_over_every": held["c1_cycles"] / held["c1_every"]}
    return finish(result, args.out, markdown, {}, log)


def markdown(result: dict) -> str:
    s = result["settings"]
    return "\n\n".join([
        result_preamble(result),
        f"Drafter `{s['drafter']}`, data `{s['data']}`: its last {s['prompts']} records (held out by `dspark train`) "
        f"and its first {s['prompts']}; the engine at T = {s['temperature']}, fixed γ, one request at a time, "
        f"{s['max_new_tokens']} new tokens, {s['dtype']}. Columns: see the script's docstring.",
        markdown_table(result["rows"], ["prompts", "requests", "engine_tau", "tau_data", "tau_engine_text", "c1_every",
                                        "c1_cycles", "c1_engine", "c1_realized", "cycles_scored"]),
        "## Headline (held-out prompts)",
        markdown_table([{"figure": k, "value": v} for k, v in result["headline"].items()], ["figure", "value"]),
    ]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
