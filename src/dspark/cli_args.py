"""The command line's shared flags: the target and how it computes (dspark.Options), the engine, and the LLM they
describe. cli.py, cli_train.py and cli_measure.py build their commands from these."""
from __future__ import annotations

import argparse

from .config import DTYPE_CHOICES, DTYPE_HELP, SCHEDULERS


def add_target_args(g):
    g.add_argument("--target", default=None,
                   help="target model: a Hugging Face folder, a .gguf file, or a hub id already in the local "
                        "cache (default: the bundled SmolLM2-135M-Instruct, converted once to safetensors)")
    g.add_argument("--dtype", default="bf16", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add_options_args(g)


def add_options_args(g):
    """The fields of dspark.Options as flags (how the target computes)."""
    from .options import KERNEL_CHOICES

    g.add_argument("--kernels", default="native", choices=KERNEL_CHOICES,
                   help="instruction set the compiled CPU kernels are built for (native: this CPU's own), or pytorch "
                        "(PyTorch's kernels only) (default: %(default)s)")
    g.add_argument("--inexact", action="store_true",
                   help="let forwards of many tokens take kernels that round differently from decoding one token (on "
                        "some CPUs faster prefills and wide batches); by default every row of every forward rounds "
                        "as that token decoded alone, so speculation never changes an answer")
    g.add_argument("--no-fused", action="store_true", help="run the target in PyTorch's layer loop")
    g.add_argument("--no-tiles", action="store_true",
                   help="no AMX tiles for bf16 products (saves their packed weight copies)")
    g.add_argument("--no-tile-attention", action="store_true",
                   help="no AMX tiles for attention (only matters with --inexact)")
    g.add_argument("--no-groups", action="store_true",
                   help="float32 weights on a GGUF grid are read dense, not as their groups")
    g.add_argument("--no-draft-vocab", action="store_true",
                   help="drafters draft over the whole vocabulary, ignoring their draft_vocab.json")


def options_from_args(args):
    """dspark.Options from the flags of add_options_args (defaults where a command has none of them)."""
    from .options import Options

    get = (lambda name: getattr(args, name, False))
    return Options(exact=not get("inexact"), kernels=getattr(args, "kernels", "native"), fused=not get("no_fused"),
                   tiles=not get("no_tiles"), tile_attention=not get("no_tile_attention"), groups=not get("no_groups"),
                   draft_vocab=not get("no_draft_vocab"))


def add_engine_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("model and engine")
    add_target_args(g)
    g.add_argument("--drafter", default="auto",
                   help="draft model: auto (with --scheduler auto, one stream (generate) runs lookups first and the "
                        "bundled DSpark drafter where none finds a draft, as lookup+default does; batches run the "
                        "DSpark drafter; targets it does not fit get prompt-lookup), default (the bundled DSpark "
                        "drafter of SmolLM2-135M-Instruct), none (plain decoding), prompt-lookup (n-gram match "
                        "against the context), the folder of a DSpark, DFlash or Eagle3-style drafter (config.json + "
                        "model.safetensors, the released layout), or lookup+default / lookup+FOLDER (prompt lookup of "
                        "long repeats, 3- and 2-grams, the folder's datastore of the target's answers, 1-grams; that "
                        "drafter elsewhere; greedy steps verify every source's draft as one tree). "
                        "benchmarks/results/drafters.md compares them (default: %(default)s)")
    g.add_argument("--scheduler", default="auto", choices=SCHEDULERS,
                   help="how many drafts each request verifies per step: auto (async where the drafter gives "
                        "confidences, else fixed), fixed (all γ), plain (none), threshold (prefix survival >= "
                        "--threshold), algorithm1 (Algorithm 1 of docs/method.md) or async (the production scheduler: a "
                        "budget from the confidences of two steps back, over the whole cost table; it skips the "
                        "drafter on steps where no budget pays for the drafter's time) (default: %(default)s)")
    g.add_argument("--gamma", type=int, default=7, help="draft block size γ; lookup+ drafters draft up to 2γ from a long repeat "
                   "(default: %(default)s)")
    g.add_argument("--cost-table", default=None,
                   help="SPS(B) cost table from `dspark profile` for the algorithm1 and async schedulers (default: "
                        "profiled once for this target, drafter and machine, and cached)")
    g.add_argument("--threshold", type=float, default=0.5,
                   help="prefix-survival threshold of the threshold scheduler (default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context limit in tokens (default: the target's max_position_embeddings)")


def llm_from_args(args, **config):
    """The LLM that the model-and-engine options describe."""
    from . import LLM

    return LLM(args.target, drafter=args.drafter, scheduler=args.scheduler, gamma=args.gamma, dtype=args.dtype,
               threads=args.threads, max_model_len=args.max_model_len, cost_table=args.cost_table,
               threshold=args.threshold, **config)


NAMED_DRAFTERS = ("auto", "default", "none", "prompt-lookup")
# (flag attribute, lowest allowed value, highest or None, what it is)
NUMBERS = [("threads", 1, None, "torch threads"), ("gamma", 1, 64, "the draft block size"),
           ("max_model_len", 2, None, "the context limit"), ("max_tokens", 1, None, "new tokens"),
           ("temperature", 0.0, None, "0 is greedy"), ("top_p", 0.0, 1.0, "the nucleus mass, above 0"),
           ("top_k", 0, 2**31 - 1, "top-k"), ("threshold", 0.0, 1.0, "the survival threshold"),
           ("max_num_seqs", 1, None, "requests at once"), ("port", 1, 65535, "the port"),
           ("max_waiting", 0, None, "queued requests"), ("default_max_tokens", 1, None, "new tokens"),
           ("max_completion_tokens", 1, None, "new tokens"), ("max_prompt_tokens", 1, None, "prompt tokens"),
           ("max_n", 1, None, "choices"), ("max_body_bytes", 1, None, "bytes")]


def check_args(args) -> list[str]:
    """What is wrong with the flags, checked before torch or a model loads (each a line for the user), and the notes
    on flags the chosen mode ignores (lines starting with "note:")."""
    from pathlib import Path

    problems = []
    for name, low, high, what in NUMBERS:
        value = getattr(args, name, None)
        if value is None:
            continue
        if value < low or (high is not None and value > high) or (name == "top_p" and value == 0):
            bound = f"between {low} and {high}" if high is not None else f"at least {low}"
            problems.append(f"--{name.replace('_', '-')} {value}: {name} must be {bound} ({what})")
    drafter = getattr(args, "drafter", None)
    if drafter is not None:
        inner = drafter.removeprefix("lookup+")
        if drafter.startswith("lookup+") and inner in ("auto", "none", "prompt-lookup"):
            problems.append(f"--drafter {drafter}: lookup+ goes before default or a drafter folder")
        elif inner not in NAMED_DRAFTERS and not (Path(inner).expanduser() / "config.json").is_file():
            problems.append(f"unknown drafter {drafter!r}: give {', '.join(NAMED_DRAFTERS)}, lookup+default, "
                            "lookup+FOLDER, or a drafter folder with config.json")
    target = getattr(args, "target", None)
    if target and (target.startswith((".", "/", "~")) or target.endswith(".gguf")) and not Path(target).expanduser(
            ).exists():
        kind = "GGUF file" if target.endswith(".gguf") else "target folder"
        problems.append(f"{kind} not found: {target}")
    cost = getattr(args, "cost_table", None)
    if cost and not Path(cost).expanduser().is_file():
        problems.append(f"--cost-table {cost}: no such file")
    scheduler = getattr(args, "scheduler", None)
    if drafter in ("none", "prompt-lookup") and scheduler in ("threshold", "algorithm1", "async"):
        problems.append(f"note: --scheduler {scheduler} needs a drafter with a confidence head; {drafter} drafts "
                        "without one, so its drafts run at fixed γ")
    if getattr(args, "no_tile_attention", False) and not getattr(args, "inexact", False):
        problems.append("note: --no-tile-attention changes nothing without --inexact (exact forwards never attend on "
                        "the tiles)")
    return problems
