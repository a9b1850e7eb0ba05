"""Does the draft accept live what its teacher-forced forward predicts? (greedy, position 1 of each block)

For each prompt: greedy speculative generation with the whole block verified records every round's drafted
tokens and acceptance; the draft's teacher-forced (training) forward over the finished sequence then predicts
the first token of a block anchored at every response position. Printed: how often the teacher-forced argmax
equals the live first draft at the live anchors (the inference path reproduces the training path), the live
position-1 acceptance, the teacher-forced one at the live anchors (the same quantity, unless the two paths
differ) and at every response position (differs if the anchors live rounds land on are harder: selection).

    python research/2026-12-03-round2-more-data/live_vs_teacher_forced.py --prompts prompts.jsonl --limit 8 [--draft smollm2-135m-dspark]
"""

from __future__ import annotations

import argparse
import json

import torch

from dspark_hf import last_generation_stats
from dspark_hf.default_model import chat_inputs, load_draft, load_target
from dspark_hf.model.modeling import block_attention_mask
from dspark_hf.train.features import target_features
from dspark_hf.train.losses import build_blocks


@torch.no_grad()
def first_token_predictions(draft, target, seq: torch.Tensor, anchors: list[int]) -> list[int]:
    """The draft's teacher-forced argmax for slot 1 of a block anchored at each of `anchors` (full-vocab ids)."""
    c = draft.config
    feats = target_features(target, list(c.target_layer_ids), seq).context
    blocks = build_blocks(
        seq, torch.ones_like(seq, dtype=torch.bool), [torch.tensor(anchors)], c.block_size, c.mask_token_id
    )
    mask = block_attention_mask(blocks.anchors, seq.shape[1], c.block_size)
    out = draft(feats, blocks.input_ids, blocks.position_ids, prev_token_ids=blocks.prev_token_ids, attention_mask=mask)
    best = out.logits[0, :: c.block_size].argmax(-1)
    if out.logits.shape[-1] != c.vocab_size:  # logits over the draft vocabulary subset
        best = draft.draft_vocab_ids[best]
    return best.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", required=True, help="JSONL with a 'prompt' per line")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--draft", default=None, help="draft (default: the shipped default draft)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(None)
    target.requires_grad_(False)
    draft, _ = load_draft(target, args.draft)
    prompts = [json.loads(line)["prompt"] for line in open(args.prompts)][: args.limit]
    n = dict(rounds=0, live=0, forced_at_anchors=0, agree=0, forced_everywhere=0, positions=0)
    for text in prompts:
        inputs = chat_inputs(tokenizer, text)
        start = inputs["input_ids"].shape[1]  # the first anchor: the token the prefill produced
        with torch.no_grad():
            seq = target.generate(
                **inputs, assistant_model=draft, dspark_policy="fixed", do_sample=False,
                max_new_tokens=args.max_new_tokens,
            )  # fmt: skip
        rounds = last_generation_stats(draft).rounds
        everywhere = list(range(start, seq.shape[1] - 1))
        forced = dict(zip(everywhere, first_token_predictions(draft, target, seq, everywhere)))
        nxt = {a: int(seq[0, a + 1]) for a in everywhere}
        n["forced_everywhere"] += sum(forced[a] == nxt[a] for a in everywhere)
        n["positions"] += len(everywhere)
        a = start
        for r in rounds:
            if a in forced and r.drafted and r.verified > 0:
                n["rounds"] += 1
                n["live"] += r.accepted >= 1
                n["forced_at_anchors"] += forced[a] == nxt[a]
                n["agree"] += forced[a] == r.drafted[0]
            a += r.accepted + 1
    print(json.dumps(n))
    print(
        f"rounds {n['rounds']}: teacher-forced argmax == live first draft {n['agree'] / n['rounds']:.3f}; "
        f"position-1 acceptance live {n['live'] / n['rounds']:.3f}, teacher-forced at the live anchors "
        f"{n['forced_at_anchors'] / n['rounds']:.3f}, at every response position "
        f"{n['forced_everywhere'] / n['positions']:.3f} ({n['positions']} positions)"
    )


if __name__ == "__main__":
    main()
