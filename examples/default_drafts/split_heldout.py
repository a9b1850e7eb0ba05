"""Split the issue-47 prompt file into training prompts and a held-out evaluation set of our own.

    python examples/default_drafts/split_heldout.py --prompts data/prompts_scale.jsonl \\
        --train-output data/prompts_scale_train.jsonl --heldout-output examples/default_drafts/heldout_own.jsonl

A prompt is held out when a hash of its text falls in a fixed bucket (`--buckets`, 1 in 500 by default), so
membership does not depend on the file's order or length: the prompt file may grow (Magpie appends batches)
and be split again, and every prompt held out before stays held out. No other choice enters, so the split
is regenerated exactly from the committed prompt file.

The held-out file is a `dspark eval --prompts` file with four sets by topic (`own-chat`, `own-code`,
`own-math`, `own-writing`: the sources' topics, Magpie's by its steering topic), at most `--per-set` prompts
each. Its sources are ours (ShareGPT before the evaluation's slice, templated math and writing, the stdlib
code prompts, Magpie), none of which the evaluation sets use, and it is never used to choose a recipe or a
default: it is reported beside the evaluation sets.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from dspark_hf.evaluation.prompt_sets import PromptItem, save_prompt_file

#: source name (as build_prompts_at_scale.py writes it) -> held-out set
TOPIC = {"sharegpt": "chat", "stdlib": "code", "code": "code", "code-explain": "code", "math": "math"}
TOPIC |= {"writing": "writing"}
TOPIC |= {f"magpie-{topic}": topic for topic in ("chat", "code", "math", "writing")}


def held_out(prompt: str, buckets: int) -> bool:
    """Whether `prompt` is in the held-out bucket (a stable hash of its text, independent of the file)."""
    return int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "big") % buckets == 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="data/prompts_scale.jsonl", help="build_prompts_at_scale.py's output")
    parser.add_argument("--train-output", default="data/prompts_scale_train.jsonl")
    parser.add_argument("--heldout-output", default="examples/default_drafts/heldout_own.jsonl")
    parser.add_argument("--buckets", type=int, default=500, help="hold out one prompt in this many (by hash)")
    parser.add_argument("--per-set", type=int, default=16, help="held-out prompts kept per topic set")
    args = parser.parse_args(argv)
    if args.buckets < 2:
        parser.error(f"--buckets must be at least 2, got {args.buckets}.")

    sets: dict[str, list[PromptItem]] = {f"own-{topic}": [] for topic in ("chat", "code", "math", "writing")}
    kept = dropped = 0
    with open(args.prompts, encoding="utf-8") as src, open(args.train_output, "w", encoding="utf-8") as train:
        for line in src:
            if not line.strip():
                continue
            row = json.loads(line)
            if not held_out(row["prompt"], args.buckets):
                train.write(line if line.endswith("\n") else line + "\n")
                kept += 1
                continue
            dropped += 1
            topic = TOPIC.get(row.get("source", ""), "chat")
            group = sets[f"own-{topic}"]
            if len(group) < args.per_set:
                group.append(PromptItem(f"own-{topic}", f"own-{topic}-{len(group)}", row["prompt"]))
    Path(args.heldout_output).parent.mkdir(parents=True, exist_ok=True)
    save_prompt_file(sets, args.heldout_output)
    sizes = ", ".join(f"{name} {len(items)}" for name, items in sets.items())
    print(f"{kept} training prompts -> {args.train_output}; {dropped} held out ({sizes} kept) -> {args.heldout_output}")


if __name__ == "__main__":
    main()
