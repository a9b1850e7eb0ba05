"""What the forward-timing benchmarks write: their settings and the exact command line, then their figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def write_report(out: Path, args, **figures) -> None:
    """Write `{"meta": ..., **figures}` to `out` as JSON; meta holds the command as run, the settings shared by
    these benchmarks (threads, repeats, steps) and the torch version."""
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": " ".join(["python", *sys.argv]),
        "threads": args.threads,
        "repeats": args.repeats,
        "steps": args.steps,
        "torch": torch.__version__,
    }
    out.write_text(json.dumps({"meta": meta, **figures}, indent=2))
