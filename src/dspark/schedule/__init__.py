from .async_budget import AsyncBudgetScheduler
from .base import FixedLength, Scheduler
from .cost_table import CostTable
from .prefix import PrefixScheduler
from .threshold import ThresholdScheduler
from ..config import SCHEDULERS

NEEDS_COST_TABLE = ("algorithm1", "async")


def make_scheduler(spec, gamma: int = 7, cost: CostTable | None = None, threshold: float = 0.5) -> Scheduler:
    """A Scheduler from a name or an instance: fixed (verify γ drafts), plain (none), threshold (prefix
    survival >= threshold), algorithm1 (Algorithm 1 of docs/method.md) or async (the production scheduler); the
    last two need the SPS(B) cost table."""
    if isinstance(spec, Scheduler):
        return spec
    if spec == "auto":
        raise ValueError("the auto scheduler depends on the drafter: resolve it first (auto.scheduler_for)")
    if spec in (None, "fixed"):
        return FixedLength(gamma)
    if spec == "plain":
        return FixedLength(0)
    if spec == "threshold":
        return ThresholdScheduler(threshold)
    if spec in NEEDS_COST_TABLE:
        if cost is None:
            raise ValueError(f"the {spec} scheduler needs a cost table (run `dspark profile`)")
        return PrefixScheduler(cost) if spec == "algorithm1" else AsyncBudgetScheduler(cost)
    raise ValueError(f"unknown scheduler {spec!r}; choose one of {', '.join(SCHEDULERS)}")


__all__ = ["SCHEDULERS", "NEEDS_COST_TABLE", "AsyncBudgetScheduler", "CostTable", "FixedLength", "PrefixScheduler",
           "Scheduler", "ThresholdScheduler", "make_scheduler"]
