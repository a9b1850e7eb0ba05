"""Round 3 of the default drafts: the prompt file for a GPU run (`run_gpu_round3.sh`).

    python examples/default_drafts/round3_data.py --output data/prompts_round3.jsonl

Every usable ShareGPT first turn before the held-out slice except the 160 calibration prompts' chat half, the
227 stdlib write-this-function requests six times each (each answered afresh: the batches sample with their
own seeds), and 3,000 templated word problems drawn with a new seed (none a calibration problem). None is an
evaluation prompt (`tests/evaluation/test_prompt_sets.py` checks the pools). The rows are sorted by length into chunks of
`--chunk` (one `prepare-data` batch each, so a batch is nearly free of padding) and the chunks are shuffled:
a run stopped at a time limit then keeps a sample of every length and source, not only the shortest prompts.
"""

import argparse
import random

from prompt_files import write_in_length_chunks

from dspark_hf.evaluation.prompt_sets import calibration_prompts, training_chat_pool, training_prompts

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--output", default="data/prompts_round3.jsonl")
parser.add_argument("--code-repeats", type=int, default=6, help="times each stdlib code prompt is answered.")
parser.add_argument("--math", type=int, default=3000, help="templated arithmetic word problems.")
parser.add_argument("--chunk", type=int, default=512, help="prepare-data's batch_size (prompts sorted within).")
parser.add_argument("--seed", type=int, default=3, help="a new draw (rounds 1 and 2 used 0 and 2)")
args = parser.parse_args()

calibration = {r["prompt"] for r in calibration_prompts(160, n_chat_trained=1100, seed=0)}
chat = [{"prompt": p, "source": "sharegpt"} for p in training_chat_pool() if p not in calibration]
drawn = training_prompts(0, 10_000, args.math, seed=args.seed)
code = [r for r in drawn if r["source"] == "stdlib"] * args.code_repeats
math = [r for r in drawn if r["source"] == "math" and r["prompt"] not in calibration]
print(write_in_length_chunks(args.output, chat + code + math, args.chunk, random.Random(args.seed)))
