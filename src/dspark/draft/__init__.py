from .base import Drafter, NoDrafter, Proposal
from .prompt_lookup import PromptLookupDrafter

DRAFTERS = ("none", "prompt-lookup")


def make_drafter(spec, gamma: int = 7) -> Drafter:
    """A Drafter from a name ("none", "prompt-lookup") or an instance."""
    if isinstance(spec, Drafter):
        return spec
    if spec in (None, "none"):
        return NoDrafter()
    if spec == "prompt-lookup":
        return PromptLookupDrafter(gamma=gamma)
    raise ValueError(f"unknown drafter {spec!r}; choose one of {', '.join(DRAFTERS)}")


__all__ = ["DRAFTERS", "Drafter", "NoDrafter", "Proposal", "PromptLookupDrafter", "make_drafter"]
