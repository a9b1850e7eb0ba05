"""The adaptive policy: a fixed length with a payoff guard, decided before drafting from measured rates.

Driven here with synthetic rounds (rates chosen by the test): it drafts a few rounds first, then measures plain ones,
keeps drafting while drafting emits more tokens per second, falls back to plain decoding when it does not,
probes with a growing back-off, resumes when a probe wins, and re-measures plain rounds while drafting.
Its exactness (a length fixed from earlier rounds only) is checked with the other policies in
`tests/decoding/test_sampling_exactness.py` and `tests/decoding/test_greedy_exactness.py`.
"""

from __future__ import annotations

import pytest
import torch

from dspark_hf.scheduling.policies import AdaptivePolicy, ScheduleContext, resolve_policy

PLAIN_SECONDS = 0.020  # one token per plain round: 50 tokens/s
DRAFT_SECONDS = 0.004


def _round(policy, context, accepted: int, rows: int = 1, gamma: int = 7) -> int:
    """Plan one round, then report it: a plain round takes PLAIN_SECONDS, a drafting round 1.1x that plus
    DRAFT_SECONDS and emits `accepted + 1` tokens per row. Returns the planned length."""
    length = policy.plan_length(rows, gamma, context)
    if length == 0:
        policy.observe_round(context, rows, rows, PLAIN_SECONDS, verified=[0] * rows, accepted=[0] * rows)
    else:
        policy.observe_round(
            context,
            rows,
            rows * (1 + length),
            1.1 * PLAIN_SECONDS,
            draft_seconds=DRAFT_SECONDS,
            verified=[length] * rows,
            accepted=[min(accepted, length)] * rows,
        )
    return length


def test_drafts_first_then_measures_plain_and_keeps_drafting_while_it_pays():
    policy, context = AdaptivePolicy(n=4), ScheduleContext()
    lengths = [_round(policy, context, accepted=2) for _ in range(40)]  # 3 tokens per 26 ms: 115 tokens/s
    assert lengths[:3] == [4, 4, 4]  # warmup_drafts: a reply's opening rounds are drafted
    assert lengths[3:5] == [0, 0]  # plain_samples
    drafting = lengths[5:]
    assert drafting.count(4) >= 32 and drafting.count(0) <= 2  # one plain re-measure per refresh_every
    assert drafting[16] == 0 and drafting[:16].count(0) == 0


def test_backs_off_when_drafting_loses_and_probes_with_a_growing_wait():
    policy, context = AdaptivePolicy(n=4), ScheduleContext()
    lengths = [_round(policy, context, accepted=0) for _ in range(200)]  # 1 token per 26 ms: slower than plain
    probes = [i for i, n in enumerate(lengths) if n and i >= 5]
    assert lengths[5] == 0  # gave up after the warm-up
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == 13  # 8 plain rounds after the warm-up's verdict
    assert gaps == [17, 33, 65, 65]  # then 16, 32, 64 and 64 (the cap) plain rounds between probes
    assert sum(1 for n in lengths if n) <= 3 + len(probes)


def test_a_winning_probe_resumes_drafting():
    policy, context = AdaptivePolicy(n=4), ScheduleContext()
    for _ in range(29):  # 3 drafts, 2 plain, 8 plain, a losing probe, 15 of the 16 plain rounds before the next
        _round(policy, context, accepted=0)
    assert policy.plan_length(1, 7, context) == 0
    # the text turns predictable: the next probe accepts everything, and drafting resumes for good
    lengths = [_round(policy, context, accepted=4) for _ in range(60)]
    first = lengths.index(4)
    assert first == 1
    assert lengths[first:].count(4) >= len(lengths[first:]) - 3


def test_rates_are_kept_per_batch_size():
    policy, context = AdaptivePolicy(n=2), ScheduleContext()
    for _ in range(10):
        _round(policy, context, accepted=2, rows=1)
        _round(policy, context, accepted=0, rows=8)
    assert policy.plan_length(1, 7, context) == 2
    assert policy.plan_length(8, 7, context) == 0


def test_length_is_capped_by_the_block_and_the_string_form_parses():
    policy = resolve_policy("adaptive:9", has_confidence=False)
    assert isinstance(policy, AdaptivePolicy) and policy.n == 9 and not policy.needs_confidence
    context = ScheduleContext()
    for _ in range(2):
        _round(policy, context, accepted=0, gamma=3)
    assert policy.plan_length(1, 3, context) == 3
    assert resolve_policy("adaptive", has_confidence=False).n == 4
    with pytest.raises(ValueError, match="adaptive"):
        resolve_policy("adaptive:0")


@pytest.mark.parametrize("history", ["fresh", "drafting", "losing"])
def test_appendix_a_adaptive_is_exact(history):
    """Whatever earlier rounds taught it, the length does not depend on the current x1: exact output."""
    from test_scheduler_hardware import P_TARGET, exact_first_token_distribution

    policy, context = AdaptivePolicy(n=1, plain_samples=0, warmup_drafts=1), ScheduleContext()
    for _ in range(12 if history != "fresh" else 0):
        _round(policy, context, accepted=1 if history == "drafting" else 0)
    dist = exact_first_token_distribution(lambda a: policy.choose_lengths(a, context))
    torch.testing.assert_close(dist, P_TARGET)
