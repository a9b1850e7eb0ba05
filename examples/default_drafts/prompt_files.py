"""What the default drafts' prompt scripts (`build_prompts.py`, `round2_data.py`, `round3_data.py`, `round8_data.py`)
share: the order and the file."""

import json
import random
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


def write_in_length_chunks(path: str | Path, rows: list[dict], chunk: int, rng: random.Random) -> str:
    """Write `rows` sorted by length into chunks of `chunk` rows, the chunks in an order shuffled by `rng`.

    Each chunk is one `prepare-data` batch, nearly free of padding, and a run stopped at a time limit still has
    a sample of every length and source. Creates the folder; returns a line saying what was written.
    """
    rows = list(rows)
    sort_shortest_first(rows)
    chunks = [rows[i : i + chunk] for i in range(0, len(rows), chunk)]
    rng.shuffle(chunks)
    rows = [row for part in chunks for row in part]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(path, rows)
    counts = {source: sum(r["source"] == source for r in rows) for source in dict.fromkeys(r["source"] for r in rows)}
    return f"wrote {len(rows)} prompts in {len(chunks)} chunks of {chunk} to {path} ({counts})"
