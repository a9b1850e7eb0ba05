"""The engine's one worker thread: the event loop hands it requests, it runs `DSparkEngine.step()` rounds.

The engine is not thread-safe, so exactly one thread touches it. HTTP handlers never call the engine: they put
commands (add, cancel) on a queue that the worker drains between rounds, and the worker hands each round's
events back to the handler's `asyncio.Queue` with `loop.call_soon_threadsafe`. A handler that is slow to read
(a slow client) only lets its own queue grow (bounded by its `max_tokens`); the batch never waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..decoding.engine import DSparkEngine, SamplingParams, StreamEvent

logger = logging.getLogger(__name__)


@dataclass
class Ticket:
    """One request on its way through the worker.

    Args:
        prompt (`list[int]`): the prompt's token ids.
        params ([`SamplingParams`]): how it is decoded.
        events (`asyncio.Queue`): receives the request's [`StreamEvent`]s, then, if the request ends without a
            finished event (engine failure, shutdown), one `Exception` saying why.
        request_id (`int`, *optional*): the engine's id, once the worker has added it.
    """

    prompt: list[int]
    params: SamplingParams
    events: asyncio.Queue
    request_id: int | None = None
    done: bool = field(default=False, repr=False)  # finished or cancelled in the engine
    released: bool = field(default=False, repr=False)  # the handler gave back its place in flight


class ShutdownCancelled(RuntimeError):
    """The server stopped before the request finished (its shutdown deadline passed)."""


class EngineWorker:
    """Runs `engine.step()` in a daemon thread while there is work; sleeps when there is none.

    Args:
        engine ([`DSparkEngine`]): the engine (used by this thread only from [`start`] on).
        loop (`asyncio.AbstractEventLoop`): the event loop whose queues receive the events.
        on_round (`callable`, *optional*): called in the worker thread after every round with the number of
            requests that round served (for the batch-size metric).
    """

    def __init__(self, engine: DSparkEngine, loop: asyncio.AbstractEventLoop, on_round=None) -> None:
        self.engine, self.loop, self.on_round = engine, loop, on_round
        self.lock = threading.Lock()  # held during a round; `locked_call` uses it to read the engine safely
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._tickets: dict[int, Ticket] = {}
        self._stop = False
        self._deadline: float | None = None
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self.error: BaseException | None = None  # set if the loop itself died (then /ready fails)

    # ------------------------------------------------------------------ called from the event loop
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """`bool`: whether the worker thread is running."""
        return self._thread.is_alive()

    def submit(self, ticket: Ticket) -> None:
        """Queue `ticket` for the engine (it joins the batch at the next round with room)."""
        self._commands.put(("add", ticket))
        self._wake.set()

    def cancel(self, ticket: Ticket) -> None:
        """Drop `ticket` from the engine at the next round boundary (no-op once it has finished)."""
        if not ticket.done:
            self._commands.put(("cancel", ticket))
            self._wake.set()

    def locked_call(self, fn):
        """`fn(engine)` between two rounds (blocks the caller while a round runs; use from a thread pool)."""
        with self.lock:
            return fn(self.engine)

    def drain(self, deadline: float) -> None:
        """Finish in-flight requests until `deadline` (`time.monotonic()`), then cancel what is left."""
        self._deadline = deadline
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current round and fail whatever is still in flight."""
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the worker thread
    def _run(self) -> None:
        try:
            while not self._stop:
                if self._apply_commands() and not self.engine.has_unfinished():
                    self._settle()
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    self._fail_all(ShutdownCancelled("the server shut down before this request finished"))
                if not self.engine.has_unfinished():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                try:
                    with self.lock:
                        events = self.engine.step()
                except Exception as err:  # a failed round fails its requests, not the server
                    logger.exception("engine round failed; failing the requests in flight")
                    self._fail_all(RuntimeError(f"the engine failed during this request: {err!r}"))
                    continue
                self._deliver(events)
        except BaseException as err:  # pragma: no cover - a bug in the loop itself; /ready reports it
            self.error = err
            logger.exception("the engine worker stopped")
        finally:
            self._fail_all(ShutdownCancelled("the server stopped before this request finished"))

    def _apply_commands(self) -> bool:
        """Apply the queued adds and cancels; returns whether a request was cancelled in the engine."""
        cancelled = False
        while True:
            try:
                kind, ticket = self._commands.get_nowait()
            except queue.Empty:
                return cancelled
            if kind == "add":
                if ticket.done:  # cancelled before it reached the engine
                    continue
                with self.lock:
                    ticket.request_id = self.engine.add_request(ticket.prompt, ticket.params)
                self._tickets[ticket.request_id] = ticket
            elif ticket.request_id is not None and not ticket.done:
                with self.lock:
                    self.engine.cancel(ticket.request_id)
                self._tickets.pop(ticket.request_id, None)
                ticket.done = cancelled = True
            else:
                ticket.done = True  # cancel before add: the add is skipped

    def _settle(self) -> None:
        """An empty round, after a cancel that left the engine idle: the engine records its gauges (active
        requests, KV tokens) at the end of a round, and without one `/metrics` would show the cancelled request
        as still active."""
        try:
            with self.lock:
                self._deliver(self.engine.step())
        except Exception:  # a gauge refresh must not stop the worker
            logger.exception("the engine's empty round after a cancel failed")

    def _deliver(self, events: list[StreamEvent]) -> None:
        served = set()
        for event in events:
            ticket = self._tickets.get(event.request_id)
            if event.token_ids:
                served.add(event.request_id)
            if ticket is None:
                continue
            if event.finished:
                ticket.done = True
                del self._tickets[event.request_id]
            self.loop.call_soon_threadsafe(ticket.events.put_nowait, event)
        if self.on_round is not None and served:
            self.on_round(len(served))

    def _fail_all(self, error: Exception) -> None:
        with self.lock:
            for rid, ticket in list(self._tickets.items()):
                self.engine.cancel(rid)
                ticket.done = True
                self._put(ticket, error)
            self._tickets.clear()
        while True:  # requests that never reached the engine
            try:
                kind, ticket = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add" and not ticket.done:
                ticket.done = True
                self._put(ticket, error)

    def _put(self, ticket: Ticket, item) -> None:
        try:
            self.loop.call_soon_threadsafe(ticket.events.put_nowait, item)
        except RuntimeError:  # the event loop is already closed (process exit)
            pass
