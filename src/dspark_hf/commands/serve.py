"""`dspark serve`: the OpenAI-compatible server (see `dspark_hf.serve`), on 127.0.0.1 unless told otherwise.

Every option also reads an environment variable (`DSPARK_<OPTION>`, e.g. `DSPARK_PORT`, `DSPARK_API_KEY`),
which is how the `Dockerfile` configures it; a flag on the command line wins over the variable.
"""

from __future__ import annotations

import argparse
import os


def _env(name: str, default=None, kind=str):
    value = os.environ.get(f"DSPARK_{name}")
    if value is None or value == "":
        return default
    try:
        return kind(value)
    except ValueError:
        raise SystemExit(f"dspark serve: DSPARK_{name}={value!r} is not a valid {kind.__name__}.") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", default=_env("TARGET"), help="target folder or Hub id (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--draft",
        default=_env("DRAFT"),
        help="draft folder, Hub id, shipped draft name or 'fresh' (default: the shipped draft, else fresh)",
    )
    parser.add_argument(
        "--policy",
        default=_env("POLICY"),
        help="verification policy, e.g. adaptive, hardware_aware, fixed:3; 'none' serves without speculation "
        "(default: hardware_aware_uniform for a calibrated draft, else fixed)",
    )
    parser.add_argument(
        "--kernels",
        choices=("stock", "packed", "exact"),
        default=_env("KERNELS"),
        help="CPU kernels of every forward, with or without speculation: exact (batch-invariant, the default for "
        "a float32 target on the CPU), stock (PyTorch's own; the default elsewhere) or packed",
    )
    parser.add_argument(
        "--lookup",
        choices=("on", "off"),
        default=_env("LOOKUP"),
        help="prompt lookup before drafting: copy a recurring continuation from the request's own context and "
        "verify it (exact; a measured gate stops it at batch sizes where it does not pay). Default: the draft's "
        "setting (on for the shipped drafts)",
    )
    parser.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=_env("PORT", 8000, int))
    parser.add_argument("--max-batch-size", type=int, default=_env("MAX_BATCH_SIZE", 8, int))
    parser.add_argument(
        "--max-queue",
        type=int,
        default=_env("MAX_QUEUE", 32, int),
        help="requests admitted beyond the running batch; more get 429 (default: 32)",
    )
    parser.add_argument("--max-prompt-tokens", type=int, default=_env("MAX_PROMPT_TOKENS", 2048, int))
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=_env("MAX_NEW_TOKENS", 512, int),
        help="largest max_tokens a request may ask for, and the default (default: 512)",
    )
    parser.add_argument(
        "--api-key", default=_env("API_KEY"), help="require 'Authorization: Bearer KEY' on /v1/* (or DSPARK_API_KEY)"
    )
    parser.add_argument("--model-name", default=_env("MODEL_NAME"), help="id listed by /v1/models (default: target)")
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=_env("SHUTDOWN_TIMEOUT", 30.0, float),
        help="seconds in-flight requests get to finish after SIGTERM (default: 30)",
    )
    parser.add_argument("--dtype", default=_env("DTYPE"), help="weights' dtype: float32 (default), bfloat16, ...")
    parser.add_argument("--device", default=_env("DEVICE"), help="e.g. cuda (default: the CPU)")
    parser.add_argument("--threads", type=int, default=_env("THREADS", None, int), help="torch CPU threads")
    parser.add_argument("--log-level", default=_env("LOG_LEVEL", "info"), help="uvicorn log level (default: info)")


def main(args: argparse.Namespace) -> int:
    import logging

    from dspark_hf.commands._common import UserError, model_source
    from dspark_hf.default_model import SHIPPED_DRAFTS
    from dspark_hf.extras import require

    require("fastapi", "uvicorn", "prometheus_client", extra="serve")  # before loading any model
    from dspark_hf.serve import ServeConfig, load_app, run

    try:
        config = ServeConfig(
            max_queue=args.max_queue,
            max_prompt_tokens=args.max_prompt_tokens,
            max_new_tokens=args.max_new_tokens,
            api_key=args.api_key,
            shutdown_timeout=args.shutdown_timeout,
        )
    except ValueError as err:
        raise UserError(str(err)) from err
    if args.model_name:
        config.model_name = args.model_name
    if args.max_batch_size < 1:
        raise UserError(f"--max-batch-size must be >= 1, got {args.max_batch_size}.")
    model_source(args.target, "--target")
    model_source(args.draft, "--draft", names=(*SHIPPED_DRAFTS, "fresh"))
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    app = load_app(
        args.target, args.draft, policy=args.policy, max_batch_size=args.max_batch_size, dtype=args.dtype,
        device=args.device, config=config, kernels=args.kernels, lookup=args.lookup,
    )  # fmt: skip
    run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
