"""`dspark serve`: the OpenAI-compatible server (see `dspark_hf.serve`), on 127.0.0.1 unless told otherwise.

Every option also reads an environment variable (`DSPARK_<OPTION>`, e.g. `DSPARK_PORT`, `DSPARK_API_KEY`),
which is how the `Dockerfile` configures it; a flag on the command line wins over the variable.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
from dataclasses import fields
from pathlib import Path

from .arguments import SpeculationArguments, add_model_arguments, add_speculation_arguments


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
        "--draft",
        default=_env("DRAFT"),
        help="draft folder, Hub id, shipped draft name or 'fresh' (default: the shipped draft, else fresh)",
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
        "--max-prefill-tokens",
        type=int,
        default=_env("MAX_PREFILL_TOKENS", 512, int),  # the engine's DEFAULT_MAX_PREFILL_TOKENS (no torch import here)
        help="most prompt tokens prefilled per engine step, riding in the decoding rows' forward; lower evens out "
        "the gaps between a stream's tokens while prompts arrive, higher starts them sooner (default: 512)",
    )
    parser.add_argument(
        "--prefix-cache-mib",
        type=int,
        default=_env("PREFIX_CACHE_MIB", None, int),
        help="MiB of the prefix cache: prompts that begin like earlier ones (a system message, earlier turns) "
        "copy that beginning's keys and values instead of prefilling it; exact on the exact kernels, the only "
        "ones it runs on; 0 turns it off; POST /reset_prefix_cache empties it (default: 256 on the exact "
        "kernels, off elsewhere)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=_env("MAX_NEW_TOKENS", 512, int),
        help="largest max_tokens a request may ask for, and the default (default: 512)",
    )
    limits = parser.add_argument_group("limits (see 'Limits and hardening' in docs/serving.md)")
    limits.add_argument(
        "--max-body-bytes",
        type=int,
        default=_env("MAX_BODY_BYTES", 1 << 20, int),
        help="largest request body; larger ones get 413 before they are read (default: 1048576, 1 MiB)",
    )
    limits.add_argument(
        "--body-timeout",
        type=float,
        default=_env("BODY_TIMEOUT", 30.0, float),
        help="seconds a request body may take to arrive; slower ones get 408 (default: 30)",
    )
    limits.add_argument(
        "--max-prompt-chars",
        type=int,
        default=_env("MAX_PROMPT_CHARS", None, int),
        help="longest prompt text, checked before tokenizing (default: --max-prompt-tokens x the longest token)",
    )
    limits.add_argument(
        "--max-stop-strings", type=int, default=_env("MAX_STOP_STRINGS", 4, int), help="most stop strings (default: 4)"
    )
    limits.add_argument(
        "--max-stop-chars",
        type=int,
        default=_env("MAX_STOP_CHARS", 256, int),
        help="longest stop string, in characters (default: 256)",
    )
    limits.add_argument(
        "--allowed-hosts",
        default=_env("ALLOWED_HOSTS"),
        help="comma-separated Host header names to answer, '*' for any (default: localhost, 127.0.0.1 and ::1 "
        "when --host is a loopback address, else any)",
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
    parser.add_argument("--log-level", default=_env("LOG_LEVEL", "info"), help="uvicorn log level (default: info)")
    # DSPARK_TARGET, DSPARK_POLICY etc. set these flags' defaults; every forward runs on --kernels
    models = {"target": _env("TARGET"), "dtype": _env("DTYPE"), "device": _env("DEVICE")}
    add_model_arguments(parser, defaults={**models, "threads": _env("THREADS", None, int)})
    add_speculation_arguments(parser, defaults={f.name: _env(f.name.upper()) for f in fields(SpeculationArguments)})


def _folder_config(value: str | None, flag: str) -> dict | None:
    """The parsed `config.json` of a local folder argument; `None` for the default, a Hub id or a name."""
    from dspark_hf.commands._common import UserError

    if value is None or not Path(value).expanduser().is_dir():
        return None
    config = Path(value).expanduser() / "config.json"
    if not config.is_file():
        raise UserError(
            f"{flag} {value!r} has no config.json, so it is not a model folder; pass a folder written by "
            "save_pretrained() (or a Hub repo id)."
        )
    try:
        cfg = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise UserError(f"{flag} {value!r}: its config.json cannot be read as JSON ({err}).") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{flag} {value!r}: its config.json is not a JSON object.")
    return cfg


def _is_draft_config(cfg: dict) -> bool:
    from dspark_hf.model.formats import is_deepspec_config
    from dspark_hf.model.speculators_format import is_speculators_config

    return cfg.get("model_type") == "dspark" or is_speculators_config(cfg) or is_deepspec_config(cfg)


def check_arguments(args: argparse.Namespace) -> None:
    """Every check of the arguments that needs no model: run before the (slow) load, each failure one line.

    Raises:
        `UserError`: a port out of range, an unknown policy, a `--target` folder that is not a model (or is a
        draft), a `--draft` folder that is not a draft.
    """
    from dspark_hf.commands._common import UserError, model_source
    from dspark_hf.default_model import SHIPPED_DRAFTS

    if args.max_batch_size < 1:
        raise UserError(f"--max-batch-size must be >= 1, got {args.max_batch_size}.")
    if args.max_prefill_tokens < 1:
        raise UserError(f"--max-prefill-tokens must be >= 1, got {args.max_prefill_tokens}.")
    if args.prefix_cache_mib is not None and args.prefix_cache_mib < 0:
        raise UserError(f"--prefix-cache-mib must be >= 0, got {args.prefix_cache_mib}.")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be a TCP port, 0 to 65535, got {args.port}.")
    # the policy's spelling only; whether the draft has the confidence head a policy reads is known after loading
    SpeculationArguments.from_namespace(args).check()
    model_source(args.target, "--target")
    model_source(args.draft, "--draft", names=(*SHIPPED_DRAFTS, "fresh"))
    target = _folder_config(args.target, "--target")
    if target is not None:
        if _is_draft_config(target):
            raise UserError(
                f"--target {args.target!r} is a draft folder; pass the target model with --target and the draft "
                "with --draft."
            )
        folder = Path(args.target).expanduser()
        tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if not any((folder / name).is_file() for name in tokenizer_files):
            raise UserError(
                f"--target {args.target!r} has no tokenizer files ({', '.join(tokenizer_files)}); the server "
                "needs the target's tokenizer saved next to it (tokenizer.save_pretrained(folder))."
            )
    if args.draft not in SHIPPED_DRAFTS and args.policy != "none":
        draft = _folder_config(args.draft, "--draft")
        if draft is not None and not _is_draft_config(draft):
            raise UserError(
                f"--draft {args.draft!r} is not a draft folder: its config.json has model_type "
                f"{str(draft.get('model_type'))[:40]!r}, not a DSpark draft (dspark, speculators or DeepSpec "
                "format). Pass a draft trained for this target, 'fresh', or a shipped draft name."
            )


def main(args: argparse.Namespace) -> int:
    import logging

    from dspark_hf.commands._common import UserError
    from dspark_hf.extras import require

    require("fastapi", "uvicorn", "prometheus_client", extra="serve")  # before loading any model
    from dspark_hf.serve import ServeConfig, load_app, run
    from dspark_hf.serve.launch import bind_socket

    try:
        config = ServeConfig(
            max_queue=args.max_queue,
            max_prompt_tokens=args.max_prompt_tokens,
            max_new_tokens=args.max_new_tokens,
            api_key=args.api_key,
            shutdown_timeout=args.shutdown_timeout,
            max_body_bytes=args.max_body_bytes,
            body_timeout=args.body_timeout,
            max_prompt_chars=args.max_prompt_chars,
            max_stop_strings=args.max_stop_strings,
            max_stop_chars=args.max_stop_chars,
            allowed_hosts=args.allowed_hosts,
        )
    except ValueError as err:
        raise UserError(str(err)) from err
    if args.model_name:
        config.model_name = args.model_name
    check_arguments(args)
    # bound (not listening) before the load: a port in use is reported now, not after a minute of loading
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise UserError(
                f"--port {args.port}: {args.host}:{args.port} is already in use by another process; stop it or "
                "pick another port."
            ) from None
        raise UserError(f"--host {args.host!r} --port {args.port}: cannot listen there ({err}).") from None
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    speculation = SpeculationArguments.from_namespace(args).call()  # the call level of the engine's options
    prefix_bytes = None if args.prefix_cache_mib is None else args.prefix_cache_mib * 2**20
    app = load_app(
        args.target, args.draft, max_batch_size=args.max_batch_size, dtype=args.dtype, device=args.device,
        config=config, max_prefill_tokens=args.max_prefill_tokens, prefix_cache_bytes=prefix_bytes, **speculation,
    )  # fmt: skip
    run(app, host=args.host, port=args.port, log_level=args.log_level, sock=sock)
    return 0
