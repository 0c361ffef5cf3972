"""What `dspark serve` admits: the model name clients send, the API key, and the limits on each request and on the
requests in flight; and whether it re-fits its calibration online (each a flag of `dspark serve`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    model_name: str = "dspark"
    api_key: str | None = None  # when set, every route but /health needs "Authorization: Bearer <key>"
    max_waiting: int = 256  # requests queued beyond the running ones; more get 429
    default_max_tokens: int = 256  # max_tokens of a request that gives none (capped by the context)
    max_completion_tokens: int | None = None  # the largest max_tokens a request may ask for (None: the context's room)
    max_prompt_tokens: int | None = None  # the longest prompt (None: the context less one token)
    max_n: int = 16  # choices per request (times prompts, for a list of completion prompts)
    max_body_bytes: int = 1 << 20  # request body size; larger ones get 413
    online_calibration: bool = False  # re-fit the confidence head's STS temperatures when calibration drifts

    def __post_init__(self):
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        for name in ("default_max_tokens", "max_n", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_completion_tokens", "max_prompt_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
