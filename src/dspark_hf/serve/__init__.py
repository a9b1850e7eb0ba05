"""`dspark serve`: an OpenAI-compatible HTTP server on the batched [`DSparkEngine`].

- `create_app(engine, config)` returns the ASGI app (FastAPI) for an engine you built;
- `load_app(target, draft, ...)` loads a target and draft by Hub id or path (default: the default pair) and
  returns the app;
- `run(app, host, port)` serves it with uvicorn and drains it on SIGTERM (what `dspark serve` does).

Needs the `serve` extra (see `dspark_hf.extras`); `import dspark_hf` never imports this package.
See `docs/serving.md`.
"""

from __future__ import annotations

from ..extras import require

require("fastapi", "pydantic", "uvicorn", "prometheus_client", extra="serve")

from .app import ServeConfig, ServerState, create_app  # noqa: E402  (after the extra check)
from .launch import load_app, run  # noqa: E402

__all__ = ["ServeConfig", "ServerState", "create_app", "load_app", "run"]
