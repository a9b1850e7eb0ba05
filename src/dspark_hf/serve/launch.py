"""Loading the models into an app, and running it with uvicorn (SIGTERM drains instead of dropping)."""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import socket
import threading

from .._threads import run_in_fresh_thread
from ..decoding.engine import DEFAULT_MAX_PREFILL_TOKENS, DSparkEngine
from .app import ServeConfig, create_app
from .limits import default_allowed_hosts

logger = logging.getLogger(__name__)


def load_app(
    target: str | None = None,
    draft: str | None = None,
    policy=None,
    max_batch_size: int = 8,
    dtype=None,
    device=None,
    config: ServeConfig | None = None,
    kernels: str | None = None,
    lookup=None,
    cuda_graphs: bool | None = None,
    compiled: bool | None = None,
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
    prefix_cache_bytes: int | None = None,
):
    """Load a target and draft and return the app serving them.

    Args:
        target (`str`, *optional*): target folder or Hub id (default: SmolLM2-135M-Instruct, offline).
        draft (`str`, *optional*): draft folder, Hub id, shipped draft name or `"fresh"` (default: the shipped
            draft for the default target, else a fresh, untrained one), see `dspark_hf.default_model.load_draft`.
        policy (`str`, *optional*): verification policy (see [`resolve_policy`]); `"none"` serves without
            speculation. This and the other options (`kernels`, `lookup`, `cuda_graphs`, `compiled`) are the call
            level of `dspark_hf.decoding.options.resolve_options`, which the engine calls: unset, the draft's own
            defaults apply (its `generation_config.json`), then the library's, exactly as in `generate()`.
        max_batch_size (`int`, *optional*, defaults to 8): requests decoded together.
        dtype (`str` or `torch.dtype`, *optional*): weights' dtype (default fp32).
        device (`str`, *optional*): e.g. `"cuda"` (default: the CPU).
        config ([`ServeConfig`], *optional*): limits and identity; `model_name` defaults to the target's name.
        kernels (`str`, *optional*): the engine's kernel mode (`"stock"`, `"packed"`, `"exact"`, `"exact-bf16"`, see
            `dspark_hf.kernels`), with or without speculation (library default: `default_kernels(target)`).
        lookup (`bool`, *optional*): prompt lookup before drafting (see [`DSparkEngine`]).
        cuda_graphs (`bool`, *optional*): the draft step as a CUDA graph (see [`DSparkEngine`]).
        compiled (`bool`, *optional*): the drafting round as compiled calls where eligible (see [`DSparkEngine`]).
        max_prefill_tokens (`int`, *optional*): most prompt tokens prefilled per engine step (the engine's
            default, 512; see [`DSparkEngine`]).
        prefix_cache_bytes (`int`, *optional*): bytes of the engine's prefix cache (`0`: off; unset, the engine's
            default: 256 MiB on the exact kernels, off elsewhere; see [`DSparkEngine`]).

    Returns:
        `fastapi.FastAPI`
    """
    from ..default_model import DEFAULT_TARGET_HUB_ID, load_draft, load_target

    def load_engine() -> DSparkEngine:
        target_model, tokenizer = load_target(target, dtype=dtype, device=device)
        draft_model = None
        if policy != "none":
            draft_model, fresh = load_draft(target_model, draft)
            if fresh:
                logger.warning(
                    "serving with a fresh, untrained draft: output is exact, but nearly every draft is rejected"
                )
        return DSparkEngine(
            target_model,
            draft_model,
            tokenizer,
            policy=policy,
            max_batch_size=max_batch_size,
            kernels=kernels,
            lookup=lookup,
            cuda_graphs=cuda_graphs,
            compiled=compiled,
            max_prefill_tokens=max_prefill_tokens,
            prefix_cache_bytes=prefix_cache_bytes,
        )

    # Loading (and the SPS measurement the engine may make) runs torch kernels; done on this thread, it would
    # leave this thread an OpenMP pool next to the engine worker's, which slows every round (see `_threads`).
    engine = run_in_fresh_thread(load_engine)
    config = config or ServeConfig()
    if config.model_name == ServeConfig.model_name:
        config.model_name = target or DEFAULT_TARGET_HUB_ID
    logger.info(
        "engine ready: policy %s, kernels %s, lookup %s, max_batch_size %d",
        engine.policy, engine.kernels, engine.lookup, max_batch_size,
    )  # fmt: skip
    return create_app(engine, config)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port`, not yet listening (connections are refused until [`run`] serves on it).

    `dspark serve` binds before loading the models, so that a port in use is reported at once instead of after
    the load. Raises `OSError` (`socket.gaierror` for a host name that does not resolve).
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def run(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", sock=None) -> None:
    """Serve `app` until SIGTERM or SIGINT, then drain: stop admitting, give in-flight requests the config's
    `shutdown_timeout` to finish, cancel the rest, return (the process then exits 0).

    `sock` (from [`bind_socket`]) serves on an already bound socket; `host` and `port` then only name it. A
    config without `allowed_hosts` gets the loopback names when `host` is a loopback address (else any name).
    """
    import uvicorn

    state = app.state.server
    if state.config.allowed_hosts is None:
        state.config.allowed_hosts = default_allowed_hosts(host)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        # uvicorn's own deadline is a backstop: the worker cancels what is left at shutdown_timeout
        timeout_graceful_shutdown=state.config.shutdown_timeout + 5,
        lifespan="on",
    )
    # everything loaded so far (the models, torch, transformers: millions of objects) lives as long as the server:
    # frozen, the collector's full passes skip it (they stalled rounds by milliseconds, on the engine's thread)
    gc.collect()
    gc.freeze()
    _DrainingServer(config, state).run(sockets=None if sock is None else [sock])


class _DrainingServer:
    """uvicorn's server, with SIGTERM/SIGINT starting the drain and not re-raised after it (so exit code 0)."""

    def __new__(cls, config, state):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                state.begin_drain()
                super().handle_exit(sig, frame)

            @contextlib.contextmanager
            def capture_signals(self):
                # uvicorn re-raises a captured signal once it has shut down, which makes the exit status
                # 128 + SIGTERM; a drained shutdown is the normal end of this server, so it is not re-raised
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)

        return Server(config)
