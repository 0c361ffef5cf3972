"""Regenerate training answers with the target itself, through the engine: batched, resumable, seeded.

Each prompt record ({"id", "domain", "messages"}, see prompts.py) is put under the target's chat template
and answered with its own sampling seed (a hash of the global seed and the record id), so an answer does
not depend on which other requests shared its batches — exactly so in float32; in bfloat16 the batch
shape can move logits by a rounding step and so, rarely, a sampled token.

The output is JSONL, one line per finished answer, written as requests finish:
    {"id", "domain", "prompt_ids", "answer_ids", "finish_reason", "prompt", "answer"}
prompt_ids are the templated prompt, answer_ids the sampled tokens (ending with the end-of-turn token when
finish_reason is "stop"); prompt and answer are the texts, for people. Each step's finished lines are
appended, flushed and fsynced, so a kill loses only the requests in flight. On start the existing lines'
ids are skipped (a torn last line from a kill is cut off first), and the settings that shape answers are
checked against the sidecar FILE.meta.json, so one file never mixes two sampling set-ups.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from ..sampling import SamplingParams

WRITTEN_REASONS = ("stop", "length")  # others ("error", "abort") are not written: a rerun retries them


@dataclass
class RegenSettings:
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 0
    max_tokens: int = 384
    seed: int = 0
    max_prompt_tokens: int = 1024  # longer templated prompts are skipped

    def sampling(self, record_id: str) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=self.max_tokens, seed=record_seed(record_id, self.seed))


@dataclass
class RegenSummary:
    written: int = 0  # new records this run
    already_done: int = 0  # skipped: in the file before this run
    skipped_long: int = 0  # prompts over max_prompt_tokens
    failed: int = 0  # finished with an error (retried on the next run)
    answer_tokens: int = 0  # tokens sampled this run, written or not
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.answer_tokens / self.seconds if self.seconds else 0.0


def record_seed(record_id: str, seed: int) -> int:
    """The sampling seed of one record: a 63-bit hash of (global seed, record id)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{record_id}".encode()).digest()[:8], "little") >> 1


def read_done(path: Path) -> set[str]:
    """Ids already in the output file; a torn last line (a kill in mid-write) is cut off."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
        say(f"regenerate: {path} ended in a torn record ({len(data) - end} bytes, left by a kill): cut off, its prompt "
            "is answered again")
    done = set()
    for n, line in enumerate(data[:end].splitlines(), 1):
        if line.strip():
            try:
                done.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError) as exc:
                raise ValueError(f"{path}:{n} is not a regenerated record ({exc}); use a new output file") from exc
    return done


def check_meta(path: Path, meta: dict):
    """Write the settings beside the output, or check that they match the ones there."""
    meta_path = path.with_name(path.name + ".meta.json")
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        same = (lambda k, a, b: Path(str(a)).name == Path(str(b)).name if k == "target" else a == b)  # any cache folder
        diff = {k: (old.get(k), v) for k, v in meta.items() if not same(k, old.get(k), v)}
        if diff:
            changes = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in diff.items())
            raise ValueError(f"{path} was made with other settings ({changes}); resume with the same settings "
                             f"or write to a new file")
    else:
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")


def regenerate(llm, records: list[dict], out: Path | str, settings: RegenSettings | None = None, *,
               log_every: int = 100, limit: int | None = None, progress: bool = True) -> RegenSummary:
    """Answer every record not yet in `out` with `llm` (a dspark.LLM) and append the results.

    limit: stop once this many new records are written (the requests in flight are dropped, as by a kill).
    Keeps up to llm.config.max_num_seqs requests decoding and as many waiting.
    """
    settings, out = settings or RegenSettings(), Path(out)
    if len({r["id"] for r in records}) != len(records):
        raise ValueError("record ids must be unique")
    if llm.engine.has_unfinished():
        raise ValueError("the engine is busy with other requests; regenerate needs it to itself")
    out.parent.mkdir(parents=True, exist_ok=True)
    check_meta(out, {**asdict(settings), "target": str(llm.target_path), "dtype": llm.config.dtype})
    done = read_done(out)
    todo = [r for r in records if r["id"] not in done]
    summary = RegenSummary(already_done=len(records) - len(todo))
    engine, queue, in_flight = llm.engine, iter(todo), {}
    bar = tqdm(total=len(todo), unit="rec", desc="regenerate", disable=True if not progress else None, file=sys.stderr)
    start = time.perf_counter()
    sampled: dict[str, int] = {}

    def top_up():
        while len(engine.waiting) < llm.config.max_num_seqs:
            record = next(queue, None)
            if record is None:
                return
            ids = llm.chat_prompt(record["messages"])
            if len(ids) > settings.max_prompt_tokens:
                summary.skipped_long += 1
                continue
            engine.add_request(ids, settings.sampling(record["id"]), request_id=record["id"])
            in_flight[record["id"]] = (record, ids)

    try:
        with open(out, "a", encoding="utf-8") as f:
            top_up()
            while in_flight and (limit is None or summary.written < limit):
                lines = []
                for o in engine.step():
                    summary.answer_tokens += len(o.token_ids) - sampled.get(o.request_id, 0)
                    sampled[o.request_id] = len(o.token_ids)
                    if not o.finished:
                        continue
                    record, ids = in_flight.pop(o.request_id)
                    sampled.pop(o.request_id)
                    if o.finish_reason not in WRITTEN_REASONS:
                        summary.failed += 1
                        say(f"regenerate: {o.request_id} failed ({o.finish_reason}: {o.error}); a rerun retries it")
                        continue
                    lines.append(record_line(record, ids, o))
                if lines:
                    f.writelines(lines)
                    f.flush()
                    os.fsync(f.fileno())
                    before, summary.written = summary.written, summary.written + len(lines)
                    if log_every and before // log_every != summary.written // log_every:
                        say(progress_line(summary, start, len(todo)))
                top_up()
                bar.set_postfix_str(f"{summary.answer_tokens / (time.perf_counter() - start):.0f} tok/s", refresh=False)
                bar.update(summary.written + summary.failed + summary.skipped_long - bar.n)
    finally:
        for request_id in list(in_flight):  # a limit or an error: leave the engine empty for its next user
            engine.abort(request_id)
        bar.close()
        summary.seconds = time.perf_counter() - start
    return summary


def record_line(record: dict, prompt_ids: list[int], out) -> str:
    """One output line: token ids for training, texts for people."""
    return json.dumps({"id": record["id"], "domain": record["domain"], "prompt_ids": prompt_ids,
                       "answer_ids": out.token_ids, "finish_reason": out.finish_reason,
                       "prompt": record["messages"][-1]["content"], "answer": out.text}, ensure_ascii=False) + "\n"


def say(message: str):
    tqdm.write(message, file=sys.stderr)


def progress_line(summary: RegenSummary, start: float, total: int) -> str:
    elapsed = time.perf_counter() - start
    return (f"regenerate: {summary.written}/{total} records in {elapsed:.0f} s, "
            f"{summary.answer_tokens / elapsed:.1f} answer tok/s, {summary.failed} failed, "
            f"{summary.skipped_long} prompts too long")
