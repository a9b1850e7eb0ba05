"""Write the training prompts of the default drafts to a JSONL file, shortest first.

    python examples/default_drafts/build_prompts.py --output data/prompts.jsonl

Shortest-first keeps each batch of `dspark prepare-data` (fixed chunks of this list) nearly free of padding.
None of these prompts is an evaluation prompt: see `dspark_hf.evaluation.prompt_sets` and `tests/evaluation/test_prompt_sets.py`.
The file is not committed (ShareGPT declares no licence); this script rebuilds it exactly (seeded).
"""

import argparse
from pathlib import Path

from prompt_files import sort_shortest_first, write_jsonl

from dspark_hf.evaluation.prompt_sets import calibration_prompts, training_prompts

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--output", default="data/prompts.jsonl")
parser.add_argument("--chat", type=int, default=1100, help="ShareGPT first turns (before the held-out slice).")
parser.add_argument("--code", type=int, default=300, help="write-this-function requests from the stdlib.")
parser.add_argument("--math", type=int, default=300, help="templated arithmetic word problems.")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument(
    "--first-stage",
    type=int,
    default=432,
    help="prompts answered in the first stage (the shortest); the second stage file takes every code and math "
    "prompt after them and every 4th ShareGPT one (the shipped drafts' data: stage 1 was cut for time).",
)
parser.add_argument("--second-stage-output", default="data/prompts_stage2.jsonl")
parser.add_argument("--calibration", type=int, default=64, help="calibration prompts, disjoint from training.")
parser.add_argument("--calibration-output", default="data/calibration_prompts.jsonl")
args = parser.parse_args()

rows = training_prompts(args.chat, args.code, args.math, seed=args.seed)
sort_shortest_first(rows)
out = Path(args.output)
out.parent.mkdir(parents=True, exist_ok=True)
write_jsonl(out, rows)
print(f"wrote {len(rows)} prompts to {out}")
rest = rows[args.first_stage :]
stage2 = [r for r in rest if r["source"] != "sharegpt"] + [r for r in rest if r["source"] == "sharegpt"][::4]
stage2.sort(key=lambda r: rows.index(r))
write_jsonl(args.second_stage_output, stage2)
print(f"wrote {len(stage2)} second-stage prompts to {args.second_stage_output}")

calibration = calibration_prompts(args.calibration, n_chat_trained=args.chat, seed=args.seed)
trained = {r["prompt"] for r in rows}
assert not any(r["prompt"] in trained for r in calibration), "calibration prompts overlap the training prompts"
write_jsonl(args.calibration_output, calibration)
print(f"wrote {len(calibration)} calibration prompts to {args.calibration_output}")
