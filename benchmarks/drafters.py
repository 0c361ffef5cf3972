"""Trained drafters on the default target: acceptance length τ per eval set at temperature 0 and 1, position-wise
conditional acceptance, and single-request speed against plain decoding (and llama.cpp where installed).

    python benchmarks/drafters.py --drafters dspark=src/dspark/drafters/smollm2-135m-dspark,dflash=PATH,eagle3=PATH,mtp=PATH
    python benchmarks/drafters.py --quick --drafters dspark=PATH      # smoke test

(a) τ = (accepted drafts + 1) per verify cycle, per eval set (first --prompts rows; MT-Bench rows answer both
    turns, the second after the first answer), --max-new-tokens each, every draft verified (fixed γ). Requests
    run batched (--batch at once): τ does not depend on the batch, up to bf16 rounding.
(b) position-wise conditional acceptance: P(x_k accepted | x_1..x_{k-1} accepted and x_k verified), k = 1..γ.
(c) single-request tokens/s on the --speed-sets prompts, greedy, up to --max-new-tokens tokens, ending at the
    end-of-sequence token as `dspark generate` does (--speed-past-eos: exactly that many, the model's text past its
    answer included), every system interleaved prompt by prompt: plain decoding, each drafter at fixed γ, DSpark
    under the async scheduler (the default for batches: it skips the drafter where no budget pays for it), prompt
    lookup (`--drafter prompt-lookup`, no trained drafter), lookups first and DSpark where none finds a draft
    ("lookup+dspark": what `dspark generate` runs by default, one stream: prompt lookup of a long repeat, up to 2γ
    drafts, of 3- and 2-grams, the drafter folder's datastore of the target's answers, prompt lookup of 1-grams),
    llama.cpp; tokens/s over all the prompts and per set.
    Headline: dspark_vs_plain_bs1 is that default's speed-up (dspark_vs_plain_bs1_SET per set);
    dspark_fixed_vs_plain_bs1 DSpark alone at fixed γ.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (DEFAULT_DATA_DIR, add_presets, apply_presets, finish, RESULTS_DIR, Log, markdown_table, Partial,  # noqa: E402
                               result_header, result_preamble, run_interleaved)
from benchmarks.peers import DsparkPeer, LlamaCppPeer, llama_cpp_problem  # noqa: E402
from dspark.config import DTYPE_CHOICES  # noqa: E402
from dspark import LLM, SamplingParams  # noqa: E402
from dspark.schedule import FixedLength  # noqa: E402
from dspark.target.loading import bundled_gguf  # noqa: E402

FULL = {"sets": "gsm8k,math500,humaneval,mbpp,mt-bench", "prompts": 50, "max_new_tokens": 256, "temperatures": "0,1",
        "speed_sets": "gsm8k,humaneval", "speed_prompts": 25, "batch": 50}
QUICK = {"sets": "gsm8k,mt-bench", "prompts": 2, "max_new_tokens": 12, "temperatures": "0,1",
         "speed_sets": "gsm8k", "speed_prompts": 1, "batch": 4}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--drafters", required=True, help="comma-separated name=folder pairs (names as in the table: "
                   "dspark, dflash, eagle3, mtp)")
    add_presets(p, FULL, QUICK)
    p.add_argument("--dtype", default="bf16", choices=DTYPE_CHOICES, help="target weights for (c) [%(default)s]")
    p.add_argument("--tau-dtype", choices=DTYPE_CHOICES, help="target weights for (a) and (b) [--dtype]: acceptance "
                   "depends on the dtype only through rounding, and on a CPU without a bf16 matrix unit the batched "
                   "verification of (a) runs several times faster in fp32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    p.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out even where installed")
    p.add_argument("--speed-past-eos", action="store_true", help="(c) makes exactly --max-new-tokens tokens per prompt, "
                   "past the end-of-sequence token (the model's text after its answer, often repeating itself, which "
                   "favours prompt lookup)")
    p.add_argument("--out", default=str(RESULTS_DIR / "drafters"))
    p.add_argument("--resume", action="store_true", help="reuse the rows of an interrupted run with the same "
                   "settings (kept in OUT.partial.json after each eval set)")
    args = apply_presets(p.parse_args(argv), FULL, QUICK)
    args.drafter_dirs = dict(pair.split("=", 1) for pair in args.drafters.split(","))
    return args


def eval_rows(data_dir: str, name: str, n: int) -> list[list[str]]:
    path = Path(data_dir) / f"eval_{name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"eval set not found: {path} (pass --data-dir)")
    rows = [json.loads(line)["turns"] for line in path.read_text().splitlines() if line.strip()]
    if len(rows) < n:
        raise ValueError(f"{path} has {len(rows)} rows, {n} asked")
    return rows[:n]


def position_acceptance(stats, gamma: int) -> list[float | None]:
    """P(x_k accepted | x_1..x_{k-1} accepted, x_k verified) for k = 1..γ over the steps' requests."""
    reached, passed = [0] * gamma, [0] * gamma
    for st in stats:
        for verified, accepted in zip(st.verified, st.accepted):
            for k in range(1, min(verified, accepted + 1) + 1):
                reached[k - 1] += 1
                passed[k - 1] += accepted >= k
    return [p / r if r else None for p, r in zip(passed, reached)]


def run_set(llm: LLM, rows: list[list[str]], temperature: float, n: int, batch: int) -> tuple[list, list]:
    """Answer every row (all its turns), batched; (outputs, step stats)."""
    engine = llm.engine
    engine.stats.clear()
    engine.config.max_num_seqs = batch
    conversations = [[] for _ in rows]
    outputs = []
    for turn in range(max(len(r) for r in rows)):
        live = [i for i, r in enumerate(rows) if turn < len(r)]
        for i in live:
            conversations[i].append({"role": "user", "content": rows[i][turn]})
        params = [SamplingParams(temperature=temperature, max_tokens=n, seed=1000 * turn + i) for i in live]
        outs = llm.generate([llm.chat_prompt(conversations[i]) for i in live], params)
        for i, out in zip(live, outs):
            conversations[i].append({"role": "assistant", "content": out.text})
        outputs += outs
    return outputs, list(engine.stats)


def acceptance_rows(llms: dict[str, LLM], args, log, partial: Partial) -> list[dict]:
    rows = []
    for name, llm in llms.items():
        gamma = llm.engine.drafter.gamma
        for temperature in [float(t) for t in args.temperatures.split(",")]:
            for set_name in args.sets.split(","):
                if done := partial.find(section="acceptance", drafter=name, temperature=temperature, set=set_name):
                    rows.append(done)
                    log(f"{name} T={temperature} {set_name}: τ {done['tau']:.2f} (from {partial.path.name})")
                    continue
                outs, stats = run_set(llm, eval_rows(args.data_dir, set_name, args.prompts), temperature,
                                      args.max_new_tokens, args.batch)
                errors = [o.error for o in outs if o.finish_reason == "error"]
                if errors:
                    raise RuntimeError(f"{name} failed on {set_name}: {errors[0]}")
                cycles = sum(st.num_requests for st in stats)
                tokens = sum(st.tokens for st in stats)
                pos = position_acceptance(stats, gamma)
                rows.append({"section": "acceptance", "drafter": name, "temperature": temperature, "set": set_name,
                             "requests": len(outs), "cycles": cycles, "tau": tokens / max(cycles, 1),
                             "position_accept": pos, "gamma": gamma})
                partial.add(rows[-1])
                log(f"{name} T={temperature} {set_name}: τ {rows[-1]['tau']:.2f} positions "
                    f"{[round(x, 2) if x is not None else None for x in pos]}")
    return rows


def speed_rows(llms: dict[str, LLM], plain: LLM, args, log, partial: Partial) -> list[dict]:
    if "dspark" in llms:  # the default for batches: DSpark under the asynchronous scheduler
        llms = llms | {"dspark-async": plain.sibling(args.drafter_dirs["dspark"], "async", gamma=7, max_num_seqs=1)}
    llms = llms | {"prompt-lookup": plain.sibling("prompt-lookup", gamma=7, max_num_seqs=1)}
    if "dspark" in args.drafter_dirs:  # prompt lookup where the context repeats itself, DSpark elsewhere
        llms = llms | {"lookup+dspark": plain.sibling("lookup+" + args.drafter_dirs["dspark"], gamma=7, max_num_seqs=1)}
    stop_at_eos = not args.speed_past_eos
    problem = None if args.no_llama_cpp else llama_cpp_problem()
    if problem:
        log(f"speed: llama.cpp left out: {problem}")
    with_llama_cpp = not args.no_llama_cpp and not problem
    names = ["plain", *llms] + (["llama.cpp"] if with_llama_cpp else [])
    if done := partial.group("system", names, section="speed"):
        log(f"speed: {len(done)} systems from {partial.path.name}")
        return done
    sets = args.speed_sets.split(",")
    prompts = {s: [[plain.chat_prompt(t[0])] for t in eval_rows(args.data_dir, s, args.speed_prompts)] for s in sets}
    peers = [DsparkPeer(llm, name, stop_at_eos) for name, llm in {"plain": plain, **llms}.items()]
    if with_llama_cpp:
        peers.append(LlamaCppPeer(bundled_gguf(), args.threads, n_ctx=4096, stop_at_eos=stop_at_eos))
    for peer in peers:  # warm-up
        peer.generate(prompts[sets[0]][0], 8)
    for peer in peers:
        if isinstance(peer, DsparkPeer):
            peer.llm.engine.config.max_num_seqs = 1
            peer.history.clear()
    by_set, rotation = {}, 0
    for s in sets:  # one interleaved run over all the prompts, timed per set
        starts = {peer.name: len(getattr(peer, "history", [])) for peer in peers}
        timed = run_interleaved(peers, prompts[s], args.max_new_tokens, rotation=rotation)
        rotation += len(prompts[s])
        by_set[s] = {peer.name: speed_figures(*timed[peer.name], getattr(peer, "history", [])[starts[peer.name]:])
                     for peer in peers}
    rows = []
    for peer in peers:
        row = {"section": "speed", "system": peer.name}
        row |= speed_figures(sum((by_set[s][peer.name]["outs"] for s in sets), []),
                             sum(by_set[s][peer.name]["seconds"] for s in sets), getattr(peer, "history", []))
        for s in sets:
            row |= {f"{s}_{k}": v for k, v in by_set[s][peer.name].items() if k in ("tokens_per_s", "tau")}
        del row["outs"]
        rows.append(row)
        log(f"speed {peer.name}: {row['tokens_per_s']:.1f} tok/s")
    for row in rows:
        for key in ("", *(f"{s}_" for s in sets)):
            row[key + "vs_plain"] = row[key + "tokens_per_s"] / rows[0][key + "tokens_per_s"]
        partial.add(row)
    return rows


def speed_figures(outs: list[list[int]], seconds: float, history: list) -> dict:
    """Requests, mean new tokens, seconds, tokens/s, and τ where the peer keeps its RequestOutputs."""
    tokens = sum(len(o) for o in outs)
    figures = {"outs": outs, "requests": len(outs), "new_tokens": tokens / len(outs), "seconds": seconds,
               "tokens_per_s": tokens / seconds}
    if history:
        figures["tau"] = sum(len(o.token_ids) - 1 for o in history) / max(sum(o.steps for o in history), 1)
    return figures


def macro_tau(rows, drafter: str, temperature: float) -> float | None:
    taus = [r["tau"] for r in rows if r.get("drafter") == drafter and r["temperature"] == temperature]
    return statistics.mean(taus) if taus else None


def headline(rows: list[dict]) -> dict:
    h = {}
    for t in sorted({r["temperature"] for r in rows if r["section"] == "acceptance"}):
        suffix = "" if t == 1.0 else f"_t{t:g}"
        d = macro_tau(rows, "dspark", t)
        for other in ("dflash", "eagle3", "mtp"):
            o = macro_tau(rows, other, t)
            if d and o:
                h[f"tau_dspark_over_{other}{suffix}"] = d / o
    speed = {r["system"]: r for r in rows if r["section"] == "speed"}
    if "lookup+dspark" in speed:  # the default of `dspark generate`
        h["dspark_vs_plain_bs1"] = speed["lookup+dspark"]["vs_plain"]
        h |= {f"dspark_vs_plain_bs1_{key.removesuffix('_vs_plain')}": value  # per speed set
              for key, value in speed["lookup+dspark"].items() if key.endswith("_vs_plain")}
        if "llama.cpp" in speed:
            h["dspark_vs_llamacpp_bs1"] = speed["lookup+dspark"]["tokens_per_s"] / speed["llama.cpp"]["tokens_per_s"]
    others = (("dspark", "dspark_fixed"), ("dspark-async", "dspark_async"), ("prompt-lookup", "prompt_lookup"))
    for name, figure in others:
        if name in speed:
            h[f"{figure}_vs_plain_bs1"] = speed[name]["vs_plain"]
    return h


def plot_positions(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rows if r["section"] == "acceptance"})
    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 3.5), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for drafter in dict.fromkeys(r["drafter"] for r in rows if r["section"] == "acceptance"):
            sel = [r for r in rows if r.get("drafter") == drafter and r["temperature"] == t]
            gamma = sel[0]["gamma"]
            mean = [statistics.mean([r["position_accept"][k] for r in sel if r["position_accept"][k] is not None] or [0])
                    for k in range(gamma)]
            ax.plot(range(1, gamma + 1), mean, "o-", label=drafter)
        ax.set_title(f"temperature {t:g}: conditional acceptance (mean over sets)", fontsize=9)
        ax.set_xlabel("draft position k")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(result: dict) -> str:
    rows = result["rows"]
    acc = [r for r in rows if r["section"] == "acceptance"]
    sets = list(dict.fromkeys(r["set"] for r in acc))
    table = []
    for t in sorted({r["temperature"] for r in acc}):
        for drafter in dict.fromkeys(r["drafter"] for r in acc):
            row = {"T": t, "drafter": drafter}
            row.update({s: r["tau"] for r in acc for s in [r["set"]] if r["drafter"] == drafter and r["temperature"] == t})
            row["mean"] = macro_tau(acc, drafter, t)
            table.append(row)
    pos = []
    for r in acc:
        if r["temperature"] == 1.0:
            pos.append({"drafter": r["drafter"], "set": r["set"],
                        **{f"k={k + 1}": x for k, x in enumerate(r["position_accept"])}})
    speed = [r for r in rows if r["section"] == "speed"]
    gamma = max((r["gamma"] for r in acc), default=0)
    return "\n".join([
        result_preamble(result),
        "## Acceptance length τ (accepted drafts + 1 per verify cycle)\n",
        markdown_table(table, ["T", "drafter", *sets, "mean"]),
        "\n## Conditional acceptance by position, temperature 1\n",
        markdown_table(pos, ["drafter", "set", *[f"k={k + 1}" for k in range(gamma)]]),
        "\n## Single request, greedy, tokens/s\n",
        "Exactly new_tokens per prompt, past the end of the answer." if result["settings"].get("speed_past_eos") else
        "Each answer ends at its end-of-sequence token; new_tokens is the mean per prompt.",
        " dspark, dflash, eagle3, mtp: every draft verified (fixed γ); dspark-async: DSpark under the async scheduler"
        " (the default for batches); lookup+dspark: lookups first (prompt lookup of long repeats up to 2γ, of 3- and"
        " 2-grams, the datastore of the target's answers, prompt lookup of 1-grams), DSpark where none finds a draft"
        " (the default of `dspark generate`).\n",
        markdown_table(speed, ["system", "requests", "new_tokens", "tokens_per_s", "vs_plain", "tau"]),
        "\nThe same run by prompt set:\n",
        markdown_table(speed_by_set(speed, result["settings"]["speed_sets"].split(",")),
                       ["system", "set", "tokens_per_s", "vs_plain", "tau"]),
        "\n## Headline\n",
        markdown_table([{"figure": k, "value": v} for k, v in result["headline"].items()], ["figure", "value"]),
        "\n![position-wise acceptance](drafters_positions.png)",
    ])


def speed_by_set(speed: list[dict], sets: list[str]) -> list[dict]:
    """The speed rows split per prompt set (rows written before the split have none)."""
    figures = ("tokens_per_s", "vs_plain", "tau")
    return [{"system": r["system"], "set": s, **{k: r.get(f"{s}_{k}") for k in figures}}
            for r in speed for s in sets if f"{s}_vs_plain" in r]


def drafter_llms(plain: LLM, folders: dict[str, str]) -> dict[str, LLM]:
    """One engine per drafter on plain's target weights, verifying every draft (fixed γ = the drafter's own)."""
    llms = {name: plain.sibling(folder, gamma=7) for name, folder in folders.items()}
    for llm in llms.values():
        llm.engine.scheduler = FixedLength(llm.engine.drafter.gamma)
    return llms


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    log = Log()
    plain = LLM(drafter="none", dtype=args.dtype, max_num_seqs=args.batch)
    tau_plain = plain if args.tau_dtype in (None, args.dtype) else LLM(drafter="none", dtype=args.tau_dtype,
                                                                        max_num_seqs=args.batch)
    result = result_header("drafters", __file__, argv)
    result["settings"] = {k: getattr(args, k) for k in (*FULL, "dtype", "tau_dtype", "speed_past_eos")} | {
        "drafters": args.drafter_dirs}
    partial = Partial(args.out, result, args.resume)
    rows = acceptance_rows(drafter_llms(tau_plain, args.drafter_dirs), args, log, partial)
    rows += speed_rows(drafter_llms(plain, args.drafter_dirs), plain, args, log, partial)
    result["rows"], result["headline"] = rows, headline(rows)
    code = finish(result, args.out, markdown, {"positions": lambda path: plot_positions(rows, path)}, log)
    partial.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
