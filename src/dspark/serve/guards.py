"""ASGI middleware in front of every route: the API key (when one is set) and the request body size limit, both
answered in OpenAI's error shape before any route runs. The body is read here once (up to the limit) and replayed
to the route; what the client sends after it (a disconnect) still reaches the route. The live page and its event
stream may carry the key as `?key=...` instead (a browser's EventSource sends no headers)."""
from __future__ import annotations

import hmac
import json
from urllib.parse import parse_qs

OPEN_PATHS = {"/health"}  # answered without the key (load balancers)
PAGE_PATHS = {"", "/v1/live"}  # GET with ?key= accepted


class Guards:
    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        path = scope["path"].rstrip("/")
        if self.api_key is not None and path not in OPEN_PATHS:
            scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
            if path in PAGE_PATHS and scope.get("method") == "GET" and scheme.lower() != b"bearer":
                scheme, given = b"bearer", parse_qs(scope.get("query_string", b"").decode()).get("key", [""])[0].encode()
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.api_key.encode()):
                return await error(send, 401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                   "invalid_api_key")
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return await error(send, 413, f"the request body is larger than {self.max_body_bytes} bytes",
                               "request_too_large")
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending the whole body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await error(send, 413, f"the request body is larger than {self.max_body_bytes} bytes",
                                   "request_too_large")
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def error(send, status: int, message: str, code: str) -> None:
    payload = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                    "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
