"""A bounded load test of `dspark serve` on loopback: --clients concurrent clients send --requests requests
(chat, mixed streaming and not), greedy, to a `dspark serve` process; then --drops streaming clients leave
mid-answer. The requests go through the offline engine too, at the same concurrency (throughput) and each alone
(the reference answer: the numerics contract makes batching change nothing, in bf16 as in float32). Checks: no
response lost or corrupted, every greedy answer equal to the one the request gets alone, the KV cache back to its
idle level within a second of the drops, the server idle afterwards and exiting 0 on SIGTERM; reports latency
percentiles, the server's resident memory before and after, tokens/s and server over offline throughput.

    python benchmarks/serve_load.py            # 32 clients x 3 requests, 8 drops; writes benchmarks/results/serve_load.*
    python benchmarks/serve_load.py --quick
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (DEFAULT_DATA_DIR, add_presets, apply_presets, RESULTS_DIR, Log, load_prompts, markdown_table,  # noqa: E402
                               result_header, result_preamble, write_result)
from dspark.config import DTYPE_CHOICES  # noqa: E402
from dspark import LLM, SamplingParams  # noqa: E402

FULL = {"clients": 32, "requests": 96, "max_tokens": 48, "stream_fraction": 0.5, "drops": 8}
QUICK = {"clients": 4, "requests": 8, "max_tokens": 8, "stream_fraction": 0.5, "drops": 2}
MODEL = "dspark"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_presets(p, FULL, QUICK)
    p.add_argument("--drafter", default="prompt-lookup", help="[%(default)s, as `dspark serve`]")
    p.add_argument("--scheduler", default="fixed", help="[%(default)s, as `dspark serve`]")
    p.add_argument("--dtype", default="bf16", choices=DTYPE_CHOICES)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    p.add_argument("--out", default=str(RESULTS_DIR / "serve_load"))
    args = apply_presets(p.parse_args(argv), FULL, QUICK)
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_request(client: httpx.AsyncClient, url: str, job: dict) -> dict:
    """Send one chat request as a client would; returns what came back and how long it took."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": job["text"]}], "temperature": 0,
            "max_tokens": job["max_tokens"], "stream": job["mode"] != "plain"}
    start = time.perf_counter()
    out = {"index": job["index"], "mode": job["mode"]}
    try:
        if job["mode"] == "plain":
            r = await client.post(url, json=body)
            out.update(status=r.status_code, latency=time.perf_counter() - start)
            data = r.json()
            out.update(text=data["choices"][0]["message"]["content"], finish=data["choices"][0]["finish_reason"],
                       tokens=data["usage"]["completion_tokens"])
            return out
        async with client.stream("POST", url, json=body) as r:
            out["status"] = r.status_code
            text, finish, events = "", None, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"]["message"]
                    break
                if events == 0:
                    out["first_token"] = time.perf_counter() - start
                events += 1
                text += chunk["choices"][0]["delta"].get("content") or ""
                finish = chunk["choices"][0]["finish_reason"] or finish
                if job["mode"] == "disconnect" and events >= 3:
                    break  # leave mid-stream: closing the unfinished response drops the connection
            out.update(text=text, finish=finish, latency=time.perf_counter() - start)
    except Exception as exc:  # recorded as a lost response
        out["exception"] = f"{type(exc).__name__}: {exc}"
    return out


async def run_clients(url: str, jobs: list[dict], clients: int) -> list[dict]:
    """`clients` concurrent clients working through the jobs in order, each sending its next request when its
    last one is done. One event loop in one thread: the load generator shares the server's cores, so it
    should take as little CPU as it can."""
    slots = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as client:
        async def client_turn(job):
            async with slots:
                return await one_request(client, url, job)

        return await asyncio.gather(*(client_turn(job) for job in jobs))


def start_server(args, port: int, log_path: Path) -> subprocess.Popen:
    """`dspark serve` in its own process, as a user runs it; returns once /health answers."""
    cmd = [sys.executable, "-m", "dspark.cli", "serve", "--port", str(port), "--model-name", MODEL,
           "--max-num-seqs", str(args.clients), "--max-waiting", str(args.requests), "--drafter", args.drafter,
           "--scheduler", args.scheduler, "--dtype", args.dtype, "--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not come up: {' '.join(cmd)}\n{log_path.read_text()[-2000:]}")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used so far (Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def resident_mb(pid: int) -> float:
    """A process's resident memory in MB (Linux /proc; NaN elsewhere)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return float("nan")


async def drop_streams(url: str, jobs: list[dict]) -> list[dict]:
    """Streaming clients that each leave after a few events, all at once."""
    async with httpx.AsyncClient(timeout=600) as client:
        return await asyncio.gather(*(one_request(client, url, job) for job in jobs))


def kv_back_to_idle(base: str, idle_level: float, seconds: float = 30.0) -> float:
    """Seconds until the server's KV slots in use fall back to idle_level (inf if not within `seconds`)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if read_metrics(base).get("dspark_kv_cache_slots_used", 0.0) <= idle_level:
            return time.monotonic() - start
        time.sleep(0.02)
    return float("inf")


def read_metrics(base: str) -> dict[str, float]:
    metrics = {}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            metrics[name] = float(value)
    return metrics


def wait_idle(base: str, seconds: float = 30.0) -> dict[str, float]:
    """The server's metrics once nothing runs, waits or holds KV cache (or after `seconds`)."""
    deadline = time.monotonic() + seconds
    while True:
        m = read_metrics(base)
        idle = all(m.get(k, 0.0) == 0 for k in ("dspark_running_requests", "dspark_waiting_requests",
                                                  "dspark_kv_cache_slots_used"))
        if idle or time.monotonic() > deadline:
            return {**m, "idle": idle}
        time.sleep(0.5)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    log = Log()
    texts = [p["text"] for p in load_prompts(args.data_dir, min(args.requests, 150))]
    jobs = []
    for i in range(args.requests):  # evenly spread: every 1/fraction-th request streams
        mode = "stream" if int((i + 1) * args.stream_fraction) > int(i * args.stream_fraction) else "plain"
        jobs.append({"index": i, "text": texts[i % len(texts)], "mode": mode, "max_tokens": args.max_tokens})
    drops = [{"index": args.requests + i, "text": texts[i % len(texts)], "mode": "disconnect", "max_tokens": 400}
             for i in range(args.drops)]

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server_log = Path(args.out).with_name(Path(args.out).name + "_server.log")
    server_log.parent.mkdir(parents=True, exist_ok=True)
    proc = start_server(args, port, server_log)
    log(f"`dspark serve` up (pid {proc.pid}); {args.requests} requests from {args.clients} clients")
    try:
        rss_before = resident_mb(proc.pid)
        kv_idle_level = read_metrics(base).get("dspark_kv_cache_slots_used", 0.0)
        start, clients_cpu, server_cpu = time.perf_counter(), time.process_time(), cpu_seconds(proc.pid)
        answers = asyncio.run(run_clients(base + "/v1/chat/completions", jobs, args.clients))
        server_seconds = time.perf_counter() - start
        clients_cpu, server_cpu = time.process_time() - clients_cpu, cpu_seconds(proc.pid) - server_cpu
        wait_idle(base)
        dropped = asyncio.run(drop_streams(base + "/v1/chat/completions", drops))
        kv_seconds = kv_back_to_idle(base, kv_idle_level)
        log(f"{len(drops)} streams dropped mid-answer: KV cache back to idle in {kv_seconds:.2f} s")
        after = wait_idle(base)
        rss_after = resident_mb(proc.pid)
        proc.send_signal(signal.SIGTERM)  # graceful shutdown: nothing runs, so it exits at once, with 0
        exit_code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    idle = after["idle"]
    log(f"server pass: {server_seconds:.1f} s; idle afterwards: {idle}; exit code after SIGTERM: {exit_code}")

    # the same requests offline: at the same concurrency (throughput), then each alone (the reference answers)
    complete = answers
    llm = LLM(drafter=args.drafter, scheduler=args.scheduler, dtype=args.dtype, max_num_seqs=args.clients)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    prompts = [llm.chat_prompt(jobs[a["index"]]["text"]) for a in complete]
    start, offline_cpu = time.perf_counter(), time.process_time()
    offline = dict(zip((a["index"] for a in complete), llm.generate(prompts, greedy)))
    offline_seconds, offline_cpu = time.perf_counter() - start, time.process_time() - offline_cpu
    offline_steps = list(llm.engine.stats)
    log(f"offline pass: {offline_seconds:.1f} s")
    alone = {a["index"]: llm.generate(p, greedy)[0] for a, p in zip(complete, prompts)}
    log("each request alone: done")

    lost = [a for a in complete if a.get("exception") or a.get("status") != 200 or a.get("error")
            or (a["mode"] == "stream" and not a.get("done")) or a.get("finish") is None]
    equal = [a for a in complete if a.get("text") == alone[a["index"]].text]
    tokens = sum(len(o.token_ids) for o in offline.values())  # the same completed answers in both passes
    latencies = sorted(a["latency"] for a in complete if "latency" in a)
    firsts = sorted(a["first_token"] for a in complete if "first_token" in a)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None

    aborted = after.get('dspark_requests_total{finish_reason="abort"}', 0.0)
    server_rate, offline_rate = tokens / server_seconds, tokens / offline_seconds
    result = result_header("serve_load", __file__, argv)
    result["settings"] = {k: getattr(args, k) for k in (*FULL, "drafter", "scheduler", "dtype")}
    row = {"requests": len(jobs), "completed": len(complete), "lost_or_corrupted": len(lost),
           "greedy_equal_alone": len(equal) / max(len(complete), 1),
           "greedy_equal_offline_batch": sum(a.get("text") == offline[a["index"]].text for a in complete) / len(complete),
           "dropped_streams": len(drops), "dropped_streams_started": sum(d.get("status") == 200 for d in dropped),
           "kv_back_to_idle_s": kv_seconds, "engine_idle_after": idle,
           "kv_slots_after": after.get("dspark_kv_cache_slots_used"), "exit_code_after_sigterm": exit_code,
           "aborted_in_metrics": aborted, "server_rss_mb_before": rss_before, "server_rss_mb_after": rss_after,
           "latency_p50_s": pct(latencies, 0.5), "latency_p95_s": pct(latencies, 0.95), "latency_p99_s": pct(latencies, 0.99),
           "first_token_p50_s": pct(firsts, 0.5), "first_token_p90_s": pct(firsts, 0.9),
           "server_tokens_per_s": server_rate, "offline_tokens_per_s": offline_rate,
           "server_seconds": server_seconds, "offline_seconds": offline_seconds,
           # the load generator shares this machine's cores with the server: how much CPU each used in that pass
           "server_pass_server_cpu_s": server_cpu, "server_pass_clients_cpu_s": clients_cpu, "offline_cpu_s": offline_cpu,
           # where a gap comes from: more steps (fuller or emptier batches) or dearer steps
           "server_steps": after.get("dspark_step_seconds_count"), "server_step_seconds": after.get("dspark_step_seconds_sum"),
           "server_mean_B": after.get("dspark_verify_batch_tokens_sum", 0) / max(after.get("dspark_verify_batch_tokens_count", 0), 1),
           "offline_steps": len(offline_steps), "offline_step_seconds": sum(st.t_total for st in offline_steps),
           "offline_mean_B": sum(st.verify_tokens for st in offline_steps) / max(len(offline_steps), 1)}
    result["rows"] = [row]
    result["headline"] = {"server_over_offline_throughput": server_rate / offline_rate, "server_lost_responses": len(lost),
                          "server_kv_leaked_blocks": (after.get("dspark_kv_cache_slots_used") or 0.0) - kv_idle_level,
                          "server_greedy_equal_alone": row["greedy_equal_alone"]}
    if lost:
        result["lost_examples"] = lost[:5]
    md = "\n".join([result_preamble(result), markdown_table([{"figure": k, "value": v} for k, v in row.items()],
                                                            ["figure", "value"]),
                    "\n## Headline\n", markdown_table([{"figure": k, "value": v} for k, v in result["headline"].items()],
                                                      ["figure", "value"])])
    json_path, md_path = write_result(args.out, result, md)
    log(f"wrote {json_path}; headline {result['headline']}")
    ok = not lost and idle and exit_code == 0 and len(equal) == len(complete) and kv_seconds <= 1.0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
