"""Training prompts for a draft of Qwen2.5-Coder-0.5B-Instruct, from the default drafts' round-2 prompt pool.

Round 2's pool (`examples/default_drafts/round2_data.py prompts`) holds ShareGPT first turns, templated word
problems and "write this standard-library function" requests; none is an evaluation or calibration prompt. This
takes every code prompt and a seeded sample of the others, interleaved source by source, so a data run stopped
early still covers every kind of prompt in proportion.

    python research/2026-12-03-coder-target/make_prompts.py --pool data/prompts_round2.jsonl --output data/coder/prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", default="data/prompts_round2.jsonl")
    parser.add_argument("--output", default="data/coder/prompts.jsonl")
    parser.add_argument("--chat", type=int, default=1200, help="ShareGPT prompts to sample")
    parser.add_argument("--math", type=int, default=600, help="word problems to sample")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    by_source: dict[str, list[dict]] = {}
    for line in Path(args.pool).read_text().splitlines():
        row = json.loads(line)
        by_source.setdefault(row["source"], []).append(row)
    wanted = {"sharegpt": args.chat, "math": args.math}
    queues = []
    for source, rows in sorted(by_source.items()):
        rows = rows[:]
        rng.shuffle(rows)
        queues.append(rows[: wanted.get(source, len(rows))])
    total = sum(map(len, queues))
    out = []
    # interleave in proportion: at every step take from the queue that is furthest behind its share
    taken = [0] * len(queues)
    while len(out) < total:
        i = min(range(len(queues)), key=lambda q: taken[q] / len(queues[q]) if taken[q] < len(queues[q]) else 2.0)
        out.append(queues[i][taken[i]])
        taken[i] += 1
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("".join(json.dumps(r) + "\n" for r in out))
    counts = {s: sum(r["source"] == s for r in out) for s in by_source}
    print(f"wrote {len(out)} prompts to {args.output}: {counts}")


if __name__ == "__main__":
    main()
