"""A request's state: prompt, committed tokens, KV slot, generator, text and finish status."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..sampling import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    request_id: str
    text: str  # whole text so far (stop strings removed)
    delta: str  # text added by this step
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    error: str | None = None
    prompt_tokens: int = 0
    drafts_verified: int = 0
    drafts_accepted: int = 0
    steps: int = 0
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None  # per token, when asked for

    @property
    def acceptance_length(self) -> float:
        """Tokens per verify step (accepted drafts + 1), the τ of this request (the first token comes
        from the prefill, not from a verify step)."""
        return (len(self.token_ids) - 1) / max(self.steps, 1)


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    on_output: Callable[[RequestOutput], None] | None = None  # called after every step that adds text
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    slot: int = -1
    num_cached: int = 0  # positions in the KV cache (committed, fed through the target)
    text: str = ""
    emitted: int = 0  # characters of text already reported
    finish_reason: str | None = None
    error: str | None = None
    drafts_verified: int = 0
    drafts_accepted: int = 0
    steps: int = 0
    admitted_at: float | None = None  # time.perf_counter() when the engine took it from the queue
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)  # params.logprobs set

    def __post_init__(self):
        seed = self.params.seed if self.params.seed is not None else int(torch.randint(2**62, ()).item())
        self.generator = torch.Generator().manual_seed(seed % 2**64)  # any integer seeds it

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        """The newest token: sampled, not yet fed through the target."""
        return self.output_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def uniforms(self, n: int) -> torch.Tensor:
        return torch.rand(n, generator=self.generator)

    def output(self, delta: str) -> RequestOutput:
        return RequestOutput(self.request_id, self.text, delta, list(self.output_ids), self.finished,
                             self.finish_reason, self.error, len(self.prompt_ids), self.drafts_verified,
                             self.drafts_accepted, self.steps,
                             None if self.params.logprobs is None else list(self.logprobs))
