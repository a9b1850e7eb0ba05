"""`dspark serve`: an OpenAI-compatible HTTP server on the batched [`DSparkEngine`].

- `create_app(engine, config)` returns the ASGI app (FastAPI) for an engine you built;
- `load_app(target, draft, ...)` loads a target and draft by Hub id or path (default: the default pair) and
  returns the app;
- `run(app, host, port)` serves it with uvicorn and drains it on SIGTERM (what `dspark serve` does).

Needs the `serve` extra (`pip install "dspark-hf[serve]"`); `import dspark_hf` never imports this package.
See `docs/serving.md`.
"""

from __future__ import annotations

try:
    import fastapi  # noqa: F401
    import pydantic  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the install
    raise ImportError("dspark_hf.serve needs FastAPI and uvicorn: pip install 'dspark-hf[serve]'.") from err

from .app import ServeConfig, ServerState, create_app
from .launch import load_app, run

__all__ = ["ServeConfig", "ServerState", "create_app", "load_app", "run"]
