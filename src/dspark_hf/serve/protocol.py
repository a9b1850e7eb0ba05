"""The OpenAI wire format `dspark serve` speaks: request schemas (strict), error bodies, response chunks.

Requests are validated with pydantic models in strict mode that forbid unknown fields, straight from the body's
bytes: a misspelt parameter is a `400` naming it instead of being silently ignored, `"16"` or `true` is not an
integer, numbers are finite and in range, and malformed JSON (a 5,000-digit number, arrays nested 100,000 deep, a
lone surrogate) is a `400` too. Error messages quote at most a short prefix of what was received. Fields of the
OpenAI API that this server cannot honour are accepted only at their neutral value (`n=1`, zero penalties, no
logprobs) and refused otherwise, with a message saying so. Extensions (also accepted by vLLM): `top_k`,
`repetition_penalty`, `ignore_eos`, `return_token_ids`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from ..decoding.engine import SamplingParams

#: an error message is cut to this many characters, a quoted value to `_QUOTE` (bad values can be megabytes)
MAX_ERROR_CHARS = 1000
_QUOTE = 60
#: temperatures in (0, MIN_TEMPERATURE) decode greedily, as vLLM does: dividing logits by 1e-300 overflows to
#: inf and NaN probabilities, and anything this cold is greedy up to ties anyway
MIN_TEMPERATURE = 1e-2


def short(value: Any, limit: int = _QUOTE) -> str:
    """`repr(value)`, cut to about `limit` characters (with the full length said) so a message stays small."""
    if isinstance(value, (str, bytes, list, dict)) and len(value) > limit:
        head = repr(value[:limit] if not isinstance(value, dict) else dict(list(value.items())[:3]))
        unit = "characters" if isinstance(value, str) else "bytes" if isinstance(value, bytes) else "items"
        return f"{head[:limit]}... ({len(value):,} {unit})"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


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
        """The JSON body; every part bounded (message, param and code cut to a few hundred characters)."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        elif self.status == 429:
            kind = "rate_limit_error"
        message = self.message if len(self.message) <= MAX_ERROR_CHARS else self.message[:MAX_ERROR_CHARS] + "..."
        param = self.param if self.param is None or len(self.param) <= 100 else self.param[:100] + "..."
        code = self.code if self.code is None or len(self.code) <= 100 else self.code[:100]
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # e.g. `name`; the chat template decides what it reads

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # OpenAI content parts: only text parts are served
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(
                        400, f"content part of type {short(part.get('type'))} is not supported; send text parts only.",
                        param="messages",
                    )  # fmt: skip
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


_INT32 = 2**31 - 1


class _Common(BaseModel):
    # strict: no "16" for 16, no true for 1; floats must be finite (no Infinity/NaN literals)
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=_INT32)
    temperature: float | None = Field(None, ge=0, le=2)  # OpenAI's range
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=_INT32)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what torch.Generator.manual_seed takes
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = Field(None, gt=0, le=100)
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
    def _stops(cls, v, info: ValidationInfo):
        stops = [v] if isinstance(v, str) else v or []
        limits = info.context or {}
        count, chars = limits.get("max_stop_strings", 4), limits.get("max_stop_chars", 256)
        longest = max(map(len, stops), default=0)
        if len(stops) > count or longest > chars or any(not s for s in stops):
            raise ValueError(
                f"stop takes up to {count} non-empty strings of up to {chars} characters each (this server's "
                f"max_stop_strings and max_stop_chars), got {len(stops):,} strings, the longest {longest:,} "
                "characters"
            )
        return stops

    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        """OpenAI semantics: `temperature` defaults to 1 (sampling); `temperature=0` is greedy."""
        temperature = 1.0 if self.temperature is None else self.temperature
        greedy = temperature < MIN_TEMPERATURE
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
    max_completion_tokens: int | None = Field(None, ge=1, le=_INT32)

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


def parse(model_cls, raw: bytes, context: dict | None = None) -> BaseModel:
    """Validate a raw JSON body (strictly, in one pass); the first problem becomes a `400` naming the field.

    Args:
        model_cls: the request schema.
        raw (`bytes`): the body, already bounded in size.
        context (`dict`, *optional*): limits the validators read (`max_stop_strings`, `max_stop_chars`).
    """
    try:
        return model_cls.model_validate_json(raw, strict=True, context=context)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        kind = first["type"]
        if kind == "json_invalid":  # the parser's message says where; the input is the whole body, never quoted
            message = f"the request body is not valid JSON ({first['msg'].removeprefix('Invalid JSON: ')}); send a JSON object."
            raise ApiError(400, message, code="json_invalid") from None
        if kind == "model_type" and field is None:
            message = f"the request body must be a JSON object, got {short(first.get('input'))}."
        elif kind == "extra_forbidden":
            allowed = ", ".join(sorted(model_cls.model_fields))
            message = f"unknown field {short(field)}; the fields this endpoint accepts are: {allowed}."
        elif kind == "missing":
            message = f"field {short(field)} is required."
        else:
            message = f"{field}: {first['msg'].removeprefix('Value error, ')} (got {short(first.get('input'))})."
        raise ApiError(400, message, param=field, code=kind) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def finish_reason(engine_reason: str) -> str:
    """Engine finish reasons → OpenAI's: EOS is `stop`; the token budget and a full context are `length`."""
    return "stop" if engine_reason in ("eos", "stop") else "length"
