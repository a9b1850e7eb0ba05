"""The ASGI app: OpenAI-compatible endpoints over one [`DSparkEngine`], with admission control and metrics.

Request path: check the `Host` header (allow-list), the API key and the `Content-Type` → read the body, at most
`max_body_bytes` within `body_timeout` seconds → parse and validate it (strict schema) → check the model name and
the per-request limits (prompt length in characters, then in tokens) → admit it if fewer than
`max_batch_size + max_queue` requests are in flight (else `429`) → hand it to the engine's worker thread, which
adds it to the running batch at the next round → relay the worker's events to the client (all at once, or as
server-sent events) while watching for the client to leave. Every check before admission is bounded work on
the event loop; prompts are tokenized in a thread of their own.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from ..decoding.engine import DSparkEngine, RequestOutput, StreamEvent
from .limits import HostCheck, ServeConfig, check_content_type, read_body
from .metrics import ServeMetrics
from .prompts import PromptTokenizer
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest, finish_reason, new_id, now, parse, short
from .stops import StopMatcher
from .worker import EngineWorker, ShutdownCancelled, Ticket

logger = logging.getLogger(__name__)
__all__ = ["ServeConfig", "ServerState", "create_app"]


class _Disconnected(Exception):
    pass


class ServerState:
    """What the handlers share: the engine's worker, limits, counters (one per app, on `app.state.server`)."""

    def __init__(self, engine: DSparkEngine, config: ServeConfig) -> None:
        if engine.tokenizer is None:
            raise ValueError("the server needs a tokenizer: DSparkEngine(target, draft, tokenizer, ...).")
        self.engine, self.config = engine, config
        self.prompts = PromptTokenizer(engine.tokenizer, config.max_prompt_tokens, config.max_prompt_chars)
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
        self.prompts.close()

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
                f"model {short(model)} is not served here; this server serves {self.config.model_name!r} "
                "(see GET /v1/models), or leave 'model' out.",
                param="model",
                code="model_not_found",
            )

    def admit(self, req, ids: list[int], param: str) -> Ticket:
        cfg = self.config
        if not ids:
            raise ApiError(400, "the prompt is empty; send at least one token of text.", param=param)
        if len(ids) > cfg.max_prompt_tokens:
            raise self.prompts.too_long(f"{len(ids)} tokens", param)
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


async def _client_gone(request) -> None:
    """Return once the client has closed the connection. Only for after the body has been read: the next ASGI
    message is then `http.disconnect`, which the server sends as soon as it sees the connection close."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.01)  # not expected once the body is read; never spin


class _Run:
    """One admitted request as the handler sees it: events in, text out (stop strings applied)."""

    def __init__(self, state: ServerState, ticket: Ticket, stops: list[str], arrived: float) -> None:
        self.state, self.ticket = state, ticket
        self.stops = StopMatcher(stops) if stops else None
        self.arrived = self.last = arrived
        self.text, self.sent = "", 0
        self.token_ids: list[int] = []
        self.output: RequestOutput | None = None
        self.reason: str | None = None  # OpenAI finish reason once finished
        self.stream_started = False
        self._getter: asyncio.Task | None = None

    async def next_event(self, gone: asyncio.Future | None = None):
        """The next event; with `gone` (the client-left watcher), raise `_Disconnected` as soon as it is done."""
        queue = self.ticket.events
        if gone is None:
            return await queue.get()
        if self._getter is None:
            self._getter = asyncio.ensure_future(queue.get())
        await asyncio.wait({self._getter, gone}, return_when=asyncio.FIRST_COMPLETED)
        if self._getter.done():
            item, self._getter = self._getter.result(), None
            return item
        self._getter.cancel()
        self._getter = None
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
        new = event.text or ""
        self.text += new
        if event.finished:
            self.output = event.output
            self.reason = finish_reason(event.output.finish_reason)
        safe = len(self.text)
        if self.stops is not None:
            hit = self.stops.feed(new)  # reads each new character once per stop string
            if hit is not None:
                self.text = self.text[:hit]
                safe = len(self.text)
                if self.reason is None:  # the engine is still generating: drop it from the batch now
                    self.reason = "stop"
                    self.state.release(self.ticket, reason="stop")
                else:
                    self.reason = "stop"
            elif self.reason is None:  # hold back a tail that may be the start of a stop string
                safe -= self.stops.pending
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
    app.add_middleware(HostCheck, config=state.config, rejected=state.metrics.rejected)

    def error_response(request, err: ApiError):
        state.metrics.requests.labels(request.url.path, str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    app.add_exception_handler(ApiError, error_response)

    limits = {"max_stop_strings": state.config.max_stop_strings, "max_stop_chars": state.config.max_stop_chars}

    async def complete(request, model_cls, chat: bool):
        arrived = time.perf_counter()
        path = request.url.path
        state.check_key(request)
        check_content_type(request, state.metrics.rejected)
        try:
            raw = await read_body(request, state.config, state.metrics.rejected)
        except ClientDisconnect:  # the client left mid-body: nothing to answer, nothing worth a traceback
            state.metrics.requests.labels(path, "499").inc()
            return Response(status_code=499)
        req = parse(model_cls, raw, limits)
        del raw
        state.check_model(req.model)
        ticket = state.admit(req, await state.prompts.prompt_ids(req), "messages" if chat else "prompt")
        run = _Run(state, ticket, req.stop_strings(), arrived)
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            try:
                # wait for the first event before answering, so a refused prompt is a 400, not a broken stream
                first = run.feed(await run.next_event(gone))
            except _Disconnected:
                state.release(ticket)
                state.metrics.requests.labels(path, "499").inc()
                return JSONResponse({}, status_code=499)
            except BaseException:
                state.release(ticket)
                raise
            if req.stream:  # the streaming response watches for the client itself
                gone.cancel()
                return _EventStream(_sse(state, run, req, chat, first, path), state, run, path)
            try:
                while run.reason is None:
                    run.feed(await run.next_event(gone))
            except _Disconnected:
                state.metrics.requests.labels(path, "499").inc()
                return JSONResponse({}, status_code=499)
            finally:
                state.release(ticket)
        finally:
            gone.cancel()
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

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        """Empty the engine's prefix cache (e.g. between benchmark levels, so that no prompt is served from an
        earlier level's cache; vLLM's dev-mode endpoint of the same name). Needs the API key when one is set."""
        state.check_key(request)
        if state.worker is None:
            had = engine.reset_prefix_cache()
        else:  # between two rounds
            had = await asyncio.to_thread(state.worker.locked_call, lambda e: e.reset_prefix_cache())
        state.metrics.requests.labels(request.url.path, "200").inc()
        return JSONResponse({"reset": had})

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
