"""Why live first-token acceptance falls short of the held-out estimate: rounds start after a rejection.

Teacher-forced training and its held-out `accept@1` score every anchor `a` of a sampled reply, where the
token `x_a` that the block starts from was drawn from the target's distribution `p`. Live, almost every round
starts right after a rejection, and then `x_a` is drawn from the residual `(p − q)₊ / TV`: a token the draft
gave less probability than the target did. This script scores the same held-out anchors both ways:

* **plain**: the mean of `accept@1 = Σ_v min(p_v, q_v)` over the anchors, as training reports it;
* **after a rejection**: the same mean with each anchor `a` weighted by how much more likely `x_a` is under the
  residual of the draft's own first-token prediction one position earlier than under `p`:
  `w_a = (1 − q_{a−1}(x_a) / p_{a−1}(x_a))₊ / TV_{a−1}` (an importance weight; its mean under `p` is 1).

If the second figure is close to the live first-token rate and the first to the held-out one, the gap between
them is this selection effect, not a mismatch between training and decoding.

`--eval-results` scores the plain-decoding replies that `dspark eval` sampled from the target on its own
prompts (the `plain` runs of a `results.json`) instead of a prepare-data file, which separates the effect of
the evaluation's prompts from that of the training prompts.

    python examples/default_drafts/first_token_gap.py --data data/eval_round6.jsonl \\
        --draft dspark7=data/runs/round7-dspark --draft dflash7=data/runs/round7-dflash
    python examples/default_drafts/first_token_gap.py --eval-results EVAL_OUTPUT/results.json \\
        --draft dspark7=data/runs/round7-dspark --draft dflash7=data/runs/round7-dflash
"""

from __future__ import annotations

import argparse
import json

import torch

from dspark_hf import DSparkDraftModel
from dspark_hf.default_model import chat_inputs
from dspark_hf.evaluation.prompt_sets import load_prompt_set
from dspark_hf.train.data import load_target, load_token_dataset
from dspark_hf.train.features import log_partition_at, target_features, target_logits
from dspark_hf.train.losses import build_blocks, valid_anchor_positions
from dspark_hf.train.step import forward_blocks


@torch.no_grad()
def first_token_rates(drafts: dict, target, dataset) -> dict[str, dict[str, float]]:
    """The first drafted token's acceptance, plain and after a rejection, for each of `drafts` (name → draft),
    on every anchor of `dataset` that follows another anchor. The target runs once per sequence for all drafts."""
    sums = {name: [0.0, 0.0, 0.0, 0.0] for name in drafts}  # plain sum, anchors, weighted sum, weight sum
    for i in range(len(dataset)):
        ids, mask = dataset[i]
        anchors = valid_anchor_positions(mask)
        if anchors.numel() < 2:
            continue
        ids, mask = ids[None], mask[None]
        layer_ids = None
        for name, draft in drafts.items():
            if list(draft.config.target_layer_ids) != layer_ids:
                layer_ids = list(draft.config.target_layer_ids)
                feats = target_features(target, layer_ids, ids, torch.ones_like(ids))
            _accumulate(sums[name], draft, target, feats, ids, mask, anchors)
    return {
        name: {
            "anchors": n,
            "plain": plain / max(n, 1),
            "after_rejection": weighted / max(weights, 1e-12),
            "mean_weight": weights / max(n, 1),
        }
        for name, (plain, n, weighted, weights) in sums.items()
    }


def _accumulate(sums: list, draft, target, feats, ids, mask, anchors) -> None:
    gamma = draft.config.block_size
    vocab_ids = getattr(draft, "draft_vocab_ids", None)
    blocks = build_blocks(ids, mask, [anchors], gamma, draft.config.mask_token_id)
    out = forward_blocks(draft, feats.context, blocks, restrict_vocab=vocab_ids is not None)
    slot0 = torch.arange(anchors.numel()) * gamma  # slot 0 of each block predicts x_{a+1}
    q = torch.softmax(out.logits[0, slot0].float(), dim=-1)
    positions = blocks.target_positions[:, slot0]
    z = target_logits(target, feats.final, positions, vocab_ids)[0]
    if vocab_ids is not None:  # the target's full distribution on the subset
        p = torch.exp(z - log_partition_at(feats, target, positions)[0][:, None])
    else:
        p = torch.softmax(z, dim=-1)
    accept = torch.minimum(p, q).sum(-1)  # [N]: acceptance of the first drafted token at each anchor
    tv = (1.0 - accept).clamp(min=1e-6)
    nxt = ids[0, anchors + 1]  # x_{a+1}, the token the next anchor starts from
    if vocab_ids is not None:  # its column in the subset (-1: outside it, where q is 0)
        index = torch.full((draft.config.vocab_size,), -1, dtype=torch.long)
        index[vocab_ids] = torch.arange(vocab_ids.numel())
        col = index[nxt]
    else:
        col = nxt
    inside = col >= 0
    q_x = torch.where(inside, q.gather(1, col.clamp(min=0)[:, None])[:, 0], torch.zeros_like(tv))
    p_x = torch.where(inside, p.gather(1, col.clamp(min=0)[:, None])[:, 0], torch.ones_like(tv))
    ratio = torch.where(inside, (1.0 - q_x / p_x.clamp(min=1e-12)).clamp(min=0.0), torch.ones_like(tv))
    w_next = ratio / tv  # weight of anchor a+1, from the block anchored at a
    follows = torch.nonzero(anchors[1:] == anchors[:-1] + 1).flatten()  # j where anchor j+1 = anchor j + 1
    sums[0] += float(accept[follows + 1].sum())
    sums[1] += float(follows.numel())
    sums[2] += float((w_next[follows] * accept[follows + 1]).sum())
    sums[3] += float(w_next[follows].sum())


def eval_replies(paths: list[str], tokenizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`(input_ids, loss_mask)` of every plain-decoding reply in `dspark eval` results: the prompt under the chat
    template, as the evaluation encoded it, then the sampled reply (the part that is scored)."""
    prompts: dict[str, dict[str, str]] = {}
    sequences = []
    for path in paths:
        for run in json.loads(open(path).read())["runs"]:
            if run["method"] != "plain":
                continue
            if run["set_name"] not in prompts:
                prompts[run["set_name"]] = {item.id: item.prompt for item in load_prompt_set(run["set_name"])}
            prompt = chat_inputs(tokenizer, prompts[run["set_name"]][run["prompt_id"]])["input_ids"][0]
            reply = torch.tensor(run["output_ids"], dtype=torch.long)
            ids = torch.cat([prompt, reply])
            mask = torch.cat(
                [torch.zeros(prompt.numel(), dtype=torch.bool), torch.ones(reply.numel(), dtype=torch.bool)]
            )
            sequences.append((ids, mask))
    return sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="a prepare-data JSONL (held-out conversations)")
    source.add_argument("--eval-results", nargs="+", help="dspark eval results.json files: score their plain replies")
    parser.add_argument("--draft", action="append", required=True, help="NAME=FOLDER, repeatable")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--target", default=None, help="target (default: the drafts' default target)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N conversations")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    target, tokenizer = load_target(args.target, "float32", "cpu")
    if args.data is not None:
        dataset = load_token_dataset(args.data, args.max_seq_len)
    else:
        dataset = eval_replies(args.eval_results, tokenizer)
    if args.limit is not None:
        dataset = [dataset[i] for i in range(min(args.limit, len(dataset)))]
    print("| draft | anchors | accept@1, plain | accept@1, after a rejection | mean weight |")
    print("|---|---:|---:|---:|---:|")
    drafts = {}
    for spec in args.draft:
        name, _, folder = spec.partition("=")
        drafts[name] = DSparkDraftModel.from_pretrained(folder, target=target).float().eval()
    for name, r in first_token_rates(drafts, target, dataset).items():
        print(
            f"| `{name}` | {r['anchors']:.0f} | {r['plain']:.3f} | {r['after_rejection']:.3f} | {r['mean_weight']:.2f} |"
        )


if __name__ == "__main__":
    main()
