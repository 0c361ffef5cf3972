from .base import FixedLength, Scheduler

SCHEDULERS = ("fixed",)


def make_scheduler(spec, gamma: int = 7) -> Scheduler:
    """A Scheduler from a name ("fixed") or an instance."""
    if isinstance(spec, Scheduler):
        return spec
    if spec in (None, "fixed"):
        return FixedLength(gamma)
    raise ValueError(f"unknown scheduler {spec!r}; choose one of {', '.join(SCHEDULERS)}")


__all__ = ["SCHEDULERS", "FixedLength", "Scheduler", "make_scheduler"]
