"""The training objective as pure functions on tensors: anchors, blocks, losses, acceptance estimates.

One training sequence yields many blocks. An *anchor* is a position `a` where both `a` and `a+1` are
supervised (assistant) tokens. Block `j` feeds `[x_a, mask, …, mask]` at positions `a..a+γ-1`; slot `k`
predicts `x_{a+1+k}` and its sequential head reads the ground-truth previous token `x_{a+k}` (teacher
forcing). A slot is trained only while its label is inside the sequence and supervised, and only on the
contiguous prefix of such slots (after the first unsupervised label nothing in the block counts).

The losses (design §5), each a mean weighted by `w_k = exp(-k / decay)` over the valid slots:

* `CE`: cross-entropy of the sequential-head-corrected logits on the ground-truth token;
* `L1 = ‖q_k − p_k‖₁` between the draft's and the target's full temperature-1 distributions (fp32), i.e.
  twice the total variation; `1 − ½·L1 = Σ_v min(q_v, p_v)` is exactly the probability that rejection
  sampling accepts the slot;
* `BCE`: the confidence logit against that acceptance probability (clamped to [0, 1], detached).

With a draft vocabulary subset `S` the draft's `q` lives on `S` (it is 0 elsewhere) and the target's logits
are given over `S` only, together with the target's full-vocabulary log-partition per slot. Then
`p_v = exp(z_v − log Z)` on `S` is the target's full distribution there and the mass outside `S`,
`1 − Σ_S p_v`, is where `q` is 0, so `L1 = Σ_S |q_v − p_v| + (1 − Σ_S p_v)` is the full-vocabulary distance
and `1 − ½·L1 = Σ_S min(q_v, p_v)` the exact acceptance, as verification computes it. (Without the
log-partition, the softmax over `S` would renormalise the target to `S` and overstate acceptance by up to its
mass outside `S`.)

`total = 0.1·CE + 0.9·L1 + 1.0·BCE` by default. [`acceptance_estimates`] turns the per-slot total variation
into `accept@k ≈ 1 − TV_k` and `τ_est = 1 + Σ_k Π_{i≤k} accept@i`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: label value without a cross-entropy term (PyTorch's default `ignore_index`)
IGNORE_INDEX = -100


def position_weights(block_size: int, decay: float = 4.0, device=None) -> torch.Tensor:
    """`w_k = exp(-k / decay)` for slots `k = 0..γ-1` (DeepSpec's fixed decay is 4)."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32, device=device) / decay)


def valid_anchor_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions `a ≤ T-2` with `loss_mask[a]` and `loss_mask[a+1]` set (`loss_mask`: `[T]` bool)."""
    mask = loss_mask.bool()
    return torch.nonzero(mask[:-1] & mask[1:]).flatten()


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int | None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Up to `num_anchors` valid anchors drawn uniformly without replacement, sorted (`None` = all of them)."""
    candidates = valid_anchor_positions(loss_mask)
    if num_anchors is not None and candidates.numel() > num_anchors:
        pick = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
        candidates = candidates[pick]
    return candidates.sort().values


@dataclass
class Blocks:
    """The teacher-forced blocks of one batch, flattened to `S = N·γ` slots per row.

    Args:
        anchors (`torch.LongTensor` of shape `(B, N)`): anchor positions (padding blocks use 0).
        input_ids (`torch.LongTensor` of shape `(B, S)`): `[x_a, mask, …, mask]` per block.
        position_ids (`torch.LongTensor` of shape `(B, S)`): `a + k`.
        prev_token_ids (`torch.LongTensor` of shape `(B, S)`): `x_{a+k}`, the token before each label.
        labels (`torch.LongTensor` of shape `(B, S)`): `x_{a+1+k}` (0 where invalid).
        target_positions (`torch.LongTensor` of shape `(B, S)`): `a + k`, the position whose target
            distribution predicts the label.
        valid (`torch.BoolTensor` of shape `(B, S)`): the contiguous supervised prefix of each block.
    """

    anchors: torch.Tensor
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    prev_token_ids: torch.Tensor
    labels: torch.Tensor
    target_positions: torch.Tensor
    valid: torch.Tensor


def build_blocks(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: list[torch.Tensor], block_size: int, mask_token_id: int
) -> Blocks:
    """Blocks for a batch of sequences (`input_ids`/`loss_mask`: `[B, T]`, right-padded, padding unsupervised).

    `anchors[b]` are the anchors of row `b`; rows are padded to the largest count (at least one block) with
    all-invalid blocks anchored at 0.
    """
    bsz, seq_len = input_ids.shape
    device = input_ids.device
    gamma = block_size
    n = max(1, max(int(a.numel()) for a in anchors))
    anchor_pos = torch.zeros(bsz, n, dtype=torch.long, device=device)
    real = torch.zeros(bsz, n, dtype=torch.bool, device=device)
    for b, a in enumerate(anchors):
        anchor_pos[b, : a.numel()] = a.to(device)
        real[b, : a.numel()] = True
    k = torch.arange(gamma, device=device)
    pos = anchor_pos[:, :, None] + k  # [B, N, γ]: a + k
    label_pos = pos + 1
    inside = label_pos < seq_len
    label_pos_c = label_pos.clamp(max=seq_len - 1)
    flat = lambda t: t.reshape(bsz, n * gamma)  # noqa: E731
    gather = lambda src, idx: torch.gather(src, 1, flat(idx)).reshape(bsz, n, gamma)  # noqa: E731
    supervised = inside & gather(loss_mask.bool(), label_pos_c) & real[:, :, None]
    valid = supervised.long().cumprod(dim=-1).bool()  # only the contiguous prefix counts
    labels = torch.where(valid, gather(input_ids, label_pos_c), 0)
    prev = gather(input_ids, pos.clamp(max=seq_len - 1))
    block_ids = torch.full_like(pos, mask_token_id)
    block_ids[:, :, 0] = prev[:, :, 0]
    return Blocks(
        anchors=anchor_pos,
        input_ids=flat(block_ids),
        position_ids=flat(pos),
        prev_token_ids=flat(prev),
        labels=flat(labels),
        target_positions=flat(pos.clamp(max=seq_len - 1)),
        valid=flat(valid),
    )


@dataclass
class LossOutput:
    """Result of [`dspark_loss`]: the weighted losses and per-slot statistics for logging.

    Args:
        loss (`torch.Tensor`): the weighted total, a scalar with gradient.
        ce (`torch.Tensor`): weighted cross-entropy (detached).
        l1 (`torch.Tensor`): weighted L1 distance to the target (detached).
        bce (`torch.Tensor`): weighted confidence BCE (detached; 0 without a confidence head).
        tv_sum (`torch.Tensor` of shape `(γ,)`): sum over valid slots of `TV = ½·L1`, per block position.
        count (`torch.Tensor` of shape `(γ,)`): number of valid slots per block position.
        weight_sum (`torch.Tensor`): `Σ w` over valid slots (the normaliser).
        accept (`torch.Tensor` of shape `(B, S)`): per-slot acceptance probability `1 − ½·L1` clamped to
            [0, 1] (detached): the confidence head's label, and what `tv_sum` averages (as `1 − accept`).
    """

    loss: torch.Tensor
    ce: torch.Tensor
    l1: torch.Tensor
    bce: torch.Tensor
    tv_sum: torch.Tensor
    count: torch.Tensor
    weight_sum: torch.Tensor
    accept: torch.Tensor


def dspark_loss(
    logits: torch.Tensor,
    target_logits: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    confidence_logits: torch.Tensor | None = None,
    *,
    block_size: int,
    target_log_partition: torch.Tensor | None = None,
    decay: float = 4.0,
    ce_weight: float = 0.1,
    l1_weight: float = 0.9,
    bce_weight: float = 1.0,
) -> LossOutput:
    """DSpark's training loss on teacher-forced blocks.

    Args:
        logits (`torch.Tensor` of shape `(B, S, V)`): the draft's corrected logits `U_k + B_k`.
        target_logits (`torch.Tensor` of shape `(B, S, V)`): the target's logits predicting the same labels
            (with a draft vocabulary subset: the subset's columns, `V = K`).
        labels (`torch.LongTensor` of shape `(B, S)`): ground-truth tokens (`IGNORE_INDEX` = no CE term, e.g.
            a token outside the draft vocabulary subset; the L1 and BCE terms still count).
        valid (`torch.BoolTensor` of shape `(B, S)`): slots that count (see [`build_blocks`]).
        confidence_logits (`torch.Tensor` of shape `(B, S)`, *optional*): the confidence head's logits.
        block_size (`int`): γ; `S` must be a multiple of it.
        target_log_partition (`torch.Tensor` of shape `(B, S)`, *optional*): the target's log-partition over
            its *full* vocabulary at each slot, when `target_logits` holds only a subset's columns (see
            `train.features.target_log_partition`). Then `p = exp(target_logits − target_log_partition)` is the
            full distribution on the subset and the L1, the acceptance estimates and the confidence label are
            the full-vocabulary ones. `None`: `target_logits` covers the whole vocabulary (`p` is its softmax).
        decay (`float`, *optional*, defaults to 4.0): position weights `exp(-k / decay)`.
        ce_weight, l1_weight, bce_weight (`float`, *optional*): defaults 0.1, 0.9, 1.0. DFlash uses 1, 0, 0.

    Returns:
        [`LossOutput`]
    """
    bsz, slots, vocab = logits.shape
    w = position_weights(block_size, decay, logits.device).repeat(slots // block_size)[None, :]
    w = w * valid.float()
    w_sum = w.sum()
    norm = w_sum.clamp(min=1e-12)
    logits = logits.float()
    ce = F.cross_entropy(
        logits.reshape(-1, vocab), labels.reshape(-1), reduction="none", ignore_index=IGNORE_INDEX
    ).reshape(bsz, slots)
    # The L1 term and the acceptance statistics need the target; computing them is cheap next to the forward,
    # so they are computed even when l1_weight is 0 (DFlash), for logging.
    q = torch.softmax(logits, dim=-1)
    with torch.no_grad():
        if target_log_partition is None:
            p = torch.softmax(target_logits.float(), dim=-1)
            outside = None
        else:  # the full distribution on the subset; the rest of its mass lies where q is 0
            p = torch.exp(target_logits.float() - target_log_partition.float()[..., None])
            outside = (1.0 - p.sum(dim=-1)).clamp(min=0.0)
    l1 = (q - p).abs().sum(dim=-1)
    if outside is not None:
        l1 = l1 + outside
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
    ce_loss = (w * ce).sum() / norm
    l1_loss = (w * l1).sum() / norm
    total = ce_weight * ce_loss + l1_weight * l1_loss
    bce_loss = torch.zeros((), device=logits.device)
    if confidence_logits is not None and bce_weight:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), accept, reduction="none")
        bce_loss = (w * bce).sum() / norm
        total = total + bce_weight * bce_loss
    tv = (0.5 * l1.detach() * valid).reshape(bsz, -1, block_size)
    counts = valid.reshape(bsz, -1, block_size).float()
    return LossOutput(
        loss=total,
        ce=ce_loss.detach(),
        l1=l1_loss.detach(),
        bce=bce_loss.detach(),
        tv_sum=tv.sum(dim=(0, 1)),
        count=counts.sum(dim=(0, 1)),
        weight_sum=w_sum.detach(),
        accept=accept,
    )


def acceptance_estimates(tv_sum: torch.Tensor, count: torch.Tensor) -> dict[str, float]:
    """`accept@k = 1 − mean TV_k` per block position, and `τ_est = 1 + Σ_k Π_{i≤k} accept@i`.

    `accept@k` estimates the probability that rejection sampling accepts draft token `k` given that the earlier
    ones were accepted (teacher forcing conditions slot `k` on a correct prefix), so the running product is the
    prefix survival and `τ_est` the expected tokens per round with all γ drafts verified (bonus included).
    Positions never observed count as accept 0.
    """
    accept = torch.where(count > 0, 1.0 - tv_sum / count.clamp(min=1), torch.zeros_like(tv_sum))
    survival = torch.cumprod(accept, dim=0)
    out = {f"accept@{k + 1}": float(a) for k, a in enumerate(accept)}
    out["tau_est"] = 1.0 + float(survival.sum())
    return out
