"""Accept/reject math of speculative decoding as pure functions on tensors.

`generate()` uses transformers' own implementation of the same rules; these functions serve the batched
engine, the exactness arguments in the tests, and anyone who wants to reason about a round by hand.

Rejection sampling (Leviathan et al., 2023; Chen et al., 2023): draft token `x_k ~ q_k` is accepted with
probability `min(1, p_k(x_k) / q_k(x_k))`; at the first rejection the replacement is drawn from
`normalize(max(p_k - q_k, 0))`; if every verified token is accepted the bonus token is drawn from
`p_{ℓ+1}`. The emitted token then has exactly the distribution `p_k`, whatever `q_k` is.
"""

from __future__ import annotations

import torch


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`normalize(max(p - q, 0))` along the last dimension; falls back to `p` where that mass is ~0."""
    residual = torch.clamp(p - q, min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    tiny = torch.finfo(p.dtype).tiny
    return torch.where(mass > tiny, residual / mass.clamp_min(tiny), p)


def emitted_token_distribution(p: torch.Tensor, q: torch.Tensor, verified: bool) -> torch.Tensor:
    """Exact distribution of the token emitted at a position whose draft token was drawn from `q`.

    If the position is verified, the emitted token is the draft token when accepted and a residual sample
    otherwise; if not, the target samples it from `p` directly. Both cases give `p` (a test checks this);
    they differ only when the decision `verified` depends on the draft token itself.
    """
    if not verified:
        return p
    accept = torch.minimum(torch.ones_like(p), p / q.clamp_min(torch.finfo(p.dtype).tiny)) * (q > 0)
    rejected_mass = (q * (1 - accept)).sum(dim=-1, keepdim=True)
    return q * accept + rejected_mass * residual_distribution(p, q)


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification of one request.

    Args:
        draft_tokens (`torch.LongTensor` of shape `(ℓ,)`): the verified drafted tokens.
        target_logits (`torch.Tensor` of shape `(ℓ + 1, V)`): processed target logits at those positions
            plus the bonus position.

    Returns:
        `tuple[int, int]`: the number of accepted drafts `n` and the target's token at position `n`.
    """
    choice = target_logits.argmax(dim=-1)
    matches = (choice[: draft_tokens.numel()] == draft_tokens).long()
    n = int(torch.cumprod(matches, dim=0).sum()) if draft_tokens.numel() else 0
    return n, int(choice[n])


def speculative_accept(
    draft_tokens: torch.Tensor,
    q_probs: torch.Tensor,
    p_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Rejection-sampling verification of one request.

    Args:
        draft_tokens (`torch.LongTensor` of shape `(ℓ,)`): the verified drafted tokens.
        q_probs (`torch.Tensor` of shape `(ℓ, V)`): the distributions they were drawn from.
        p_probs (`torch.Tensor` of shape `(ℓ + 1, V)`): the target's distributions (processed).
        generator (`torch.Generator`, *optional*): random source.

    Returns:
        `tuple[int, int]`: the number of accepted drafts `n` and the token emitted at position `n`.
    """
    length = draft_tokens.numel()
    idx = torch.arange(length, device=draft_tokens.device)
    p_x = p_probs[idx, draft_tokens]
    q_x = q_probs[idx, draft_tokens]
    u = torch.rand(length, generator=generator, dtype=p_probs.dtype, device=p_probs.device)
    accepted = (u * q_x <= p_x).long()
    n = int(torch.cumprod(accepted, dim=0).sum()) if length else 0
    dist = residual_distribution(p_probs[n], q_probs[n]) if n < length else p_probs[n]
    return n, int(categorical_draw(dist[None], generator)[0])


def categorical_draw(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row drawn with probability proportional to `weights` (`[R, V]`, non-negative, each row with
    a positive sum), without a host sync: inverse-CDF sampling with one uniform per row.

    In float64, the index `i` with `c_{i-1} <= u < c_i`, where `c` is the running sum of the row and
    `u ~ U[0, c_V)`, is drawn with probability `w_i / sum(w)` (to float64 rounding of the running sum). An
    index of weight 0 adds nothing to the running sum, so it is never drawn. One `[R, V]` cumulative sum and
    one random number per row: on a CPU ~9x cheaper than `torch.multinomial` or an exponential race, which
    both spend a random draw or a logarithm on each of the `V` entries.
    """
    sums = weights.double().cumsum(dim=-1)
    total = sums[:, -1:]
    device = generator.device if generator is not None else sums.device
    u = torch.rand(total.shape, dtype=sums.dtype, device=device, generator=generator).to(sums.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u * total may round up to total
    # a row without positive weight (NaN logits) would index past the end: kept in range, like an argmax would
    return torch.searchsorted(sums, u, right=True)[:, 0].clamp_(max=weights.shape[-1] - 1)
