"""The "auto" policy: which drafter and scheduler `--drafter auto --scheduler auto` (the defaults) run, by load and
target, in one table, each row with the committed measurement it rests on.

The bundled DSpark drafter fits only the bundled target (default_fits); other targets draft by prompt lookup. One
stream (max_num_seqs 1, as `dspark generate` runs) looks up first: prompt lookup and the datastore cost no forward and,
on the bundled target, were the fastest single streams measured; the DSpark drafter drafts where no lookup finds a
draft. Batches run the DSpark drafter under the asynchronous scheduler, which costs every step with the machine's
SPS(B) table and skips the drafter where no verify budget pays for it. A scheduler left on auto beside a named drafter
is the asynchronous one where the drafter gives confidences, else fixed γ."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Choice:
    one_stream: bool  # max_num_seqs == 1 and both left on auto
    bundled_fits: bool  # the bundled DSpark drafter was trained for this target
    drafter: str
    scheduler: str  # "auto": by the drafter's confidences (scheduler_for)
    measured: str  # the committed result that shows the choice


POLICY = (
    Choice(True, True, "lookup+default", "auto", "benchmarks/results/drafters.md: the default against each drafter"),
    Choice(False, True, "default", "auto", "benchmarks/results/concurrency_sweep.md, concurrency_lookup.md"),
    Choice(True, False, "prompt-lookup", "auto", "benchmarks/results/drafters.md: prompt lookup on one stream"),
    Choice(False, False, "prompt-lookup", "auto", "benchmarks/results/concurrency_lookup.md"),
)


def choose_drafter(spec, scheduler, max_num_seqs: int, bundled_fits: bool):
    """The drafter spec to build: `spec` itself unless it is "auto", then the policy's row."""
    if spec != "auto":
        return spec
    one_stream = max_num_seqs == 1 and scheduler == "auto"
    return next(c.drafter for c in POLICY if (c.one_stream, c.bundled_fits) == (one_stream, bundled_fits))


def scheduler_for(spec, drafter) -> str:
    """"auto": async where the built drafter gives confidences (the DSpark drafter), else fixed; others unchanged."""
    if spec != "auto":
        return spec
    return "async" if drafter.has_confidence else "fixed"
