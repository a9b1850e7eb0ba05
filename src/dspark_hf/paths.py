"""Where dspark_hf keeps files it builds or measures on this machine (converted models, SPS profiles, kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Folder where dspark_hf keeps converted models, SPS profiles and compiled kernels.

    `$DSPARK_HF_CACHE` when set, otherwise `~/.cache/dspark_hf`.
    """
    return Path(os.environ.get("DSPARK_HF_CACHE", Path.home() / ".cache" / "dspark_hf"))
