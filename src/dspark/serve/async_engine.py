"""One engine loop shared by every connection: the engine steps on its own thread, so the event loop never
blocks, and all concurrent HTTP requests are batched together.

Which thread: PyTorch's CPU kernels run on OpenMP thread teams, one team per thread that starts parallel work,
and when the teams together have more threads than there are cores, their threads stop spinning between
kernels and sleep, so every kernel pays a wake-up. The engine loop is therefore best run on the thread that
loaded the model (`run`, as `dspark serve` does), so that one team does all the work; `start` runs it on a new
thread (in-process servers, tests), whose second team pays those wake-ups where the cores are few.

Requests are built and checked on the caller's thread (`LLMEngine.new_request`), handed to the engine
thread through a queue, and their outputs come back through an asyncio queue per request. Cancelling a
stream (a client that disconnects) aborts the request on the engine thread, which frees its KV slot and
drafter state at once.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..engine.llm_engine import LLMEngine
from ..engine.request import RequestOutput
from ..sampling import SamplingParams
from .metrics import Metrics


class Overloaded(Exception):
    """More requests in flight than the server admits (running plus waiting)."""


@dataclass
class Stream:
    """The outputs of one submission: its requests (n samples of one prompt) share one queue."""
    request_ids: list[str]
    prompt_tokens: int
    outputs: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    partial: bool = True  # every step's output; False: only the finished ones (a non-streaming answer)
    prompt_lens: dict[str, int] = field(default_factory=dict)  # each request's prompt tokens

    async def __aiter__(self):
        """Every output, until each request has finished."""
        left = set(self.request_ids)
        while left:
            out: RequestOutput = await self.outputs.get()
            yield out
            if out.finished:
                left.discard(out.request_id)


def put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue_, out in items:
        queue_.put_nowait(out)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256, metrics: Metrics | None = None):
        self.engine = engine
        self.max_in_flight = engine.config.max_num_seqs + max_waiting
        self.metrics = metrics or Metrics()
        self.commands: queue.Queue = queue.Queue()
        self.streams: dict[str, Stream] = {}  # requests in flight, owned by the engine thread once added
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="dspark-engine", daemon=True)
        self.error: BaseException | None = None
        self.finished = threading.Event()  # the loop has returned (or failed)
        self.feed = None  # a live.StepFeed, given each step's record

    # ---- caller side (event loop thread) ---------------------------------------------------------
    def start(self) -> None:
        """Run the loop on a thread of its own."""
        self.thread.start()

    def alive(self) -> bool:
        return self.error is None and not self.finished.is_set()

    def submit(self, prompts: list[list[int]], params: list[SamplingParams], partial: bool = True,
               prompt_tokens: int | None = None) -> Stream:
        """Check and queue one request per (prompt, params) pair (n samples of one prompt: admitted together, they
        share one prefill), all or none; raises ValueError (bad input) or Overloaded (over the limits).
        partial=False: the stream gets only the finished outputs. prompt_tokens: what usage counts (default: the
        first prompt's length)."""
        if self.stopping.is_set():
            raise Overloaded("the server is shutting down")
        if len(params) > self.max_in_flight:
            raise ValueError(f"{len(params)} choices are more than this server holds at once ({self.max_in_flight})")
        reqs = [self.engine.new_request(ids, p) for ids, p in zip(prompts, params)]
        stream = Stream([r.request_id for r in reqs], len(reqs[0].prompt_ids) if prompt_tokens is None else prompt_tokens,
                        asyncio.Queue(), asyncio.get_running_loop(), partial,
                        {r.request_id: len(r.prompt_ids) for r in reqs})
        with self.lock:
            if len(self.streams) + len(reqs) > self.max_in_flight:
                self.metrics.rejected.labels("overloaded").inc()
                raise Overloaded(f"the server has {len(self.streams)} requests in flight (limit "
                                 f"{self.max_in_flight}: {self.engine.config.max_num_seqs} running plus the waiting "
                                 f"queue); retry later")
            self.streams.update((r.request_id, stream) for r in reqs)
        self.commands.put(("add", reqs))
        return stream

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id))

    def in_flight(self) -> int:
        with self.lock:
            return len(self.streams)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Cancel what still runs and stop the loop thread."""
        self.stopping.set()
        self.commands.put(("stop", None))
        if self.thread.is_alive():
            self.thread.join(timeout)

    # ---- engine thread ---------------------------------------------------------------------------
    def run(self, serving: Callable[[], bool] = lambda: True) -> None:
        """The engine loop, on the calling thread, until shutdown() or until serving() turns false."""
        try:
            while True:
                try:  # idle: wait for work; busy: only look
                    busy = self.engine.has_unfinished()
                    self._handle(*(self.commands.get_nowait() if busy else self.commands.get(timeout=0.5)))
                except queue.Empty:
                    pass
                while not self.commands.empty():
                    self._handle(*self.commands.get_nowait())
                if self.stopping.is_set() or not serving():
                    for request_id in list(self.streams):
                        self._abort(request_id)
                    return
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as exc:  # never leave clients waiting forever
            self.error = exc
            for request_id in list(self.streams):
                self._abort(request_id, reason="error", error=f"engine loop failed: {exc}")
            raise
        finally:
            self.finished.set()

    def _handle(self, kind: str, value) -> None:
        if kind == "add":
            self.engine.waiting.extend(r for r in value if r.request_id in self.streams)  # not cancelled while queued
            self._observe_load()
        elif kind == "abort":
            self._abort(value)
        # "stop": the loop checks self.stopping

    def _step(self) -> None:
        start = time.perf_counter()
        recorded = self.engine.stats[-1] if self.engine.stats else None
        outputs = self.engine.step()
        elapsed = time.perf_counter() - start
        st = self.engine.stats[-1] if self.engine.stats else None
        st = None if st is recorded else st  # a step may record none
        self.metrics.observe_step(elapsed, st)
        if self.engine.drift is not None:
            self.metrics.observe_calibration(self.engine.drift.state)
        if self.feed is not None:
            self.feed.record(st, elapsed)
        self._observe_load()
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their streams: one wake-up per event loop, not one per output."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None or not (out.finished or stream.partial):
                continue
            if out.finished:
                with self.lock:
                    self.streams.pop(out.request_id, None)
                self.metrics.observe_finished(out)
            by_loop.setdefault(stream.loop, []).append((stream.outputs, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(put_all, items)
            except RuntimeError:  # the event loop is gone (server stopped): nobody is waiting
                pass

    def _abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> None:
        stream = self.streams.get(request_id)
        if stream is None:
            return
        req = self.engine.abort(request_id)
        if req is None:  # not yet handed to the engine
            out = RequestOutput(request_id, "", "", [], True, reason, error, stream.prompt_lens[request_id])
        else:  # its tokens so far count
            req.finish_reason, req.error = reason, error
            out = req.output("")
        self._deliver([out])
        self._observe_load()

    def _observe_load(self) -> None:
        engine = self.engine
        self.metrics.observe_load(len(engine.waiting), len(engine.running), engine.cache.num_used)
