"""The SPS(B) cost table (METHOD.md §5): the real time of one engine step as a function of the verify batch
B = Σ_r (1 + ℓ_r), split as the engine spends it: verify forward plus sampling, a function of B, and the
next drafter call, a function of the number of requests R.

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
    draft_seconds: list[float] = field(default_factory=list)  # one drafter call for R requests
    meta: dict = field(default_factory=dict)  # hardware, dtype, target, drafter, date, command
    correction: list[float] = field(default_factory=list)  # per verify bucket: measured / tabled (online)
    correction_rate: float = 0.05

    def __post_init__(self):
        if not self.verify_sizes or len(self.verify_sizes) != len(self.verify_seconds):
            raise ValueError("a cost table needs verify sizes and their times, one for one")
        if list(self.verify_sizes) != sorted(set(self.verify_sizes)) or list(self.draft_sizes) != sorted(set(self.draft_sizes)):
            raise ValueError("cost table sizes must be strictly ascending")
        if not self.correction:
            self.correction = [1.0] * len(self.verify_sizes)

    @classmethod
    def from_sps(cls, sps: dict[int, float], **meta) -> "CostTable":
        """A table from steps per second at each B (no drafter term), e.g. METHOD.md's Appendix A."""
        sizes = sorted(sps)
        return cls(sizes, [1.0 / sps[b] for b in sizes], meta=meta)

    # ---- costing -------------------------------------------------------------------------------
    def step_time(self, B: int, R: int = 1, drafted: bool = True) -> float:
        """Predicted seconds of a step verifying B tokens for R requests (corrected online); drafted=False:
        a step that skipped the drafter call."""
        i, verify = _lookup(self.verify_sizes, self.verify_seconds, B)
        return verify * self.correction[i] + (_lookup(self.draft_sizes, self.draft_seconds, R)[1] if drafted else 0.0)

    def sps(self, B: int, R: int = 1, drafted: bool = True) -> float:
        return 1.0 / self.step_time(B, R, drafted)

    @property
    def max_size(self) -> int:
        return self.verify_sizes[-1]

    def observe(self, B: int, R: int, seconds: float, drafted: bool = True) -> None:
        """Fold a measured step time into its bucket's running ratio (measured / tabled)."""
        i, verify = _lookup(self.verify_sizes, self.verify_seconds, B)
        draft = _lookup(self.draft_sizes, self.draft_seconds, R)[1] if drafted else 0.0
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
