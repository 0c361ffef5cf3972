"""`dspark serve`: an OpenAI-compatible HTTP API (FastAPI + uvicorn) on one shared engine loop.

POST /v1/chat/completions and /v1/completions (streaming with server-sent events, or not; n choices of
one prompt share its prefill, choice i samples with seed + i; log-probabilities on request; a list of completion
prompts answers each), GET /v1/models, /health and /metrics (Prometheus), and the live page: GET / (live.py's page)
and GET /v1/live (its server-sent events of step records). With a drafter that has a confidence head, the engine
checks its calibration online (schedule/drift.py; re-fitting it only with `online_calibration`). Every error is an OpenAI error object
without a stack trace: 400 invalid or unsupported parameters, 401 a bad API key, 404 an unknown model or route, 413 a
body over the limit, 429 over the in-flight limit, 500 a request whose generation failed (only that request). A
client that goes away has its request aborted within a step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import threading
import time
import uuid
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..engine.llm import LLM
from ..engine.request import RequestOutput
from ..sampling import SamplingParams
from .async_engine import AsyncEngine, Overloaded, Stream
from ..schedule.drift import DriftMonitor
from .guards import Guards
from .live import LIVE_PERIOD, PAGE, StepFeed
from .logprobs import TokenText
from .metrics import Metrics
from .protocol import ChatRequest, CompletionRequest, SamplingFields, error_response, unsupported
from .settings import ServerSettings

DISCONNECT_POLL = 0.05  # seconds between checks that a non-streaming client is still there


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class RequestFailed(Exception):
    """The engine failed this request (and only it): 500 with its message."""


def build_app(llm: LLM, settings: ServerSettings = ServerSettings(), engine_thread: bool = True) -> FastAPI:
    """engine_thread: start the engine loop on a thread of its own; False: the caller runs
    `app.state.engine.run()` (on the thread that loaded the model: see async_engine.py)."""
    engine = llm.engine
    metrics = Metrics()
    loop_engine = AsyncEngine(engine, settings.max_waiting, metrics)
    max_len = engine.max_model_len
    max_prompt = min(settings.max_prompt_tokens or max_len - 1, max_len - 1)
    token_text = TokenText(llm.tokenizer)
    if engine.drafter.has_confidence and hasattr(engine.drafter, "temperatures"):
        engine.watch_calibration(DriftMonitor.for_drafter(engine.drafter, refit=settings.online_calibration))
    feed = loop_engine.feed = StepFeed(engine, metrics, token_text)
    model_name = settings.model_name

    @asynccontextmanager
    async def lifespan(app):
        if engine_thread:
            loop_engine.start()
        yield
        await asyncio.to_thread(loop_engine.shutdown)

    app = FastAPI(title="dspark", lifespan=lifespan)
    app.state.engine = loop_engine
    app.add_middleware(Guards, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)

    # ---- errors --------------------------------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", code="invalid_json")
        param = ".".join(loc) or None
        return error_response(400, f"{param or 'body'}: {err.get('msg', 'invalid value')}", param=param)

    @app.exception_handler(BadRequest)
    async def bad_request(request, exc: BadRequest):
        return error_response(exc.status, str(exc), param=exc.param, code=exc.code)

    @app.exception_handler(RequestFailed)
    async def failed(request, exc: RequestFailed):
        return error_response(500, str(exc), type_="server_error", code="generation_failed")

    @app.exception_handler(Overloaded)
    async def overloaded(request, exc: Overloaded):
        return error_response(429, str(exc), type_="rate_limit_error", code="overloaded")

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail), type_="invalid_request_error")

    @app.exception_handler(Exception)
    async def internal(request, exc: Exception):  # never a stack trace to the client
        return error_response(500, f"internal error: {type(exc).__name__}", type_="server_error")

    # ---- requests ------------------------------------------------------------------------------------
    def check(body: SamplingFields, choices: int) -> None:
        refused = unsupported(body)
        if refused:
            raise BadRequest(refused[1], param=refused[0], code="unsupported_parameter")
        if body.model != model_name:
            raise BadRequest(f"model {body.model!r} does not exist; this server serves {model_name!r}",
                             param="model", status=404, code="model_not_found")
        if choices > settings.max_n:
            raise BadRequest(f"{choices} choices asked for; this server answers at most {settings.max_n} per request",
                             param="n")

    def sampling(body: SamplingFields, prompt_ids: list[int], max_tokens: int | None, logprobs: int | None,
                 first_index: int = 0) -> list[SamplingParams]:
        """One SamplingParams per choice; with a seed, choice k samples with seed + k."""
        param = "messages" if isinstance(body, ChatRequest) else "prompt"
        if len(prompt_ids) > max_prompt:
            raise BadRequest(f"the prompt has {len(prompt_ids)} tokens; this server takes at most {max_prompt}",
                             param=param, code="context_length_exceeded")
        if max_tokens is not None and settings.max_completion_tokens is not None and max_tokens > settings.max_completion_tokens:
            raise BadRequest(f"max_tokens is {max_tokens}; this server allows at most {settings.max_completion_tokens}",
                             param="max_tokens")
        room = max_len - len(prompt_ids)
        if max_tokens is None:
            max_tokens = max(1, min(settings.default_max_tokens, settings.max_completion_tokens or room, room))
        if len(prompt_ids) + max_tokens > max_len:
            raise BadRequest(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                             f"context of {max_len} tokens", param="max_tokens", code="context_length_exceeded")
        try:
            params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                    max_tokens=max_tokens, seed=body.seed, stop=body.stop or [], logprobs=logprobs)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        return [dataclasses.replace(params, seed=None if body.seed is None else body.seed + first_index + i)
                for i in range(body.n)]

    def submit(prompts: list[list[int]], params: list[SamplingParams], partial: bool, prompt_tokens: int) -> Stream:
        try:
            return loop_engine.submit(prompts, params, partial, prompt_tokens)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    async def collect(stream: Stream, request: Request) -> list[RequestOutput] | None:
        """Every choice's whole answer; None if the client left first (its choices are aborted then, as when one
        fails)."""
        finals: dict[str, RequestOutput] = {}
        try:
            while len(finals) < len(stream.request_ids):
                try:
                    out = await asyncio.wait_for(stream.outputs.get(), timeout=DISCONNECT_POLL)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return None
                    continue
                if out.finish_reason == "error":
                    raise RequestFailed(f"generation failed: {out.error}")
                if out.finished:
                    finals[out.request_id] = out
        finally:
            for request_id in stream.request_ids:
                if request_id not in finals:
                    loop_engine.abort(request_id)
        return [finals[r] for r in stream.request_ids]

    def usage(outs: list[RequestOutput], prompt_tokens: int) -> dict:
        completion = sum(len(o.token_ids) for o in outs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    def sse(stream: Stream, chunk, include_usage: bool):
        """Server-sent events from chunk(index, delta, finish_reason, first, logprob entries) dicts, one per choice's
        step; aborts the unfinished choices when the client disconnects."""
        def event(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        async def events():
            index = {r: i for i, r in enumerate(stream.request_ids)}
            finals: dict[str, RequestOutput] = {}
            sent: dict[str, int] = {}  # log-probability entries already sent per choice
            try:
                async for out in stream:
                    if out.finish_reason == "error":
                        yield event({"error": {"message": f"generation failed: {out.error}", "type": "server_error",
                                               "param": None, "code": "generation_failed"}})
                        break
                    first = out.request_id not in sent
                    if out.delta or first or out.finished:
                        done = sent.get(out.request_id, 0)
                        entries = None if out.logprobs is None else out.logprobs[done:]
                        yield event(chunk(index[out.request_id], out.delta,
                                          out.finish_reason if out.finished else None, first, entries))
                        sent[out.request_id] = done if entries is None else done + len(entries)
                    if out.finished:
                        finals[out.request_id] = out
                if include_usage and len(finals) == len(index):
                    yield event({**chunk(0, None, None, False, None), "choices": [],
                                 "usage": usage(list(finals.values()), stream.prompt_tokens)})
                yield "data: [DONE]\n\n"
            finally:
                for request_id in stream.request_ids:
                    if request_id not in finals:
                        loop_engine.abort(request_id)
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check(body, body.n)
        try:
            prompt_ids = llm.chat_prompt([m.for_template() for m in body.messages])
        except Exception as exc:  # a template that rejects the conversation (e.g. roles out of order)
            raise BadRequest(f"messages: the chat template rejected them ({exc})", param="messages") from None
        params = sampling(body, prompt_ids, body.max_completion_tokens or body.max_tokens, body.logprobs_k)
        stream = submit([prompt_ids] * len(params), params, body.stream, len(prompt_ids))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs(entries):
            return None if entries is None else token_text.chat(entries)
        if body.stream:
            def chunk(index, delta, finish, first, entries):
                d = {} if delta is None else ({"role": "assistant", "content": delta} if first else {"content": delta})
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                        "choices": [{"index": index, "delta": d, "logprobs": logprobs(entries),
                                     "finish_reason": finish}]}
            return sse(stream, chunk, body.include_usage)
        outs = await collect(stream, request)
        if outs is None:
            return Response(status_code=499)  # nobody reads it
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": i, "message": {"role": "assistant", "content": out.text},
                             "logprobs": logprobs(out.logprobs), "finish_reason": out.finish_reason}
                            for i, out in enumerate(outs)],
                "usage": usage(outs, stream.prompt_tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check(body, body.n * len(body.prompts))
        ids = [list(p) if isinstance(p, list) else llm.tokenizer.encode(p, add_special_tokens=False)
               for p in body.prompts]
        params = [sp for j, prompt in enumerate(ids) for sp in sampling(body, prompt, body.max_tokens, body.logprobs,
                                                                         j * body.n)]
        prompts = [prompt for prompt in ids for _ in range(body.n)]
        stream = submit(prompts, params, body.stream, sum(map(len, ids)))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs(entries):
            return None if entries is None else token_text.completion(entries)
        if body.stream:
            offsets: dict[int, int] = {}  # text offset of each choice's next token

            def chunk(index, delta, finish, first, entries):
                lp = None if entries is None else token_text.completion(entries, offsets.get(index, 0))
                if lp is not None and lp["tokens"]:
                    offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                        "choices": [{"index": index, "text": delta or "", "logprobs": lp, "finish_reason": finish}]}
            return sse(stream, chunk, body.include_usage)
        outs = await collect(stream, request)
        if outs is None:
            return Response(status_code=499)
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"index": i, "text": out.text, "logprobs": logprobs(out.logprobs),
                             "finish_reason": out.finish_reason} for i, out in enumerate(outs)],
                "usage": usage(outs, stream.prompt_tokens)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "dspark",
                                            "max_model_len": max_len}]}

    @app.get("/health")
    async def health():
        if not loop_engine.alive():
            return JSONResponse({"status": "error", "detail": "the engine loop has stopped"}, 503)
        return {"status": "ok", "in_flight": loop_engine.in_flight()}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    # ---- the live page -------------------------------------------------------------------------------
    @app.get("/", include_in_schema=False)
    async def page():
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.get("/v1/live")
    async def live(request: Request, history: int = 300):
        """Server-sent events, one every LIVE_PERIOD seconds: live.py's snapshot of the steps since the last one
        (the first event: the last `history` steps)."""
        async def events():
            since = max(0, feed.count - max(0, history))
            feed.clients += 1
            try:
                while not await request.is_disconnected():
                    snap = feed.snapshot(since)
                    since = snap["next"]
                    yield f"data: {json.dumps(snap, allow_nan=False, default=str)}\n\n"
                    await asyncio.sleep(LIVE_PERIOD)
            finally:  # the page closed (or the server stops): nothing of this stream is left
                feed.clients -= 1

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


def serve(llm: LLM, settings: ServerSettings = ServerSettings(), host: str = "127.0.0.1", port: int = 8000,
          graceful_seconds: float = 30.0) -> int:
    """Run until SIGINT/SIGTERM: stop accepting, let running requests finish for up to graceful_seconds,
    cancel the rest, exit 0 (1 if the HTTP server could not start). The engine loop runs on this thread, the
    one that loaded the model, and the HTTP server on another (see async_engine.py)."""
    app = build_app(llm, settings, engine_thread=False)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=graceful_seconds)
    server = uvicorn.Server(config)  # on a thread other than the main one it leaves signals alone
    http = threading.Thread(target=server.run, name="dspark-http")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_exit)
    http.start()
    app.state.engine.run(serving=http.is_alive)
    http.join()
    return 0 if server.started else 1
