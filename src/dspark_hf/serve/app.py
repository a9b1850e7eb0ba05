"""The ASGI app: OpenAI-compatible endpoints over one [`DSparkEngine`], with admission control and metrics.

Request path: parse and validate the body (strict schema) → check the API key, the model name and the
per-request limits → admit it if fewer than `max_batch_size + max_queue` requests are in flight (else `429`)
→ hand it to the engine's worker thread, which adds it to the running batch at the next round → relay the
worker's events to the client (all at once, or as server-sent events).
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import time
from collections.abc import Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..decoding.engine import DSparkEngine, RequestOutput, StreamEvent
from .metrics import ServeMetrics
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest, finish_reason, new_id, now, parse
from .worker import EngineWorker, ShutdownCancelled, Ticket

logger = logging.getLogger(__name__)


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
    """

    model_name: str = "dspark"
    max_queue: int = 32
    max_prompt_tokens: int = 2048
    max_new_tokens: int = 512
    api_key: str | None = None
    shutdown_timeout: float = 30.0
    retry_after: int = 1

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_prompt_tokens", "max_new_tokens"):
            low = 0 if name == "max_queue" else 1
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}.")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}.")


class _Disconnected(Exception):
    pass


class ServerState:
    """What the handlers share: the engine's worker, limits, counters (one per app, on `app.state.server`)."""

    def __init__(self, engine: DSparkEngine, config: ServeConfig) -> None:
        if engine.tokenizer is None:
            raise ValueError("the server needs a tokenizer: DSparkEngine(target, draft, tokenizer, ...).")
        self.engine, self.config = engine, config
        # the worker decodes with engine.tokenizer; the handlers encode with their own copy (no shared state)
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.capacity = engine.max_batch_size + config.max_queue
        self.kernels = getattr(engine, "kernels", "stock")
        self.in_flight = 0
        self.draining = False
        self.worker: EngineWorker | None = None
        self.metrics = ServeMetrics(
            block_size=max(engine.gamma, 1),
            max_batch_size=engine.max_batch_size,
            max_queue=config.max_queue,
            in_flight=lambda: self.in_flight,
            queue_depth=lambda: max(0, self.in_flight - engine.metrics.active_requests),
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self, loop) -> None:
        self.worker = EngineWorker(self.engine, loop, on_round=self.metrics.batch.observe)
        self.worker.start()

    def begin_drain(self) -> None:
        """Stop admitting; in-flight requests get `shutdown_timeout` seconds, then are cancelled."""
        self.draining = True
        if self.worker is not None:
            self.worker.drain(time.monotonic() + self.config.shutdown_timeout)

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    @property
    def ready(self) -> bool:
        return self.worker is not None and self.worker.alive and not self.draining

    # ------------------------------------------------------------------ checks before admission
    def check_key(self, request) -> None:
        key = self.config.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        # constant-time comparison, whatever the header holds
        ok = hmac.compare_digest(given.strip().encode(), key.encode()) and scheme.lower() == "bearer"
        if not ok:
            what = "no Authorization header" if not header else "a wrong API key"
            raise ApiError(
                401,
                f"got {what}; send 'Authorization: Bearer <key>' with the key this server was started with "
                "(dspark serve --api-key, or the DSPARK_API_KEY environment variable).",
                code="invalid_api_key",
            )

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise ApiError(
                404,
                f"model {model!r} is not served here; this server serves {self.config.model_name!r} "
                "(see GET /v1/models), or leave 'model' out.",
                param="model",
                code="model_not_found",
            )

    def prompt_ids(self, req) -> list[int]:
        tok = self.tokenizer
        if isinstance(req, ChatCompletionRequest):
            messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in req.messages]
            try:
                ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            except Exception as err:  # the template's own checks (e.g. roles must alternate)
                raise ApiError(400, f"the chat template refused these messages: {err}", param="messages") from None
            ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
            return list(ids[0] if ids and isinstance(ids[0], list) else ids)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, f"one prompt per request, got {len(prompt)}; send them separately.", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(tok(prompt)["input_ids"])
        return list(prompt)

    def admit(self, req, ids: list[int], param: str) -> Ticket:
        cfg = self.config
        if not ids:
            raise ApiError(400, "the prompt is empty; send at least one token of text.", param=param)
        if len(ids) > cfg.max_prompt_tokens:
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens but this server's limit (max_prompt_tokens) is "
                f"{cfg.max_prompt_tokens}; shorten it.",
                param=param,
                code="max_prompt_tokens",
            )
        asked = req.requested_max_tokens()
        if asked is not None and asked > cfg.max_new_tokens:
            raise ApiError(
                400,
                f"max_tokens is {asked} but this server's limit (max_new_tokens) is {cfg.max_new_tokens}; "
                "ask for fewer.",
                param="max_tokens",
                code="max_new_tokens",
            )
        if self.draining:
            raise ApiError(503, "the server is shutting down and admits no new requests; retry on another replica.")
        if self.worker is None or not self.worker.alive:
            raise ApiError(503, "the engine is not running (see GET /ready); retry later.")
        if self.in_flight >= self.capacity:
            self.metrics.rejected.labels("queue_full").inc()
            raise ApiError(
                429,
                f"the server is at capacity ({self.in_flight} requests in flight: max_batch_size "
                f"{self.engine.max_batch_size} + max_queue {cfg.max_queue}); retry after {cfg.retry_after} s.",
                code="queue_full",
                headers={"Retry-After": str(cfg.retry_after)},
            )
        self.in_flight += 1
        ticket = Ticket(ids, req.sampling_params(asked or cfg.max_new_tokens), asyncio.Queue())
        self.worker.submit(ticket)
        return ticket

    def release(self, ticket: Ticket, reason: str | None = None) -> None:
        """The handler is done with `ticket`: free its place in flight; cancel it in the engine if unfinished."""
        if ticket.released:
            return
        ticket.released = True
        self.in_flight -= 1
        if not ticket.done:
            self.worker.cancel(ticket)
            self.metrics.cancelled.labels(reason or "disconnect").inc()


class _Run:
    """One admitted request as the handler sees it: events in, text out (stop strings applied)."""

    def __init__(self, state: ServerState, ticket: Ticket, stops: list[str], arrived: float) -> None:
        self.state, self.ticket, self.stops = state, ticket, stops
        self.arrived = self.last = arrived
        self.text, self.sent = "", 0
        self.token_ids: list[int] = []
        self.output: RequestOutput | None = None
        self.reason: str | None = None  # OpenAI finish reason once finished
        self.stream_started = False
        self._getter: asyncio.Task | None = None

    async def next_event(self, request=None, poll: float = 0.5):
        """The next event; with `request`, raise `_Disconnected` when the client leaves while waiting."""
        queue = self.ticket.events
        if request is None:
            return await queue.get()
        if self._getter is None:
            self._getter = asyncio.ensure_future(queue.get())
        while True:
            done, _ = await asyncio.wait({self._getter}, timeout=poll)
            if done:
                item, self._getter = self._getter.result(), None
                return item
            if await request.is_disconnected():
                self._getter.cancel()
                raise _Disconnected

    def feed(self, item) -> str:
        """Take one worker item; returns the text that may be sent now. Raises for a failed request."""
        if isinstance(item, ShutdownCancelled):
            self.state.metrics.cancelled.labels("shutdown").inc()
            raise ApiError(503, f"{item}; retry on another replica.", code="shutdown")
        if isinstance(item, Exception):
            raise ApiError(500, f"{item}", code="engine_error")
        event: StreamEvent = item
        if event.finished and event.output is not None and event.output.error:
            raise ApiError(400, event.output.error.split(": ", 1)[-1], code="invalid_prompt")
        t = time.perf_counter()
        self.state.metrics.observe_tokens(t - self.last, len(event.token_ids), first=not self.token_ids)
        self.last = t
        self.token_ids += event.token_ids
        self.text += event.text or ""
        if event.finished:
            self.output = event.output
            self.reason = finish_reason(event.output.finish_reason)
        safe = len(self.text)
        if self.stops:
            longest = max(map(len, self.stops))
            start = max(0, self.sent - longest + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i != -1]
            if hits:
                self.text = self.text[: min(hits)]
                safe = len(self.text)
                if self.reason is None:  # the engine is still generating: drop it from the batch now
                    self.reason = "stop"
                    self.state.release(self.ticket, reason="stop")
                else:
                    self.reason = "stop"
            elif self.reason is None:  # hold back a tail that may be the start of a stop string
                safe -= max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        out, self.sent = self.text[self.sent : safe], max(self.sent, safe)
        if self.reason is not None:
            self.state.metrics.observe_finished(self.output or _partial(self), t - self.arrived)
        return out

    def usage(self) -> dict:
        n_prompt, n_new = len(self.ticket.prompt), len(self.token_ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_new, "total_tokens": n_prompt + n_new}


def _partial(run: _Run) -> RequestOutput:
    return RequestOutput(-1, run.ticket.prompt, run.token_ids, finish_reason="stop")


def create_app(engine: DSparkEngine, config: ServeConfig | None = None):
    """The FastAPI (ASGI) app serving `engine`; run it with any ASGI server (`dspark serve` uses uvicorn).

    The engine's worker thread starts with the app's lifespan and stops with it.

    Args:
        engine ([`DSparkEngine`]): the engine, with a tokenizer. Its `max_batch_size` is the running batch.
        config ([`ServeConfig`], *optional*): limits, model name, API key.

    Returns:
        `fastapi.FastAPI`: the app; `app.state.server` is its [`ServerState`].
    """
    state = ServerState(engine, config or ServeConfig())

    @asynccontextmanager
    async def lifespan(app):
        state.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            state.stop()

    app = FastAPI(title="dspark serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state

    def error_response(request, err: ApiError):
        state.metrics.requests.labels(request.url.path, str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    app.add_exception_handler(ApiError, error_response)

    async def body_of(request) -> dict:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(
                400, f"the request body is not valid JSON ({err}); send a JSON object.", code="json_invalid"
            ) from None

    async def complete(request, model_cls, chat: bool):
        arrived = time.perf_counter()
        state.check_key(request)
        req = parse(model_cls, await body_of(request))
        state.check_model(req.model)
        ticket = state.admit(req, state.prompt_ids(req), "messages" if chat else "prompt")
        run = _Run(state, ticket, req.stop_strings(), arrived)
        path = request.url.path
        try:
            # wait for the first event before answering, so a refused prompt is a 400, not a broken stream
            first = run.feed(await run.next_event(request))
        except _Disconnected:
            state.release(ticket)
            state.metrics.requests.labels(path, "499").inc()
            return JSONResponse({}, status_code=499)
        except BaseException:
            state.release(ticket)
            raise
        if req.stream:
            return _EventStream(_sse(state, run, req, chat, first, path), state, run, path)
        try:
            while run.reason is None:
                run.feed(await run.next_event(request))
        except _Disconnected:
            state.metrics.requests.labels(path, "499").inc()
            return JSONResponse({}, status_code=499)
        finally:
            state.release(ticket)
        state.metrics.requests.labels(path, "200").inc()
        return JSONResponse(_full_body(state, run, req, chat))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, ChatCompletionRequest, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, CompletionRequest, chat=False)

    @app.get("/v1/models")
    async def models(request: Request):
        state.check_key(request)
        card = {"id": state.config.model_name, "object": "model", "created": now(), "owned_by": "dspark-hf"}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        alive = state.worker is not None and state.worker.alive
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/ready")
    async def ready():
        body = {"ready": state.ready, "draining": state.draining, "in_flight": state.in_flight}
        body["capacity"] = state.capacity
        body["kernels"] = state.kernels  # which forwards' outputs this server's are identical to
        return JSONResponse(body, status_code=200 if state.ready else 503)

    @app.get("/metrics")
    async def metrics():
        if state.worker is None:
            text = engine.metrics.to_prometheus()
        else:  # read the engine between two rounds
            text = await asyncio.to_thread(state.worker.locked_call, lambda e: e.metrics.to_prometheus())
        return Response(state.metrics.render(text), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


class _EventStream(StreamingResponse):
    """The SSE response; if the client leaves before the first chunk is sent, the body never starts (so its
    own cleanup never runs), and the request is released and counted here instead."""

    def __init__(self, body, state: ServerState, run: _Run, path: str) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._state, self._run, self._path = state, run, path

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._run.stream_started:
                self._state.release(self._run.ticket)
                self._state.metrics.requests.labels(self._path, "499").inc()


def _choice(run: _Run, req, chat: bool, text: str, delta: bool) -> dict:
    if chat:
        key = "delta" if delta else "message"
        choice = {"index": 0, key: {"content": text} if delta else {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text}
    choice["finish_reason"] = run.reason if not delta or run.reason else None
    return choice


def _full_body(state: ServerState, run: _Run, req, chat: bool) -> dict:
    choice = _choice(run, req, chat, run.text, delta=False)
    body = {
        "id": new_id("chatcmpl" if chat else "cmpl"),
        "object": "chat.completion" if chat else "text_completion",
        "created": now(),
        "model": state.config.model_name,
        "choices": [choice],
        "usage": run.usage(),
    }
    if req.return_token_ids:
        choice["token_ids"] = run.token_ids
        body["prompt_token_ids"] = run.ticket.prompt
    return body


async def _sse(state: ServerState, run: _Run, req, chat: bool, first: str, path: str):
    """Server-sent events: one chunk per round's text, a final chunk with the finish reason, `[DONE]`."""
    rid, created, model = new_id("chatcmpl" if chat else "cmpl"), now(), state.config.model_name
    kind = "chat.completion.chunk" if chat else "text_completion"
    sent_ids = 0

    def chunk(text: str, finished: bool) -> str:
        nonlocal sent_ids
        choice = _choice(run, req, chat, text, delta=True)
        if not finished:
            choice["finish_reason"] = None
        if req.return_token_ids:
            choice["token_ids"], sent_ids = run.token_ids[sent_ids:], len(run.token_ids)
        body = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}
        return f"data: {json.dumps(body)}\n\n"

    status = "499"  # unless the stream reaches its end
    run.stream_started = True
    try:
        if chat:
            role = {"id": rid, "object": kind, "created": created, "model": model}
            role["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
            yield f"data: {json.dumps(role)}\n\n"
        text = first
        while True:
            if text or (run.reason is None and req.return_token_ids):
                yield chunk(text, finished=False)
            if run.reason is not None:
                break
            try:
                text = run.feed(await run.next_event())
            except ApiError as err:  # shutdown or engine failure after the stream started
                status = str(err.status)
                yield f"data: {json.dumps(err.body())}\n\n"
                yield "data: [DONE]\n\n"
                return
        yield chunk("", finished=True)
        if req.include_usage():
            usage = {"id": rid, "object": kind, "created": created, "model": model, "choices": []}
            usage["usage"] = run.usage()
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
        status = "200"
    finally:
        state.release(run.ticket)
        state.metrics.requests.labels(path, status).inc()
