"""Shared pieces of the benchmark scripts: where things are, what machine and commit ran, the eval prompts,
timing summaries, and writing a result as JSON plus a markdown table (see docs/benchmarks.md)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# first user turns, taken round-robin from these eval sets (math, code, chat)
DEFAULT_PROMPT_SETS = ("gsm8k", "humaneval", "mt-bench")


def git_commit() -> tuple[str, bool]:
    """(short HEAD, whether the work tree has uncommitted changes outside benchmarks/results, which runs write);
    ("unknown", False) outside git."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no", "--",
                                                             ".", ":(exclude)benchmarks/results"))
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """The machine block of a result; call after torch.set_num_threads."""
    import torch
    import transformers

    from dspark.kernels.upcast import cpu_bf16_unit

    return {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "bf16_matrix_unit": cpu_bf16_unit(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


def command_line(script: str | Path, argv: list[str]) -> str:
    """How to re-run this result, from the repo root."""
    path = Path(script).resolve()
    shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    return shlex.join(["python", str(shown), *argv])


def load_prompts(data_dir: str | Path, n: int, sets: tuple[str, ...] = DEFAULT_PROMPT_SETS) -> list[dict]:
    """n first user turns, deterministic: row 0 of each set in turn, then row 1, ... .

    Returns [{"set": name, "index": row, "text": first turn}].
    """
    data_dir = Path(data_dir)
    rows = {}
    for name in sets:
        path = data_dir / f"eval_{name}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"eval set not found: {path} (pass --data-dir, default ../shared/data)")
        rows[name] = [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]
    prompts = []
    for i in range(max(len(r) for r in rows.values())):
        for name in sets:
            if i < len(rows[name]):
                prompts.append({"set": name, "index": i, "text": rows[name][i]})
            if len(prompts) == n:
                return prompts
    raise ValueError(f"asked for {n} prompts, the eval sets hold only {len(prompts)}")


def cycle(items: list, n: int) -> list:
    """The first n items of items repeated."""
    return [items[i % len(items)] for i in range(n)]


def spread(values: list[float]) -> dict:
    """Median and range of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def timed(fn, *args, **kwargs):
    """(result, seconds) of one call."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def result_header(benchmark: str, script: str | Path, argv: list[str]) -> dict:
    commit, dirty = git_commit()
    return {"benchmark": benchmark, "command": command_line(script, argv), "commit": commit,
            "commit_dirty": dirty,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": machine_info()}


def fmt(v) -> str:
    """A number for a table: 3 significant digits below 10, then 1 decimal, then none from 100."""
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"
    return "" if v is None else str(v)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """A markdown table of the given columns (missing cells blank; floats rounded by fmt)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def result_preamble(result: dict) -> str:
    """The first lines of a result's markdown: title, command, commit, machine."""
    m = result["machine"]
    dirty = " (uncommitted changes)" if result.get("commit_dirty") else ""
    resumed = result.get("resumed_rows_from_commits")
    dirty += f" (resumed: rows measured at {', '.join(resumed)})" if resumed else ""
    return (f"# {result['benchmark']}\n\n`{result['command']}`\n\ncommit {result['commit']}{dirty}, {result['date']}; "
            f"{m['cpu']} (bf16 matrix unit: {m.get('bf16_matrix_unit', 'not recorded')}), {m['threads']} threads, torch {m['torch']}, transformers {m['transformers']}\n")


def write_result(out: str | Path, result: dict, markdown: str) -> tuple[Path, Path]:
    """Write out.json and out.md (out without suffix); returns both paths."""
    base = Path(out)
    if base.suffix in (".json", ".md"):
        base = base.with_suffix("")
    base.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = base.with_suffix(".json"), base.with_suffix(".md")
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    md_path.write_text(markdown.rstrip() + "\n")
    return json_path, md_path


class Log:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self, message: str):
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {message}", flush=True)


def run_interleaved(peers: list, batches: list[list[list[int]]], n: int, rotation: int) -> dict:
    """Each batch through every peer in turn (the order rotates per batch and per repeat, so drifts in
    machine load spread evenly). Returns {name: (outputs, seconds)} summed over the batches."""
    result = {p.name: ([], 0.0) for p in peers}
    for i, batch in enumerate(batches):
        k = (rotation + i) % len(peers)
        for peer in peers[k:] + peers[:k]:
            outs, seconds = timed(peer.generate, batch, n)
            prev_outs, prev_seconds = result[peer.name]
            result[peer.name] = (prev_outs + outs, prev_seconds + seconds)
    return result


def add_presets(parser, full: dict, quick: dict) -> None:
    """--quick plus one option per preset key, its full and quick defaults in the help."""
    parser.add_argument("--quick", action="store_true", help="tiny settings for a smoke test")
    for key, value in full.items():
        parser.add_argument("--" + key.replace("_", "-"), type=type(value), default=None,
                            help=f"[{value}; quick {quick[key]}]")


def apply_presets(args, full: dict, quick: dict):
    """Fill the preset options the command line left unset."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def finish(result: dict, out: str | Path, markdown_fn, plots: dict, log) -> int:
    """Write the plots ({suffix: fn(path)}), out.json and out.md; log where they went."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, plot in plots.items():
        plot(out.parent / f"{out.name}_{suffix}.png")
    json_path, md_path = write_result(out, result, markdown_fn(result))
    log(f"wrote {json_path} and {md_path}; headline {result.get('headline')}")
    return 0


class Partial:
    """The rows finished so far, kept in OUT.partial.json after each one, so a killed run resumes where it stopped
    (--resume): rows are reused only when the settings are the same; each row records the commit that measured it
    ("-dirty" when the work tree had changes). A partial file is never overwritten by a run without --resume.
    `close` removes the file once the whole result is written."""

    def __init__(self, out: str | Path, result: dict, resume: bool):
        base = Path(out)
        base = base.with_suffix("") if base.suffix in (".json", ".md") else base  # as write_result names files
        self.path = base.with_name(base.name + ".partial.json")
        self.settings, self.rows = result["settings"], []
        self.commit = result["commit"] + ("-dirty" if result.get("commit_dirty") else "")
        if self.path.is_file():
            if not resume:
                raise SystemExit(f"{self.path} holds the rows of an interrupted run: add --resume to go on from "
                                 "them, or delete it to start afresh")
            saved = json.loads(self.path.read_text())
            if saved["settings"] != self.settings:
                raise SystemExit(f"{self.path} was written with other settings; delete it or run with those settings")
            self.rows = saved["rows"]
        self.commits = sorted({r["commit"] for r in self.rows})
        if self.commits:
            result["resumed_rows_from_commits"] = self.commits

    def find(self, **key) -> dict | None:
        return next((r for r in self.rows if all(r.get(k) == v for k, v in key.items())), None)

    def group(self, field: str, values: list, **key) -> list[dict] | None:
        """The rows matching key with field = each of values, in that order, when all are there; otherwise None,
        and the group's partial rows are forgotten (it is measured again as a whole)."""
        done = [self.find(**key, **{field: v}) for v in values]
        if all(done):
            return done
        self.rows = [r for r in self.rows if not all(r.get(k) == v for k, v in key.items())]
        return None

    def add(self, row: dict):
        row["commit"] = self.commit
        self.rows.append(row)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"settings": self.settings, "rows": self.rows}, indent=1))
        tmp.replace(self.path)

    def close(self):
        self.path.unlink(missing_ok=True)
