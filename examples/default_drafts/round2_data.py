"""Round 2 of the default drafts: new prompts, and the train / held-out files that keep round 1's held-out split.

    # before prepare-data: new prompts, none used in round 1, none a calibration or evaluation prompt
    python examples/default_drafts/round2_data.py prompts --output data/prompts_round2.jsonl
    dspark prepare-data --config research/2026-12-03-round2-more-data/prepare_round2.yaml
    # after it: round 1's data minus its held-out sequences, plus round 2's responses; and round 1's held-out
    python examples/default_drafts/round2_data.py split --round1 data/train.jsonl \
        --round2 data/regenerated_round2.jsonl --train-output data/train_round2.jsonl \
        --eval-output data/eval_round1.jsonl

Keeping round 1's held-out sequences as the evaluation file (`eval_data`) means the drafts that resume from
the shipped weights are never evaluated on a sequence they were trained on (a fresh `eval_ratio` split of the
larger file would put some round-1 training sequences into the held-out set), and the held-out `τ_est` of the
two rounds are comparable.

Where round 1's data is not at hand (it is not committed, and rebuilding it costs about an hour of a 2-core
CPU), `--round1 none` trains on round 2's conversations alone and holds out `--eval-ratio` of them (whole
conversations, drawn with `--seed`): the shipped weights never saw a round-2 conversation, so that held-out
file is clean too; round 1's data is then not revisited (the shipped drafts trained on it for 12 epochs).

    python examples/default_drafts/round2_data.py split --round1 none --eval-output data/eval_round2.jsonl
"""

import argparse
import json
import random
from pathlib import Path

from prompt_files import sort_shortest_first, write_jsonl

from dspark_hf.evaluation.prompt_sets import calibration_prompts, training_prompts
from dspark_hf.train.data import load_token_dataset

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
sub = parser.add_subparsers(dest="command", required=True)
p = sub.add_parser("prompts", help="write the round-2 prompts, shortest first")
p.add_argument("--output", default="data/prompts_round2.jsonl")
p.add_argument("--chat", type=int, default=4000, help="ShareGPT first turns drawn (before the held-out slice).")
p.add_argument(
    "--code",
    type=int,
    default=600,
    help="write-this-function requests from the stdlib; the pool has 227 and round 1 used them all, so they "
    "come again (answered afresh: prepare-data samples a new response with round 2's seed)",
)
p.add_argument("--math", type=int, default=1200, help="templated arithmetic word problems.")
p.add_argument("--seed", type=int, default=2, help="a new draw (round 1 used seed 0)")
s = sub.add_parser("split", help="round-2 training file and round 1's held-out file")
s.add_argument(
    "--round1",
    default="data/train.jsonl",
    help="round 1's training data (both stages), or 'none' to hold out a slice of round 2's conversations instead",
)
s.add_argument("--round2", default="data/regenerated_round2.jsonl")
s.add_argument(
    "--first",
    type=int,
    default=None,
    help="use only round 2's first N conversations (the run under way stopped prepare-data at 3,648)",
)
s.add_argument(
    "--skip",
    type=int,
    default=0,
    help="leave out round 2's first N conversations (with none: those an earlier round trained on, when a "
    "resumed prepare-data run appended more to the same file)",
)
s.add_argument("--train-output", default="data/train_round2.jsonl")
s.add_argument("--eval-output", default="data/eval_round1.jsonl")
s.add_argument("--eval-ratio", type=float, default=0.02, help="round 1's eval_ratio (or round 2's, with none)")
s.add_argument("--max-seq-len", type=int, default=512, help="round 1's max_seq_len")
s.add_argument("--seed", type=int, default=0, help="round 1's training seed")
args = parser.parse_args()

if args.command == "prompts":
    # Everything round 1 could have used (its full prompt list, both stages) and its 160 calibration prompts.
    used = {r["prompt"] for r in training_prompts(1100, 300, 300, seed=0)}
    used |= {r["prompt"] for r in calibration_prompts(160, n_chat_trained=1100, seed=0)}
    drawn = training_prompts(args.chat, args.code, args.math, seed=args.seed)
    rows = [r for r in drawn if r["source"] == "stdlib" or r["prompt"] not in used]
    rows = list({r["prompt"]: r for r in rows}.values())
    sort_shortest_first(rows)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(out, rows)
    counts = {k: sum(r["source"] == k for r in rows) for k in ("sharegpt", "stdlib", "math")}
    print(f"wrote {len(rows)} prompts to {out} ({counts})")
elif args.round1 == "none":
    with open(args.round2, encoding="utf-8") as f:
        lines = [line if line.endswith("\n") else line + "\n" for line in f if line.strip()][args.skip : args.first]
    order = list(range(len(lines)))
    random.Random(args.seed).shuffle(order)
    held = set(order[: max(1, round(args.eval_ratio * len(lines)))])
    train_lines = [line for i, line in enumerate(lines) if i not in held]
    eval_lines = [line for i, line in enumerate(lines) if i in held]
    Path(args.train_output).write_text("".join(train_lines), encoding="utf-8")
    Path(args.eval_output).write_text("".join(eval_lines), encoding="utf-8")
    print(f"wrote {len(train_lines)} records to {args.train_output}, {len(eval_lines)} to {args.eval_output}")
else:
    _, held_out = load_token_dataset(args.round1, args.max_seq_len).split(args.eval_ratio, seed=args.seed)
    wanted = {tuple(held_out[i][0].tolist()) for i in range(len(held_out))}
    train_lines, eval_lines = [], []
    with open(args.round1, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            seqs = json.loads(line).get("sequences", [])
            held = any(tuple(q["input_ids"][: args.max_seq_len]) in wanted for q in seqs)
            (eval_lines if held else train_lines).append(line if line.endswith("\n") else line + "\n")
    with open(args.round2, encoding="utf-8") as f:
        train_lines += [line if line.endswith("\n") else line + "\n" for line in f if line.strip()][: args.first]
    Path(args.train_output).write_text("".join(train_lines), encoding="utf-8")
    Path(args.eval_output).write_text("".join(eval_lines), encoding="utf-8")
    print(f"wrote {len(train_lines)} records to {args.train_output}, {len(eval_lines)} to {args.eval_output}")
