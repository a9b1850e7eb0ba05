"""Where dspark_hf keeps files on disk: one helper that every stage may import (it imports nothing of ours)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Folder where dspark_hf keeps converted models and SPS profiles (`$DSPARK_HF_CACHE` or `~/.cache/dspark_hf`)."""
    return Path(os.environ.get("DSPARK_HF_CACHE", Path.home() / ".cache" / "dspark_hf"))
