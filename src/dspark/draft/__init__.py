from pathlib import Path

from .base import Drafter, NoDrafter, Proposal
from .prompt_lookup import PromptLookupDrafter

DRAFTERS = ("none", "prompt-lookup", "<path to a DSpark/DFlash/Eagle3 drafter folder>")


def make_drafter(spec, gamma: int = 7, target=None, max_model_len: int = 8192) -> Drafter:
    """A Drafter from a name ("none", "prompt-lookup"), a drafter folder (config.json + model.safetensors,
    loaded against `target`) or an instance."""
    if isinstance(spec, Drafter):
        return spec
    if spec in (None, "none"):
        return NoDrafter()
    if spec == "prompt-lookup":
        return PromptLookupDrafter(gamma=gamma)
    if Path(spec).expanduser().is_dir():
        from .checkpoint import load_drafter
        from .dspark import DSparkDrafter
        from .eagle3 import Eagle3Drafter
        from .eagle3_model import Eagle3Model

        from ..calibrate import load_temperatures

        folder = Path(spec).expanduser()
        model = load_drafter(folder, target)
        if isinstance(model, Eagle3Model):
            return Eagle3Drafter(model, max_model_len)
        temps = load_temperatures(folder) if model.confidence_head is not None else None
        return DSparkDrafter(model, max_model_len, temps)
    raise ValueError(f"unknown drafter {spec!r}: give none, prompt-lookup or a drafter folder")


__all__ = ["DRAFTERS", "Drafter", "NoDrafter", "Proposal", "PromptLookupDrafter", "make_drafter"]
