"""The OpenAI request bodies the server accepts (validated by pydantic), the parameters it refuses, and the error
shape it answers with: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..sampling import MAX_LOGPROBS

# OpenAI parameters that change nothing here (metadata): accepted and ignored
IGNORED = {"user", "metadata", "store", "service_tier"}
# OpenAI parameters this server does not implement: accepted only at the value that means "off"
NEUTRAL = {"presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None), "logit_bias": (None, {}),
           "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
           "parallel_tool_calls": (None, False, True), "response_format": (None, {"type": "text"}),
           "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
           "web_search_options": (None,), "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1)}


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # the others are checked by `unsupported`
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="extension: keep the k most likely tokens; 0 = off")
    n: int = Field(1, ge=1, description="choices: samples of the prompt (they share one prefill)")
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


def unsupported(body: SamplingFields) -> tuple[str, str] | None:
    """(param, message) for the first parameter of body this server refuses (an OpenAI one it does not implement,
    set to something other than off, or one the API does not define); None when it takes them all."""
    for name, value in (body.model_extra or {}).items():
        if name in IGNORED:
            continue
        if name in NEUTRAL:
            if any(value == off and isinstance(value, bool) == isinstance(off, bool) for off in NEUTRAL[name]):
                continue
            return name, f"{name} is not supported by this server (leave it out or set it to its default)"
        return name, f"unrecognized request argument: {name}"
    return None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def for_template(self) -> dict:
        """{"role", "content"} as chat templates take it: text parts joined, developer as system."""
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @property
    def logprobs_k(self) -> int | None:
        """Alternatives per token to report; None: no log-probabilities."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if not v or (isinstance(v, list) and any(not p for p in v if isinstance(p, (str, list)))):
            raise ValueError("the prompt is empty")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: text or token ids each."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status)
