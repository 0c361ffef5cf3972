from pathlib import Path

from ..proposal import Proposal  # noqa: F401 (the drafters' output type, re-exported)
from .base import Drafter, NoDrafter
from .prompt_lookup import PromptLookupDrafter

DRAFTERS = ("auto", "default", "none", "prompt-lookup", "<path to a DSpark/DFlash/Eagle3 drafter folder>",
            "lookup+default", "lookup+<folder>")
# the DSpark drafter trained by this project for the bundled SmolLM2-135M-Instruct (trainable weights only)
DEFAULT_DRAFTER_DIR = Path(__file__).resolve().parent.parent / "drafters" / "smollm2-135m-dspark"


def default_fits(target) -> bool:
    """Whether the bundled drafter exists and was trained for this target's shape (the bundled SmolLM2)."""
    import json

    path = DEFAULT_DRAFTER_DIR / "config.json"
    if target is None or not path.is_file():
        return False
    config = json.loads(path.read_text())
    c = target.config
    return (config.get("vocab_size"), config.get("hidden_size"), config.get("num_target_layers")) == (
        c.vocab_size, c.hidden_size, c.num_hidden_layers)


def lookup_sources(folder: Path, gamma: int) -> list:
    """What lookup+FOLDER looks up first: prompt lookup of a long repeat (the last 10-12 tokens occurred before: up
    to 2 gamma drafts, as such a repeat tends to go on past gamma tokens), then prompt lookup of 3- to 1-grams.
    Where the folder has a datastore of the target's answers (datastore.npz), it comes after the 3- and 2-grams
    (matches of 2 tokens or more whose first continuation most of them share), before the 1-grams: the sources are
    ordered by how many tokens their drafts get accepted a step, and the drafter drafts where none finds a draft
    (benchmarks/results/drafters.md: lookup+dspark)."""
    long_repeat = PromptLookupDrafter(2 * gamma, max_ngram=12, min_ngram=10)
    path = folder / "datastore.npz"
    if not path.is_file():
        return [long_repeat, PromptLookupDrafter(gamma)]
    from .datastore import Datastore

    return [long_repeat, PromptLookupDrafter(gamma, min_ngram=2), Datastore.load(path, gamma=gamma),
            PromptLookupDrafter(gamma, max_ngram=1)]


def make_drafter(spec, gamma: int = 7, target=None, max_model_len: int = 8192) -> Drafter:
    """A Drafter from a name ("default": the bundled DSpark drafter of SmolLM2-135M-Instruct; "none";
    "prompt-lookup"), a drafter folder (config.json + model.safetensors, loaded against `target`), "lookup+"
    before either of the last two (prompt lookup where the context repeats itself, that drafter elsewhere:
    lookup_first.py) or an instance. "auto" is resolved before (auto.py)."""
    if isinstance(spec, Drafter):
        return spec
    if spec in (None, "none"):
        return NoDrafter()
    if spec == "prompt-lookup":
        return PromptLookupDrafter(gamma=gamma)
    if isinstance(spec, str) and spec.startswith("lookup+"):  # prompt lookup first, the named drafter elsewhere
        from .lookup_first import LookupFirstDrafter

        folder = spec[len("lookup+"):]
        inner = make_drafter(folder, gamma, target, max_model_len)
        return LookupFirstDrafter(inner, lookup_sources(DEFAULT_DRAFTER_DIR if folder == "default" else Path(folder),
                                                        gamma), min(gamma, inner.gamma))
    if spec == "default":
        if not (DEFAULT_DRAFTER_DIR / "config.json").is_file():
            raise ValueError(f"no default drafter is bundled at {DEFAULT_DRAFTER_DIR}; give a drafter folder")
        spec = DEFAULT_DRAFTER_DIR
    if Path(spec).expanduser().is_dir():
        from .checkpoint import load_drafter
        from .dspark import DSparkDrafter
        from .eagle3 import Eagle3Drafter
        from .eagle3_model import Eagle3Model

        from ..calibrate import load_calibration
        from .draft_vocab import load_draft_vocab, restrict
        from ..kernels.groups import hold_head_groups
        from ..kernels.q4_1 import Q4Linear

        folder = Path(spec).expanduser()
        model = load_drafter(folder, target)
        ids = load_draft_vocab(folder, model.c.vocab_size)
        if ids is not None:  # drafts from the most frequent tokens only: smaller heads, the same lossless q
            restrict(model, ids)
        if target is not None and any(isinstance(m, Q4Linear) for m in target.modules()):
            # a q4_1 target: the drafter's LM head in 4 bits too (a cheaper q, still exactly the q sampled from)
            model.lm_head = Q4Linear(model.lm_head)
        else:  # few-row heads (short drafts) read 8-bit groups: the same argument
            hold_head_groups(model.lm_head)
        if isinstance(model, Eagle3Model):
            return Eagle3Drafter(model, max_model_len)
        calibration = load_calibration(folder) if model.confidence_head is not None else None
        if calibration is None:
            return DSparkDrafter(model, max_model_len)
        return DSparkDrafter(model, max_model_len, calibration["temperatures"],
                             offline_ece=calibration.get("after", {}).get("ece"))
    raise ValueError(f"unknown drafter {spec!r}: give none, prompt-lookup, default, auto (resolved by the engine), a "
                     "drafter folder or lookup+ before default or a folder")


__all__ = ["DEFAULT_DRAFTER_DIR", "DRAFTERS", "Drafter", "NoDrafter", "Proposal", "PromptLookupDrafter", "make_drafter"]
