"""The OpenAI wire format `dspark serve` speaks: request schemas (strict), error bodies, response chunks.

Requests are validated with pydantic models that forbid unknown fields, so a misspelt parameter is a `400`
naming it instead of being silently ignored. Fields of the OpenAI API that this server cannot honour are
accepted only at their neutral value (`n=1`, zero penalties, no logprobs) and refused otherwise, with a
message saying so. Extensions (also accepted by vLLM): `top_k`, `repetition_penalty`, `ignore_eos`,
`return_token_ids`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..decoding.engine import SamplingParams


class ApiError(Exception):
    """An error answered as `{"error": {...}}` in OpenAI's shape.

    Args:
        status (`int`): HTTP status.
        message (`str`): what was received, what is allowed, how to fix it.
        param (`str`, *optional*): the offending request field.
        code (`str`, *optional*): a short machine-readable code.
        headers (`dict`, *optional*): extra response headers (e.g. `Retry-After`).
    """

    def __init__(self, status: int, message: str, param=None, code=None, headers=None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        elif self.status == 429:
            kind = "rate_limit_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. `name`; the chat template decides what it reads

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # OpenAI content parts: only text parts are served
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(
                        400, f"content part of type {part.get('type')!r} is not supported; send text parts only.",
                        param="messages",
                    )  # fmt: skip
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    return_token_ids: bool = False
    logprobs: bool | int | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v):
        if v != 1:
            raise ValueError(f"only n=1 is served (one choice per request), got {v}; send n separate requests")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v):
        if v != 0:
            raise ValueError(f"presence/frequency penalties are not supported, got {v}; use repetition_penalty")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("logprobs are not returned by this server; leave logprobs unset")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError(f"stop takes up to 4 non-empty strings, got {stops!r}")
        return stops

    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        """OpenAI semantics: `temperature` defaults to 1 (sampling); `temperature=0` is greedy."""
        temperature = 1.0 if self.temperature is None else self.temperature
        greedy = temperature == 0
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            temperature=1.0 if greedy else temperature,
            top_k=None if greedy else self.top_k,
            top_p=None if greedy else self.top_p,
            repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
        )


class ChatCompletionRequest(_Common):
    """`POST /v1/chat/completions` body."""

    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    """`POST /v1/completions` body: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str]
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported; leave it false")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


def parse(model_cls, body) -> BaseModel:
    """Validate a decoded JSON body; the first problem becomes a `400` naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}.")
    try:
        return model_cls.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            allowed = ", ".join(sorted(model_cls.model_fields))
            message = f"unknown field {field!r}; the fields this endpoint accepts are: {allowed}."
        elif first["type"] == "missing":
            message = f"field {field!r} is required."
        else:
            got = first.get("input")
            message = f"{field}: {first['msg'].removeprefix('Value error, ')} (got {got!r})."
        raise ApiError(400, message, param=field, code=first["type"]) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def finish_reason(engine_reason: str) -> str:
    """Engine finish reasons → OpenAI's: EOS is `stop`; the token budget and a full context are `length`."""
    return "stop" if engine_reason in ("eos", "stop") else "length"
