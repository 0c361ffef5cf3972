"""The SPS(B) cost table (docs/method.md): the real time of one engine step as a function of the verify batch
B = Σ_r (1 + ℓ_r), split as the engine spends it: verify forward plus sampling, a function of B, and the
next drafter call, a function of the number of requests R and of its depth (the positions it samples per
request: the backbone drafts the whole block in one forward, the LM head and the sequential head run once
per position, so a shallower call is cheaper; costed linearly between one position and the whole block).

B is rounded up to the next measured size before costing (as a GPU engine rounds up to a captured graph
bucket); past the largest size the last slope is extended. Measured step times correct the table online:
each bucket keeps a running ratio of measured over tabled time, so a stale table heals while serving.
"""
from __future__ import annotations

import bisect
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path


def _lookup(sizes: list[int], seconds: list[float], n: int) -> tuple[int, float]:
    """(bucket index, seconds) for n: the first size >= n; past the end, the last slope extended."""
    if not sizes:
        return -1, 0.0
    i = bisect.bisect_left(sizes, n)
    if i < len(sizes):
        return i, seconds[i]
    if len(sizes) == 1:
        return len(sizes) - 1, seconds[-1] * n / sizes[-1]
    slope = (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2])
    return len(sizes) - 1, seconds[-1] + max(slope, 0.0) * (n - sizes[-1])


@dataclass
class CostTable:
    verify_sizes: list[int]  # B, ascending
    verify_seconds: list[float]  # verify forward + sampling at each B
    draft_sizes: list[int] = field(default_factory=list)  # R, ascending
    draft_seconds: list[float] = field(default_factory=list)  # one drafter call for R requests, the whole block
    draft_seconds_one: list[float] = field(default_factory=list)  # the same, sampling one position per request
    draft_depth: int = 1  # positions per request of draft_seconds (the drafter's γ)
    meta: dict = field(default_factory=dict)  # hardware, dtype, target, drafter, date, command
    correction: list[float] = field(default_factory=list)  # per verify bucket: measured / tabled (online)
    correction_rate: float = 0.05

    def __post_init__(self):
        if not self.verify_sizes or len(self.verify_sizes) != len(self.verify_seconds):
            raise ValueError("a cost table needs verify sizes and their times, one for one")
        if list(self.verify_sizes) != sorted(set(self.verify_sizes)) or list(self.draft_sizes) != sorted(set(self.draft_sizes)):
            raise ValueError("cost table sizes must be strictly ascending")
        if len(self.draft_seconds) != len(self.draft_sizes) or len(self.draft_seconds_one) not in (0, len(self.draft_sizes)):
            raise ValueError("a cost table needs one drafter time per drafter size")
        if not self.correction:
            self.correction = [1.0] * len(self.verify_sizes)

    @classmethod
    def provisional(cls, max_size: int = 512, max_requests: int = 64) -> "CostTable":
        """A table to start from before this machine is profiled, cautious about speculation: a step's time grows by
        a one-token step's every 16 tokens of B and a drafter call costs 30% of a one-token step, more than it does on the CPUs and GPUs
        measured, so the schedulers verify fewer drafts than they should rather than more. Measured steps correct
        its verify times online."""
        sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, max(512, max_size)]
        unit = 0.05  # seconds of a one-token step (only ratios matter to the schedulers, and corrections fix it)
        requests = sorted({1, max(1, max_requests)})
        return cls(sizes, [unit * (1 + (b - 1) / 16) for b in sizes], requests,
                   [unit * (0.3 + 0.02 * (r - 1)) for r in requests], meta={"provisional": True})

    @classmethod
    def from_sps(cls, sps: dict[int, float], **meta) -> "CostTable":
        """A table from steps per second at each B (no drafter term), e.g. Appendix A's example (docs/method.md)."""
        sizes = sorted(sps)
        return cls(sizes, [1.0 / sps[b] for b in sizes], meta=meta)

    # ---- costing -------------------------------------------------------------------------------
    def draft_time(self, R: int, depth: int | None = None) -> float:
        """Seconds of one drafter call for R requests sampling `depth` positions each (None: the whole block)."""
        if depth is not None and depth <= 0:
            return 0.0
        full = _lookup(self.draft_sizes, self.draft_seconds, R)[1]
        if depth is None or depth >= self.draft_depth or not self.draft_seconds_one:
            return full
        one = min(_lookup(self.draft_sizes, self.draft_seconds_one, R)[1], full)  # a noisy profile may invert them
        return one + (full - one) * (depth - 1) / (self.draft_depth - 1)

    def step_time(self, B: int, R: int = 1, drafted: bool = True, depth: int | None = None) -> float:
        """Predicted seconds of a step verifying B tokens for R requests (corrected online); drafted=False:
        a step that skipped the drafter call; depth: positions the drafter sampled per request (None: all)."""
        i, verify = _lookup(self.verify_sizes, self.verify_seconds, B)
        return verify * self.correction[i] + (self.draft_time(R, depth) if drafted else 0.0)

    def sps(self, B: int, R: int = 1, drafted: bool = True, depth: int | None = None) -> float:
        return 1.0 / self.step_time(B, R, drafted, depth)

    @property
    def max_size(self) -> int:
        return self.verify_sizes[-1]

    def observe(self, B: int, R: int, seconds: float, drafted: bool = True, depth: int | None = None) -> None:
        """Fold a measured step time into its bucket's running ratio (measured / tabled)."""
        i, verify = _lookup(self.verify_sizes, self.verify_seconds, B)
        draft = self.draft_time(R, depth) if drafted else 0.0
        if verify <= 0:
            return
        ratio = max(seconds - draft, 1e-6) / verify
        self.correction[i] += self.correction_rate * (ratio - self.correction[i])

    def staircase(self, jump: float = 2.0) -> list[int]:
        """Sizes where the step time jumps: the increase per token from the previous size is more than
        `jump` times the median increase per token (kernel tiles, thread blocking, graph buckets)."""
        s, t = self.verify_sizes, self.verify_seconds
        slopes = [(t[i] - t[i - 1]) / (s[i] - s[i - 1]) for i in range(1, len(s))]
        if not slopes:
            return []
        median = sorted(slopes)[len(slopes) // 2]
        floor = max(median, 1e-9)
        return [s[i + 1] for i, d in enumerate(slopes) if d > jump * floor and t[i + 1] - t[i] > 0.02 * t[i]]

    # ---- files ---------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        data = asdict(self)
        data["staircase"] = self.staircase()
        tmp = path.with_suffix(path.suffix + ".part")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        data = json.loads(Path(path).read_text())
        data.pop("staircase", None)
        return cls(**data)
