"""The server's settings, and the checks a request passes before it costs the event loop anything.

[`ServeConfig`] holds every limit (validated on construction). Before a request is parsed: its `Host` header
must be allowed ([`HostCheck`], against DNS rebinding), its `Content-Type` must be JSON (a web page cannot
send that to another site without the server's consent), and its body must arrive whole within `body_timeout`
seconds and `max_body_bytes` bytes ([`read_body`]: refused from `Content-Length` before a byte is read).
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from .protocol import ApiError, short

#: the Host names a server bound to a loopback address answers by default (DNS rebinding sends another name)
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
CLOSE = {"Connection": "close"}  # after an error sent before the body was read: the rest of it is never read


@dataclass
class ServeConfig:
    """Limits and identity of one server.

    Args:
        model_name (`str`, *optional*, defaults to `"dspark"`): the id `/v1/models` lists; requests naming
            another model get `404`.
        max_queue (`int`, *optional*, defaults to 32): requests admitted beyond the engine's running batch; with
            `max_batch_size + max_queue` requests in flight, new ones get `429` with `Retry-After`.
        max_prompt_tokens (`int`, *optional*, defaults to 2048): longest prompt accepted, in tokens.
        max_new_tokens (`int`, *optional*, defaults to 512): the most `max_tokens` a request may ask for, and
            what it gets when it asks for nothing.
        api_key (`str`, *optional*): when set, `/v1/*` requires `Authorization: Bearer <api_key>`.
        shutdown_timeout (`float`, *optional*, defaults to 30): seconds in-flight requests get to finish after
            SIGTERM before they are cancelled.
        retry_after (`int`, *optional*, defaults to 1): the `Retry-After` header of a `429`, in seconds.
        max_body_bytes (`int`, *optional*, defaults to 1 MiB): largest request body; a larger one gets `413`
            as soon as its `Content-Length` (or the bytes read so far) says so, before anything is parsed.
        body_timeout (`float`, *optional*, defaults to 30): seconds the whole body may take to arrive; a slower
            (or unfinished) one gets `408`.
        max_prompt_chars (`int`, *optional*): longest prompt text accepted, in characters, checked before
            tokenizing. Default: `max_prompt_tokens` times the longest token of the vocabulary (in characters),
            the most text that can fit in `max_prompt_tokens` tokens.
        max_stop_strings (`int`, *optional*, defaults to 4): most `stop` strings per request (OpenAI's limit).
        max_stop_chars (`int`, *optional*, defaults to 256): longest `stop` string, in characters.
        allowed_hosts (`tuple[str]`, *optional*): `Host` header names answered (port ignored); `"*"` answers any.
            Other names get `400`, which stops DNS-rebinding pages in a browser from reaching a local server.
            Default (`None`): [`run`] sets [`LOOPBACK_HOSTS`] when binding a loopback address, else `("*",)`.
    """

    model_name: str = "dspark"
    max_queue: int = 32
    max_prompt_tokens: int = 2048
    max_new_tokens: int = 512
    api_key: str | None = None
    shutdown_timeout: float = 30.0
    retry_after: int = 1
    max_body_bytes: int = 1 << 20
    body_timeout: float = 30.0
    max_prompt_chars: int | None = None
    max_stop_strings: int = 4
    max_stop_chars: int = 256
    allowed_hosts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        lows = {"max_queue": 0, "max_prompt_tokens": 1, "max_new_tokens": 1, "max_body_bytes": 1024}
        lows |= {"max_stop_strings": 0, "max_stop_chars": 1, "max_prompt_chars": 1}
        for name, low in lows.items():
            value = getattr(self, name)
            if value is None and name == "max_prompt_chars":
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}.")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}.")
        for name, low in (("shutdown_timeout", 0.0), ("body_timeout", 1e-3)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not low <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds >= {low:g}, got {value!r}.")
        if self.allowed_hosts is not None:
            if isinstance(self.allowed_hosts, str):
                self.allowed_hosts = tuple(h for h in self.allowed_hosts.split(","))
            hosts = tuple(_host_name(h) for h in self.allowed_hosts)
            if not hosts or not all(hosts):
                raise ValueError(
                    f"allowed_hosts must name at least one host (or '*' for any), got {self.allowed_hosts!r}."
                )
            self.allowed_hosts = hosts


def _host_name(host: str) -> str:
    """The name of a `Host` header value or an allow-list entry: no port, no IPv6 brackets, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    name, colon, port = host.rpartition(":")
    if colon and port.isdigit() and ":" not in name:  # "name:port" (a bare IPv6 address has several colons)
        host = name
    return host.rstrip(".")


def default_allowed_hosts(bind_host: str) -> tuple[str, ...]:
    """[`LOOPBACK_HOSTS`] for a loopback bind address, else any host (`("*",)`)."""
    if bind_host == "localhost":
        return LOOPBACK_HOSTS
    try:
        return LOOPBACK_HOSTS if ipaddress.ip_address(bind_host).is_loopback else ("*",)
    except ValueError:
        return ("*",)


def host_allowed(config: ServeConfig, scope) -> bool:
    """Whether the request of ASGI `scope` names an allowed host in its `Host` header."""
    allowed = config.allowed_hosts
    if allowed is None or "*" in allowed:
        return True
    host = next((value for key, value in scope["headers"] if key == b"host"), None)
    return host is not None and _host_name(host.decode("latin-1")) in allowed


def check_content_type(request, rejected) -> None:
    """`415` unless the body is declared JSON (`rejected`: the counter of refusals, by reason)."""
    given = request.headers.get("content-type")
    if (given or "").partition(";")[0].strip().lower() != "application/json":
        rejected.labels("content_type").inc()
        what = f"Content-Type {short(given)}" if given else "no Content-Type"
        raise ApiError(
            415,
            f"got {what}; send the body as JSON with 'Content-Type: application/json' (other types are refused "
            "so that a web page cannot post here as a form).",
            code="unsupported_media_type",
            headers=CLOSE,
        )


async def read_body(request, config: ServeConfig, rejected) -> bytes:
    """The body, refused with `413` past `max_body_bytes` (before reading it, when `Content-Length` says so)
    and with `408` if it has not all arrived after `body_timeout` seconds. Raises starlette's
    `ClientDisconnect` if the client leaves first."""
    cfg = config
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared) if len(declared) < 20 else cfg.max_body_bytes + 1
        except ValueError:
            raise ApiError(400, f"Content-Length {short(declared)} is not a number.", headers=CLOSE) from None
        if size > cfg.max_body_bytes:
            raise _too_large(cfg, rejected, f"{size:,} bytes")
    chunks, size = [], 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > cfg.max_body_bytes:
                raise _too_large(cfg, rejected, f"over {cfg.max_body_bytes:,} bytes")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), cfg.body_timeout)
    except asyncio.TimeoutError:
        rejected.labels("body_timeout").inc()
        raise ApiError(
            408,
            f"the request body did not arrive within {cfg.body_timeout:g} s (this server's body_timeout); "
            "send it at once.",
            code="body_timeout",
            headers=CLOSE,
        ) from None
    return b"".join(chunks)


def _too_large(config: ServeConfig, rejected, size: str) -> ApiError:
    rejected.labels("body_too_large").inc()
    return ApiError(
        413,
        f"the request body is {size}, but this server's limit (max_body_bytes) is "
        f"{config.max_body_bytes:,} bytes; send a shorter prompt.",
        code="max_body_bytes",
        headers=CLOSE,
    )


class HostCheck:
    """ASGI middleware: a request whose `Host` header is not in `allowed_hosts` gets `400` before any endpoint
    runs (a DNS-rebinding page reaches the server under its own domain name).

    Args:
        app: the ASGI app it wraps.
        config ([`ServeConfig`]): read at each request (so [`run`] may set `allowed_hosts` after the app is made).
        rejected: the counter of refusals, by reason.
    """

    def __init__(self, app, config: ServeConfig, rejected) -> None:
        self.app, self.config, self.rejected = app, config, rejected

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or host_allowed(self.config, scope):
            await self.app(scope, receive, send)
            return
        self.rejected.labels("host").inc()
        allowed = ", ".join(self.config.allowed_hosts)
        err = ApiError(
            400,
            f"this server answers the Host names {allowed} only; connect through one of those, or start it with "
            "--allowed-hosts naming this one.",
            code="invalid_host",
            headers=CLOSE,
        )
        await JSONResponse(err.body(), status_code=400, headers=err.headers)(scope, receive, send)
