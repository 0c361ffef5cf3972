"""A `dspark serve` app on loopback in a thread of the test process (so tests can look at the engine directly), and a
log handler that catches tracebacks in the server's log."""
from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn

from dspark import LLM
from dspark.serve.app import build_app
from dspark.serve.settings import ServerSettings

MODEL = "smollm2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, timeout: float = 30.0, every: float = 0.05):
    end = time.time() + timeout
    while time.time() < end:
        if check():
            return True
        time.sleep(every)
    return False


class Server:
    def __init__(self, llm: LLM, max_waiting: int, **settings):
        self.llm = llm
        self.app = build_app(llm, ServerSettings(MODEL, max_waiting=max_waiting, default_max_tokens=32, **settings))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)

    @property
    def loop_engine(self):
        return self.app.state.engine

    def idle(self) -> bool:
        e = self.llm.engine
        return not e.running and not e.waiting and self.loop_engine.in_flight() == 0 and e.cache.num_used == 0


class Tracebacks(logging.Handler):
    """Log records of the server that carry an exception (a traceback in its log)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        if record.exc_info or "Traceback" in record.getMessage():
            self.records.append(record)
