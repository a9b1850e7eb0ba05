"""Optional dependencies: which extra brings each one, and the error that says how to install it.

`import dspark_hf` imports none of the optional packages; the functions that need one call [`require`] first,
so a missing package fails with the extra to install instead of a library's generic message.
"""

from __future__ import annotations

import importlib
import importlib.util

#: what each extra is for (the keys of `[project.optional-dependencies]` in `pyproject.toml`)
EXTRAS = {
    "default-model": "loading the default target (SmolLM2-135M-Instruct) from its GGUF file",
    "train": "training drafts (`dspark train`, LoRA)",
    "eval": "evaluation (`dspark eval`) and calibration plots",
    "demo": "the Gradio demo (`dspark demo`)",
    "serve": "the HTTP server (`dspark serve`)",
    "docs": "building the documentation",
}


class MissingExtraError(ImportError):
    """An optional package is not installed; the message names the extra that brings it (`dspark` prints it as
    one line and exits with status 2)."""


def install_hint(extra: str) -> str:
    """The command that installs `extra`, as it works today: from a clone of the repository.

    dspark-hf is not on PyPI yet, so `pip install "dspark-hf[extra]"` would fail; in a clone the same extra
    installs with `pip install -e ".[extra]"` (torch pinned so pip takes the CPU build, not a CUDA one).
    """
    if extra not in EXTRAS:
        raise ValueError(f"Unknown extra {extra!r}; the extras are {', '.join(EXTRAS)}.")
    return f'pip install torch==2.13.0 -e ".[{extra}]"  (in your clone of dspark-hf)'


def missing(package: str, extra: str, purpose: str | None = None) -> MissingExtraError:
    """A [`MissingExtraError`] (an `ImportError`): `package` is needed for `purpose`; which extra installs it."""
    purpose = purpose or EXTRAS.get(extra, "this feature")
    return MissingExtraError(
        f"{package} is needed for {purpose} but is not installed. Install the {extra!r} extra: " + install_hint(extra)
    )


def require(*modules: str, extra: str, purpose: str | None = None) -> None:
    """Raise [`missing`] for the first of `modules` (import names) that cannot be imported.

    Only checks that each module can be found; the caller imports what it uses.
    """
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise missing(module, extra, purpose)


def import_optional(module: str, extra: str, purpose: str | None = None):
    """Import `module`, or raise [`missing`] naming `extra` when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise missing(module.split(".")[0], extra, purpose) from err
