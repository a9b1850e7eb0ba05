"""What the default drafts' prompt scripts (`build_prompts.py`, `round2_data.py`) share: the order and the file."""

import json
from pathlib import Path

from transformers import AutoTokenizer

from dspark_hf.default_model import default_target_path


def sort_shortest_first(rows: list[dict]) -> None:
    """Sort prompt rows in place by their length in the default target's tokens (ties by text), shortest first.

    Each batch of `dspark prepare-data` (fixed chunks of the list) is then nearly free of padding.
    """
    tokenizer = AutoTokenizer.from_pretrained(default_target_path())
    rows.sort(key=lambda r: (len(tokenizer(r["prompt"])["input_ids"]), r["prompt"]))


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    """One JSON object a line (the folder must exist)."""
    with Path(path).open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
