"""One micro-batch of training, and the held-out evaluation built on it.

[`BlockStep`] turns sequences into the draft's loss: it pads them, samples anchors per sequence (a pure function
of the seed, the epoch and the sequence index: [`anchor_seed`]), takes the target's features (online or from a
[`FeatureCache`]), packs every block in one forward ([`forward_blocks`]) and computes [`dspark_loss`].
[`evaluate`] runs it on held-out data with fixed anchors and reduces the sums across processes.
"""

from __future__ import annotations

import math

import torch

from ..model.modeling import block_attention_mask
from .args import TrainArguments
from .data import TokenDataset
from .features import FeatureCache, log_partition_at, pad_features, target_features, target_logits
from .losses import IGNORE_INDEX, Blocks, LossOutput, acceptance_estimates, build_blocks, dspark_loss, sample_anchors


def anchor_seed(seed: int, epoch: int, index: int) -> int:
    """Seed of the anchors of sequence `index` in `epoch` (epoch `-1`: the fixed held-out anchors)."""
    return (seed * 1_000_003 + (epoch + 1) * 7_919 + index * 104_729) % (2**63 - 1)


def forward_blocks(model, context: torch.Tensor, blocks: Blocks, restrict_vocab: bool = False):
    """The draft's teacher-forced forward over `blocks` (from [`build_blocks`]) packed in one pass, each block
    seeing the target context before its anchor and its own block ([`block_attention_mask`]).

    Args:
        model: a [`DSparkDraftModel`] (or a PEFT model around one).
        context (`torch.Tensor` of shape `(B, T, m·d)`): the target's selected-layer features of the sequences.
        blocks ([`Blocks`]): the blocks to draft.
        restrict_vocab (`bool`, *optional*, defaults to `False`): logits over the draft vocabulary subset only.
    """
    block_size = blocks.input_ids.shape[1] // blocks.anchors.shape[1]
    return model(
        target_hidden_states=context,
        input_ids=blocks.input_ids,
        position_ids=blocks.position_ids,
        prev_token_ids=blocks.prev_token_ids,
        attention_mask=block_attention_mask(blocks.anchors, context.shape[1], block_size),
        **({"restrict_vocab": True} if restrict_vocab else {}),
    )


class BlockStep:
    """Builds one micro-batch (features, anchors, blocks) and computes its loss."""

    def __init__(self, target, draft_config, train_args: TrainArguments, autocast, vocab_ids=None):
        self.target = target
        self.gamma = draft_config.block_size
        self.mask_token_id = draft_config.mask_token_id
        self.layer_ids = list(draft_config.target_layer_ids)
        self.train_args = train_args
        self.autocast = autocast
        # With a draft vocabulary subset S: logits of draft and target over S only, labels as indices into S.
        self.vocab_ids = vocab_ids
        self.label_index = None
        if vocab_ids is not None:
            self.label_index = torch.full((draft_config.vocab_size,), IGNORE_INDEX, dtype=torch.long)
            self.label_index[vocab_ids.cpu()] = torch.arange(vocab_ids.numel())

    def __call__(
        self, model, dataset: TokenDataset, cache: FeatureCache | None, items: list[tuple[int, int]], num_anchors: int
    ) -> tuple[LossOutput, int]:
        device = self.target.device
        seqs = [dataset[i] for i, _ in items]
        length = max(ids.numel() for ids, _ in seqs)
        input_ids = torch.zeros(len(seqs), length, dtype=torch.long)
        loss_mask = torch.zeros(len(seqs), length, dtype=torch.bool)
        attention = torch.zeros(len(seqs), length, dtype=torch.long)
        for b, (ids, mask) in enumerate(seqs):
            input_ids[b, : ids.numel()], loss_mask[b, : ids.numel()], attention[b, : ids.numel()] = ids, mask, 1
        anchors = [
            sample_anchors(mask, num_anchors, torch.Generator().manual_seed(anchor_seed(self.train_args.seed, e, i)))
            for (i, e), (_, mask) in zip(items, seqs)
        ]
        input_ids, loss_mask, attention = input_ids.to(device), loss_mask.to(device), attention.to(device)
        if cache is None:
            feats = target_features(self.target, self.layer_ids, input_ids, attention)
        else:
            feats = pad_features([cache.get(i) for i, _ in items], length)
            feats.context, feats.final = feats.context.to(device), feats.final.to(device)
            if feats.log_partition is not None:
                feats.log_partition = feats.log_partition.to(device)
        blocks = build_blocks(input_ids, loss_mask, anchors, self.gamma, self.mask_token_id)
        subset = self.vocab_ids is not None
        with self.autocast():
            out = forward_blocks(model, feats.context, blocks, restrict_vocab=subset)
        t_logits = target_logits(self.target, feats.final, blocks.target_positions, self.vocab_ids)
        # Over a subset, the full vocabulary's log-partition makes p the target's full distribution on it
        # (a feature cache stored it per token; online it is computed at the trained positions).
        log_z = log_partition_at(feats, self.target, blocks.target_positions) if subset else None
        labels = self.label_index.to(blocks.labels.device)[blocks.labels] if subset else blocks.labels
        a = self.train_args
        loss = dspark_loss(
            out.logits,
            t_logits,
            labels,
            blocks.valid,
            out.confidence_logits,
            block_size=self.gamma,
            target_log_partition=log_z,
            decay=a.loss_decay,
            ce_weight=a.ce_weight,
            l1_weight=a.l1_weight,
            bce_weight=a.bce_weight,
        )
        return loss, int(attention.sum())


def evaluate(
    model,
    runner: BlockStep,
    dataset: TokenDataset,
    cache: FeatureCache | None,
    accelerator,
    batch_size: int,
    num_anchors: int,
) -> dict[str, float]:
    """Weighted losses, `accept@k` and `τ_est` on held-out data (fixed anchors, so evaluations are comparable).

    Every process evaluates its share; sums are reduced across processes. Processes with fewer sequences run
    dummy batches with zero weight, so collective forwards (FSDP) stay in step.
    """
    gamma = runner.gamma
    world, rank = accelerator.num_processes, accelerator.process_index
    mine = list(range(rank, len(dataset), world))
    num_batches = math.ceil(math.ceil(len(dataset) / world) / batch_size)
    sums = torch.zeros(4 + 2 * gamma, dtype=torch.float64, device=accelerator.device)
    model.eval()
    with torch.no_grad():
        for j in range(num_batches):
            chunk = mine[j * batch_size : (j + 1) * batch_size]
            scale = 1.0 if chunk else 0.0
            items = [(i, -1) for i in (chunk or [0])]
            out, _ = runner(model, dataset, cache, items, num_anchors)
            w = out.weight_sum.double()
            part = torch.cat(
                [
                    torch.stack([out.ce * w, out.l1 * w, out.bce * w, w]).double(),
                    out.tv_sum.double(),
                    out.count.double(),
                ]
            )
            sums += scale * part.to(sums.device)
    model.train()
    sums = accelerator.reduce(sums, reduction="sum")
    w = sums[3].clamp(min=1e-12)
    a = runner.train_args
    ce, l1, bce = (float(sums[i] / w) for i in range(3))
    metrics = {"loss": a.ce_weight * ce + a.l1_weight * l1 + a.bce_weight * bce, "ce": ce, "l1": l1, "bce": bce}
    metrics.update(acceptance_estimates(sums[4 : 4 + gamma].float(), sums[4 + gamma :].float()))
    return metrics
