"""The answers the shipped drafters were trained on, kept so that every drafter trains on exactly the same data.

`dspark regenerate` draws answers at temperature 0.8 from the target; a second run draws other answers (and in
bf16 even the same seed can move a token), and its hour of CPU time is better spent training. So the answers of
one regeneration are committed here, without the prompts: those come back from the same seeded draw of prompt
pools (`dspark regenerate`'s prompt mix) and the target's chat template, and a hash of each prompt's token ids
checks that they are the same prompts.

    python drafters/training_answers.py pack --data train.jsonl                   # -> drafters/training_answers.npz
    python drafters/training_answers.py unpack --out train.jsonl [--data-dir ../shared/data]
    python drafters/training_answers.py datastore --out ../src/dspark/drafters/smollm2-135m-dspark/datastore.npz

The bundled datastore also holds two regenerations of code prompts only (`dspark regenerate --mix code=1
--num-prompts 1254 --max-prompt-tokens 1024 --seed 1`, then `--seed 2`), packed as code_answers_seed1.npz and
code_answers_seed2.npz (`pack --mix code=1 --num-prompts 1254`; see README.md):

    python drafters/training_answers.py datastore --answers drafters/training_answers.npz \
        drafters/code_answers_seed1.npz drafters/code_answers_seed2.npz \
        --out src/dspark/drafters/smollm2-135m-dspark/datastore.npz
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

DEFAULT = Path(__file__).resolve().parent / "training_answers.npz"


def prompt_hash(prompt_ids: list[int]) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps(prompt_ids).encode()).digest()[:8], "little") >> 1


def pack(data: Path, out: Path, num_prompts: int, mix: str | None = None):
    """Answers of a regenerated JSONL (file order kept: the trainer holds out the last records) into one .npz."""
    records = [json.loads(line) for line in data.read_text(encoding="utf-8").split("\n") if line.strip()]  # not splitlines: answers hold U+2028
    meta = json.loads(data.with_name(data.name + ".meta.json").read_text())
    answers = [r["answer_ids"] for r in records]
    if max(max(a, default=0) for a in answers) >= 2 ** 16:
        raise ValueError("token ids above 65535 do not fit uint16")
    np.savez_compressed(
        out, ids=np.array([r["id"] for r in records]), finish=np.array([r["finish_reason"] for r in records]),
        prompt_hash=np.array([prompt_hash(r["prompt_ids"]) for r in records], dtype=np.int64),
        lengths=np.array([len(a) for a in answers], dtype=np.int32),
        tokens=np.array([t for a in answers for t in a], dtype=np.uint16),
        meta=np.array(json.dumps({**meta, "num_prompts": num_prompts, **({"mix": mix} if mix else {})})))
    print(f"{len(records)} answers ({sum(map(len, answers))} tokens) -> {out} ({out.stat().st_size / 1e6:.1f} MB)")


def unpack(answers: Path, out: Path, data_dir: str | None):
    """The regenerated JSONL back: prompts redrawn with the packed seed, answers from the file."""
    from dspark import LLM
    from dspark.train.prompts import build_prompts, load_pools, parse_mix
    from dspark.train.regenerate import record_line

    z = np.load(answers)
    meta = json.loads(str(z["meta"]))
    prompts = {r["id"]: r for r in build_prompts(meta["num_prompts"], seed=meta["seed"], pools=load_pools(data_dir),
                                                 mix=parse_mix(meta.get("mix")))}
    llm = LLM(max_num_seqs=1)
    ends = np.cumsum(z["lengths"])
    lines = []
    for i, (rid, finish) in enumerate(zip(z["ids"].tolist(), z["finish"].tolist())):
        if rid not in prompts:
            raise ValueError(f"prompt {rid} is not in today's draw of {meta['num_prompts']} prompts (seed "
                             f"{meta['seed']}): the prompt pools differ from the packed run's")
        ids = llm.chat_prompt(prompts[rid]["messages"])
        if prompt_hash(ids) != int(z["prompt_hash"][i]):
            raise ValueError(f"prompt {rid} tokenizes differently from the packed run's (another data dir, "
                             f"package version or chat template?)")
        answer = z["tokens"][ends[i] - z["lengths"][i]:ends[i]].tolist()
        done = argparse.Namespace(token_ids=answer, finish_reason=finish, text=llm.tokenizer.decode(answer, skip_special_tokens=True))
        lines.append(record_line(prompts[rid], ids, done))
    out.write_text("".join(lines), encoding="utf-8")
    out.with_name(out.name + ".meta.json").write_text(
        json.dumps({k: v for k, v in meta.items() if k not in ("num_prompts", "mix")}, indent=1) + "\n")
    print(f"{len(lines)} records -> {out}")


def datastore(answers: list[Path], out: Path):
    """The answers' tokens alone, of every answers file in turn, for retrieval drafts (src/dspark/draft/datastore.py)
    beside a drafter."""
    files = [np.load(a) for a in answers]
    tokens, lengths = (np.concatenate([z[k] for z in files]) for k in ("tokens", "lengths"))
    np.savez_compressed(out, tokens=tokens, lengths=lengths)
    print(f"{len(lengths)} answers ({len(tokens)} tokens) -> {out} ({out.stat().st_size / 1e6:.1f} MB)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n")[-1], formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="regenerated JSONL -> answers file")
    a.add_argument("--data", type=Path, required=True, help="regenerated JSONL (FILE.meta.json beside it)")
    a.add_argument("--num-prompts", type=int, required=True, help="--num-prompts of the dspark regenerate run")
    a.add_argument("--mix", default=None, help="--mix of the dspark regenerate run, if it had one (unpack draws the "
                   "same prompts with it)")
    a.add_argument("--out", type=Path, default=DEFAULT, help="answers file [%(default)s]")
    b = sub.add_parser("unpack", help="answers file -> regenerated JSONL")
    b.add_argument("--answers", type=Path, default=DEFAULT, help="answers file [%(default)s]")
    b.add_argument("--out", type=Path, required=True, help="regenerated JSONL to write")
    b.add_argument("--data-dir", default=None, help="folder with gsm8k_train.jsonl and the eval sets "
                   "[$DSPARK_DATA, else ../shared/data]")
    c = sub.add_parser("datastore", help="answers file -> a drafter's datastore.npz (retrieval drafts)")
    c.add_argument("--answers", type=Path, nargs="+", default=[DEFAULT], help="answers files [%(default)s]")
    c.add_argument("--out", type=Path, required=True, help="datastore.npz to write (in a drafter folder)")
    args = p.parse_args(argv)
    if args.cmd == "pack":
        pack(args.data, args.out, args.num_prompts, args.mix)
    elif args.cmd == "datastore":
        datastore(args.answers, args.out)
    else:
        unpack(args.answers, args.out, args.data_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
