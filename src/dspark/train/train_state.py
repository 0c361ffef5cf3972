"""A training run's checkpoint, one unit: `train_state.pt` holds the step, the trainable weights, the optimizer,
every random state, the settings, a fingerprint of the data and the record of settings changed on resume, in one
atomic write. The folder's `model.safetensors` + `config.json` are the drafter as it loads elsewhere, written after
the state and checked against it on resume: a kill between the writes leaves an older view, which the resume
rewrites from the state (and says so).

On resume the saved settings are compared with the new ones: those that shape the weights never change; the
training settings (data, batch, schedule, seed, ...) change only with `allow_changes`, and each change is recorded
in the state and in `dspark export`'s training.json; the rest (where to write, how often to save or evaluate, the
feature cache, the time limit) are free."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from ..draft.checkpoint import atomic_write

STATE_FILE = "train_state.pt"
LOG_FILE = "train_log.jsonl"
STATE_FORMAT = 2  # 1: no weights in the state (they were in model.safetensors only)

ARCHITECTURE = ("drafter_type", "num_layers", "block_size", "markov_rank", "markov_head_type", "confidence", "init",
                "target")
# free, or (draft_vocab) checked against the folder's draft_vocab.json by the trainer, with a more precise message
FREE = ("out", "feature_cache", "max_minutes", "save_every", "eval_every", "allow_changes", "extra", "draft_vocab")
REQUIRED = ("step", "opt", "config", "rng")


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_state(path: Path) -> dict:
    """The saved training state, or a one-line ValueError naming the file and what is wrong."""
    try:
        state = torch.load(path, weights_only=False, map_location="cpu")
    except Exception as exc:  # a torn or foreign file: zip, pickle and EOF errors alike
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{path} is not a readable training checkpoint ({reason}); restore it or start the run in "
                         "a new folder") from None
    missing = [k for k in REQUIRED if not isinstance(state, dict) or k not in state]
    if missing or not isinstance(state["step"], int) or state["step"] < 0:
        raise ValueError(f"{path} is not a training checkpoint (missing or bad: {', '.join(missing) or 'step'})")
    return state


def compare_settings(saved: dict, now: dict) -> tuple[list[str], list[dict]]:
    """(refused, changed): settings that shape the weights and differ, and training settings that differ, each as
    {"field", "was", "now"}. A field the saved record lacks (an older run) is not compared."""
    refused, changed = [], []
    for field, value in now.items():
        if field in FREE or field not in saved or saved[field] == value:
            continue
        if field in ARCHITECTURE:
            refused.append(f"{field}: {saved[field]!r} there, {value!r} now")
        else:
            changed.append({"field": field, "was": saved[field], "now": value})
    return refused, changed


def describe(changes: list[dict]) -> str:
    return ", ".join(f"{c['field']}: {c['was']!r} there, {c['now']!r} now" for c in changes)


def save_state(path: Path, state: dict) -> None:
    atomic_write(path, lambda p: torch.save({**state, "format": STATE_FORMAT}, p))


def trim_log(folder: Path, step: int) -> int:
    """Drop the log rows after `step` (written after the checkpoint a resume starts from); returns how many."""
    path = folder / LOG_FILE
    if not path.is_file():
        return 0
    rows = path.read_text().splitlines(keepends=True)
    kept = [r for r in rows if r.endswith("\n") and logged_step(r) <= step]  # a torn last row goes too
    if len(kept) != len(rows):
        atomic_write(path, lambda p: Path(p).write_text("".join(kept)))
    return len(rows) - len(kept)


def logged_step(row: str) -> float:
    try:
        return json.loads(row).get("step", 0)
    except (json.JSONDecodeError, AttributeError):
        return float("inf")


def say(message: str):
    tqdm.write(message, file=sys.stderr)
