"""Write the prompts of the training run's held-out sequences to a `dspark eval --prompts` file.

    python examples/default_drafts/heldout_prompts.py --data data/train.jsonl --output data/heldout_prompts.jsonl
    dspark eval --prompts data/heldout_prompts.jsonl --draft dspark=smollm2-135m-dspark \\
        --draft dflash=smollm2-135m-dflash --temperatures 1 --max-new-tokens 96 --repeats 1 \\
        --threads 1 --no-prompt-lookup --no-task-metrics

The held-out split is the trainer's own (`TokenDataset.split` with the recipe's `eval_ratio` and seed), so
the live τ of that eval can be set against the held-out `τ_est` the training run logged. Each held-out
sequence is matched back to its record by its token ids; the prompt is the record's first user turn.
"""

import argparse
import json
from pathlib import Path

from dspark_hf.evaluation.prompt_sets import PromptItem, save_prompt_file
from dspark_hf.train.data import load_token_dataset

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--data", default="data/train.jsonl", help="the training data (`dspark prepare-data` output)")
parser.add_argument("--output", default="data/heldout_prompts.jsonl")
parser.add_argument("--eval-ratio", type=float, default=0.02, help="as in the training config")
parser.add_argument("--max-seq-len", type=int, default=512, help="as in the training config")
parser.add_argument("--seed", type=int, default=0, help="as in the training config")
args = parser.parse_args()

_, held_out = load_token_dataset(args.data, args.max_seq_len).split(args.eval_ratio, seed=args.seed)
if held_out is None:
    raise SystemExit(f"{args.data}: no held-out split at eval_ratio={args.eval_ratio}.")
wanted = {tuple(held_out[i][0].tolist()) for i in range(len(held_out))}

items = []
with open(args.data, encoding="utf-8") as f:
    for line in f:
        if not line.strip():
            continue
        record = json.loads(line)
        for seq in record.get("sequences", [record]):
            if tuple(seq["input_ids"][: args.max_seq_len]) in wanted:
                prompt = next(m["content"] for m in record["messages"] if m["role"] == "user")
                items.append(PromptItem("heldout", f"train-{record['id']}", prompt, {}))
                break
if len(items) != len(wanted):
    raise SystemExit(f"matched {len(items)} of {len(wanted)} held-out sequences to records of {args.data}.")
print(f"wrote {len(items)} prompts to {save_prompt_file(items, Path(args.output))}")
