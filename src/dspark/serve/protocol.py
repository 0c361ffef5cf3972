"""The OpenAI request bodies the server accepts (validated by pydantic) and the error shape it answers
with: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator


MAX_N = 64  # choices per request at most (the server's in-flight limit may be lower: then a 400)


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI fields we do not use (user, logit_bias, ...) pass
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="extension: keep the k most likely tokens; 0 = off")
    n: int = Field(1, ge=1, le=MAX_N, description="choices: samples of the prompt (they share one prefill)")
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or not all(stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(SamplingFields):
    prompt: str | list[int]

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if not v:
            raise ValueError("the prompt is empty")
        return v


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status)
