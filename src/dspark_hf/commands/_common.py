"""What every `dspark` subcommand shares: the user-error type and checks of model arguments made up front.

A mistake on the command line (a folder that does not exist, an unknown policy) is a `UserError`: `dspark`
prints one line saying what to do and exits with status 2. Tracebacks are left for bugs.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse


class UserError(Exception):
    """A bad command-line argument; `dspark` prints the message as one line and exits with status 2."""


# what the Hub accepts as a repo id: "name" (legacy, no namespace) or "namespace/name"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]{0,95}(/[A-Za-z0-9][\w.\-]{0,95})?")


def looks_like_path(value: str) -> bool:
    """Whether `value` can only mean a local path (it cannot be a Hub repo id)."""
    return (
        value.startswith(("/", ".", "~"))
        or value.endswith(("/", os.sep))
        or "\\" in value
        or value.count("/") > 1
        or not _HUB_ID.fullmatch(value)
    )


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP connect to the Hub endpoint, so an unreachable Hub is known in seconds, not after retries."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}:
        return False
    try:
        from huggingface_hub import constants

        endpoint = constants.ENDPOINT
    except Exception:  # noqa: BLE001 - no Hub client: nothing to probe
        endpoint = "https://huggingface.co"
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - an odd id or cache layout: not cached
        return False


def model_source(value: str | None, flag: str, names: tuple[str, ...] = ()) -> str | None:
    """Check a model argument (`--target`, `--draft`) before anything is loaded.

    Args:
        value: what the user passed (`None`: the command's default).
        flag: the option's name, for the message (e.g. `"--draft"`).
        names: other accepted names that are neither paths nor Hub ids (shipped draft names, `"fresh"`).

    Returns:
        `value` unchanged (a `~` is expanded for an existing folder).

    Raises:
        `UserError`: a path that does not exist, a value that is neither a folder nor a Hub repo id, or a Hub id
        while the Hub cannot be reached and the repo is not in the local Hub cache.
    """
    if value is None or value in names:
        return value
    path = Path(value).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{flag} {value!r} is a file; pass the model's folder (the one with config.json).")
        return str(path)
    also = f", a name ({', '.join(names)})" if names else ""
    if looks_like_path(value):
        raise UserError(f"{flag} {value!r}: no such folder. Pass an existing model folder{also} or a Hub repo id.")
    if _in_hub_cache(value) or _hub_reachable():
        return value
    raise UserError(
        f"{flag} {value!r}: no such folder, and the Hugging Face Hub cannot be reached to look it up as a repo id. "
        f"Pass an existing model folder{also}, or connect to the Hub."
    )


def existing_file(value: str | None, flag: str) -> str | None:
    """`value` if it names an existing file (or is `None`); else a `UserError` naming `flag`."""
    if value is None:
        return None
    if not Path(value).expanduser().is_file():
        raise UserError(f"{flag} {value!r}: no such file.")
    return str(Path(value).expanduser())
