"""The uniform hardware-aware policy: one length for the whole batch, fixed before drafting, from measured costs.

Checked here on tensors: the length it picks for known costs (table), that the draft's cost and the batch size
push it to shorter lengths and finally to `0` (skip drafting), that it learns its costs and survival from the
rounds it observes, and that it is exact on the paper's Appendix A counterexample whatever it has seen.
"""

from __future__ import annotations

import pytest
import torch
from test_scheduler_hardware import P_TARGET, exact_first_token_distribution

from dspark_hf.scheduling.policies import ScheduleContext, UniformHardwareAwarePolicy, resolve_policy, uniform_length
from dspark_hf.scheduling.sps import SPSProfile

FLAT = SPSProfile({1: 0.1, 256: 0.1}).sps  # verifying more is free
LINEAR = SPSProfile({1: 0.1, 2: 0.2, 256: 25.6}).sps  # every token costs a full forward
# stock CPU kernels on SmolLM2-135M (docs/cpu-packing.md): 2 tokens cost more than 8
CPU = SPSProfile({1: 0.058, 2: 0.0977, 4: 0.0941, 8: 0.0857, 16: 0.0945, 32: 0.1293, 64: 0.1826}).sps
# the then-shipped round-1 draft's prefix survival at temperature 0 (research/2026-12-02-round1-drafts/)
SURVIVAL = torch.tensor([0.30, 0.10, 0.05, 0.02, 0.01, 0.0, 0.0])


@pytest.mark.parametrize(
    "survival, rows, sps, draft, measured, expected",
    [
        ([0.9, 0.8, 0.7], 1, FLAT, 0.0, None, 3),  # free tokens: the whole block
        ([0.9, 0.8, 0.0], 1, FLAT, 0.0, None, 2),  # survival 0 earns nothing; the tie keeps the shorter
        ([0.9, 0.8, 0.7], 1, LINEAR, 0.0, None, 0),  # a = 0.9 cannot pay for a second full forward
        ([0.9, 0.8, 0.7], 1, FLAT, 0.3, None, 0),  # 3 forwards' worth of drafting is too dear for 3.4 tokens
        ([0.9, 0.8, 0.7], 1, FLAT, 0.05, None, 3),  # cheap drafting pays
        # rounds measured 10x faster than the profile says: the same 0.05 s of drafting no longer pays
        ([0.9, 0.8, 0.7], 1, FLAT, 0.05, {1: 0.01}, 0),
        # the stock CPU curve at the shipped draft's survival, 12 ms of drafting: at R=1 the 1 -> 2 cliff and
        # the draft are too dear for 1.48 tokens a round...
        (SURVIVAL.tolist(), 1, CPU, 0.012, None, 0),
        # ...unless a measured 8-token round is cheaper than the profile says (70 ms, not 1.48 x 62 ms)
        (SURVIVAL.tolist(), 1, CPU, 0.012, {1: 0.062, 8: 0.070}, 7),
        (SURVIVAL.tolist(), 2, CPU, 0.012, None, 3),  # 2 rows: 8 tokens are the cheapest point of the curve
        (SURVIVAL.tolist(), 8, CPU, 0.012, None, 1),
        (SURVIVAL.tolist(), 16, CPU, 0.012, None, 0),  # 16 rows: every extra position costs 16 tokens
    ],
)
def test_uniform_length_table(survival, rows, sps, draft, measured, expected):
    assert uniform_length(torch.tensor(survival), rows, sps, draft, measured=measured) == expected


def test_uniform_length_falls_with_load():
    """Rows (and background tokens) make every extra position cost `rows` tokens; L falls to 0."""
    sps = SPSProfile({1: 0.05, 8: 0.05, 16: 0.06, 32: 0.08, 64: 0.13, 128: 0.25, 256: 0.5}).sps
    survival = torch.tensor([0.7, 0.5, 0.35, 0.25, 0.15, 0.1, 0.05])
    by_rows = [uniform_length(survival, r, sps, draft_seconds=0.005) for r in (1, 2, 4, 8, 16, 32, 64)]
    assert by_rows == [7, 5, 4, 3, 2, 1, 0]
    by_bg = [uniform_length(survival, 1, sps, 0.005, background_tokens=bg) for bg in (0, 4, 16, 64)]
    assert by_bg == [7, 4, 0, 0]
    assert all(a >= b for a, b in zip(by_bg, by_bg[1:])) and by_bg[0] > by_bg[-1], by_bg


def test_uniform_length_rejects_a_broken_profile():
    with pytest.raises(ValueError, match="must be positive"):
        uniform_length(torch.tensor([0.5]), 1, lambda b: 0.0)


def test_policy_learns_costs_and_survival_from_rounds():
    policy = UniformHardwareAwarePolicy(sps=SPSProfile({1: 0.1, 256: 0.1}), smoothing=0.5, plain_samples=0)
    ctx = ScheduleContext()
    assert policy.plan_length(2, 3, ctx) == 3  # prior 0.7^k, free tokens, drafting not yet measured
    drafted = torch.tensor([[0.6, 0.3, 0.1]] * 2)
    policy.observe_round(ctx, rows=2, forward_tokens=8, rest_seconds=0.13, draft_seconds=0.3, survival=drafted)
    torch.testing.assert_close(ctx.survival_estimate, torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64))
    assert ctx.draft_seconds == {2: [0.3]} and ctx.round_seconds == {(2, 8): [0.13]}
    # 0.3 s of drafting for 2 extra tokens: Θ(3) = 4 / 0.43 < Θ(0) = 2 / 0.1 (the profile's) -> skip drafting
    assert policy.plan_length(2, 3, ctx) == 0
    assert policy.plan_length(5, 3, ctx) == 0  # an unmeasured batch size borrows the nearest one's costs
    # a plain round: its measured time replaces the profile's guess for 2 tokens
    policy.observe_round(ctx, rows=2, forward_tokens=2, rest_seconds=0.2)
    assert ctx.round_seconds[(2, 2)] == [0.2] and ctx.draft_seconds == {2: [0.3]}
    assert policy.plan_length(2, 3, ctx) == 0  # Θ(0) = 2 / 0.2 = 10 still beats Θ(3) = 4 / 0.43
    # a fast drafting round with perfect survival: medians and the running mean make L = 3 pay
    policy.observe_round(
        ctx, rows=2, forward_tokens=8, rest_seconds=0.13, draft_seconds=0.01, survival=torch.tensor([[1.0, 1.0, 1.0]])
    )
    torch.testing.assert_close(ctx.survival_estimate, torch.tensor([0.8, 0.65, 0.55], dtype=torch.float64))
    assert policy.plan_length(2, 3, ctx) == 3  # Θ(3) = 2 · 3.0 / (0.13 + 0.155) = 21
    # choose_lengths follows the plan of the round, or plans itself when called alone
    ctx.planned_length = 1
    assert policy.choose_lengths(torch.rand(3, 3), ctx).tolist() == [1, 1, 1]
    assert policy.choose_lengths(torch.rand(2, 3), ScheduleContext()).tolist() == [3, 3]


def test_plain_rounds_are_measured_first_at_each_batch_size():
    policy = UniformHardwareAwarePolicy(sps=SPSProfile({1: 0.1, 256: 0.1}), plain_samples=2)
    ctx = ScheduleContext()
    plans = []
    for _ in range(4):
        plans.append(policy.plan_length(3, 4, ctx))
        policy.observe_round(ctx, rows=3, forward_tokens=3 * (1 + plans[-1]), rest_seconds=0.1)
    assert plans == [0, 0, 4, 4]  # two plain rounds, then the free whole block
    assert policy.plan_length(2, 4, ctx) == 0  # a new batch size starts plain again


def test_survival_is_rescaled_by_what_was_really_accepted():
    """Confidences that promise twice the accepted drafts they deliver are halved before planning."""
    policy = UniformHardwareAwarePolicy(sps=SPSProfile({1: 0.1, 256: 0.1}), plain_samples=0, smoothing=0.5)
    ctx = ScheduleContext()
    survival = torch.tensor([[0.8, 0.6, 0.4], [0.8, 0.6, 0.4]])
    kwargs = dict(rows=2, forward_tokens=8, rest_seconds=0.1, draft_seconds=0.02, survival=survival)
    policy.observe_round(ctx, **kwargs, verified=[3, 3], accepted=[1, 2])  # 3.6 promised, 3 delivered
    assert (ctx.predicted_accepted, ctx.realized_accepted) == (pytest.approx(3.6), 3.0)
    policy.observe_round(ctx, **kwargs, verified=[3, 1], accepted=[0, 0])  # 2.6 promised, none delivered
    assert ctx.predicted_accepted == pytest.approx(0.5 * 3.6 + 2.6) and ctx.realized_accepted == 1.5
    # (1.5 + 1) / (4.4 + 1) of the promise delivered (one accepted draft's worth of prior for calibration):
    # 3 drafts per request no longer pay for 120 ms of drafting (Θ(3) = 2 · 1.83 / 0.22 < Θ(0) = 2 / 0.1)
    ctx.draft_seconds = {2: [0.12]}
    assert policy.plan_length(2, 3, ctx) == 0
    ctx.predicted_accepted = ctx.realized_accepted  # a calibrated head: the whole block pays (2 · 2.8 / 0.22)
    assert policy.plan_length(2, 3, ctx) == 3


@pytest.mark.parametrize("prior_weight, idle_decay, tries_again", [(1.0, 0.95, True), (0.0, 1.0, False)])
def test_a_few_unlucky_rounds_do_not_stop_drafting_for_good(prior_weight, idle_decay, tries_again):
    """Rounds that happened to accept nothing must not lock the policy at `L = 0`: only drafting rounds add
    evidence, so with the bare ratio (the control, `prior_weight=0, idle_decay=1`) it would never draft again,
    however good the draft. With the pseudo-count and the evidence fading in plain rounds it drafts again."""
    policy = UniformHardwareAwarePolicy(
        sps=SPSProfile({1: 0.1, 256: 0.1}),
        plain_samples=0,
        prior_weight=prior_weight,
        idle_decay=idle_decay,
        explore=0,  # no probes: the evidence alone must bring drafting back
    )
    ctx = ScheduleContext()
    survival = torch.tensor([[0.5, 0.25, 0.125]])
    assert policy.plan_length(1, 3, ctx) == 3  # confidences taken at their word, drafting is cheap
    for _ in range(3):  # three unlucky rounds in a row (one in 8 for calibrated confidences of 0.5)
        policy.observe_round(
            ctx, rows=1, forward_tokens=4, rest_seconds=0.1, draft_seconds=0.04, survival=survival, verified=[3],
            accepted=[0],
        )  # fmt: skip
    assert policy.plan_length(1, 3, ctx) == 0  # the evidence now says the confidences overstate by far
    plans = []
    for _ in range(60):  # plain rounds
        plans.append(policy.plan_length(1, 3, ctx))
        if plans[-1]:
            break
        policy.observe_round(ctx, rows=1, forward_tokens=1, rest_seconds=0.1)
    assert (plans[-1] > 0) is tries_again, plans
    if tries_again:
        assert len(plans) < 40, len(plans)  # within a few dozen rounds


def test_policy_keeps_a_window_of_timings():
    policy = UniformHardwareAwarePolicy(sps=SPSProfile({1: 0.1, 256: 0.1}), window=2)
    ctx = ScheduleContext()
    for seconds in (0.5, 0.2, 0.3):
        policy.observe_round(ctx, rows=1, forward_tokens=1, rest_seconds=seconds, draft_seconds=seconds / 10)
    assert ctx.round_seconds == {(1, 1): [0.2, 0.3]} and ctx.draft_seconds == {1: [0.02, 0.03]}


def test_measured_times_replace_the_model():
    survival = torch.tensor([0.5, 0.25])
    assert uniform_length(survival, 1, FLAT) == 2  # free tokens on the profile
    # what the rounds measured: every token costs a full forward
    assert uniform_length(survival, 1, FLAT, measured={1: 0.1, 2: 0.2, 3: 0.3}) == 0
    assert uniform_length(survival, 1, FLAT, measured={1: 0.1, 3: 0.3}) == 1  # 2 tokens: still the profile's


@pytest.mark.parametrize("estimate", [None, [0.8, 0.72], [0.8, 0.0], [0.99, 0.98], [0.1, 0.01]], ids=str)
def test_appendix_a_uniform_is_exact(estimate):
    """Whatever earlier rounds taught it, the length does not depend on the current x1: exact output."""
    policy = UniformHardwareAwarePolicy(sps=SPSProfile({1: 1.0, 2: 2.0, 3: 1 / 0.45}))
    ctx = ScheduleContext(survival_estimate=None if estimate is None else torch.tensor(estimate))
    dist = exact_first_token_distribution(lambda a: policy.choose_lengths(a, ctx))
    torch.testing.assert_close(dist, P_TARGET)


def test_resolve_uniform_policy():
    assert resolve_policy("hardware_aware_uniform") == UniformHardwareAwarePolicy()
    assert resolve_policy("hardware_aware_uniform:16") == UniformHardwareAwarePolicy(background_tokens=16)
    with pytest.raises(ValueError, match="hardware_aware_uniform"):
        resolve_policy("hardware_aware_uniformly")


def test_appendix_a_control_uniform_from_current_survival_is_biased():
    """The same search fed the *current* block's survival (not earlier rounds') peeks at x1: biased output."""
    sps = SPSProfile({1: 1.0, 2: 2.0, 3: 1 / 0.45}).sps
    dist = exact_first_token_distribution(lambda a: torch.tensor([uniform_length(a[0], 1, sps)]))
    torch.testing.assert_close(dist, torch.tensor([0.85, 0.15], dtype=torch.float64))


def test_a_round_that_drafted_fewer_positions_updates_only_those():
    """Drafting stops at the planned length: a short round's survival updates the positions it drafted and
    leaves the others; positions never drafted continue the last estimate at the prior's rate."""
    policy = UniformHardwareAwarePolicy(sps=SPSProfile({1: 0.1, 256: 0.1}), smoothing=0.5, plain_samples=0)
    ctx = ScheduleContext()
    policy.observe_round(ctx, rows=1, forward_tokens=3, rest_seconds=0.1, survival=torch.tensor([[0.8, 0.4]]))
    torch.testing.assert_close(ctx.survival_estimate, torch.tensor([0.8, 0.4], dtype=torch.float64))
    # planning over a block of 4: positions 3 and 4 are extrapolated from position 2 (0.4 · 0.7, 0.4 · 0.49)
    assert policy.plan_length(1, 4, ctx) == 4  # free tokens, nothing measured against them
    policy.observe_round(ctx, rows=1, forward_tokens=5, rest_seconds=0.1, survival=torch.tensor([[1.0, 0.8, 0.6, 0.4]]))
    torch.testing.assert_close(ctx.survival_estimate, torch.tensor([0.9, 0.6, 0.6, 0.4], dtype=torch.float64))
    policy.observe_round(ctx, rows=1, forward_tokens=2, rest_seconds=0.1, survival=torch.tensor([[0.5]]))
    torch.testing.assert_close(ctx.survival_estimate, torch.tensor([0.7, 0.6, 0.6, 0.4], dtype=torch.float64))


def test_fixed_policy_plans_its_length_before_drafting():
    from dspark_hf.scheduling.policies import FixedPolicy

    ctx = ScheduleContext()
    assert FixedPolicy().plan_length(1, 7, ctx) is None  # the whole block: nothing to save
    assert FixedPolicy(n=2).plan_length(1, 7, ctx) == 2
    assert FixedPolicy(n=9).plan_length(1, 7, ctx) == 7
    assert FixedPolicy(n=0).plan_length(1, 7, ctx) == 0  # a plain round


def _cold_start(policy, ctx, rows=1):
    """Plain rounds, then one cold drafting round at `rows` that measured everything badly: low survival and
    a slow draft and forward. On this evidence alone no length ever pays again."""
    for _ in range(policy.plain_samples):
        policy.observe_round(ctx, rows=rows, forward_tokens=rows, rest_seconds=0.1)
    policy.observe_round(
        ctx, rows=rows, forward_tokens=4 * rows, rest_seconds=0.3, draft_seconds=0.2,
        survival=torch.tensor([[0.05, 0.01, 0.001]] * rows), verified=[3] * rows, accepted=[0] * rows,
    )  # fmt: skip


@pytest.mark.parametrize("explore", [16, 0])
def test_a_cold_first_drafting_round_does_not_settle_the_verdict(explore):
    """One cold drafting round (low survival, slow) would keep the policy plain for good: survival and costs
    are only measured by drafting rounds. Probes re-measure: after `explore` plain rounds it drafts one
    round at the best drafting length, and, with good measurements from it, goes on drafting. The control
    (`explore=0`) never drafts again within 300 rounds."""
    policy = UniformHardwareAwarePolicy(sps=SPSProfile({1: 0.1, 2: 0.1, 3: 0.1, 4: 0.1}), explore=explore)
    ctx = ScheduleContext()
    _cold_start(policy, ctx)
    plans = []
    for _ in range(300):
        plans.append(policy.plan_length(1, 3, ctx))
        if plans[-1]:
            break
        policy.observe_round(ctx, rows=1, forward_tokens=1, rest_seconds=0.1)
    if not explore:
        assert set(plans) == {0} and len(plans) == 300
        return
    assert plans[-1] >= 1 and len(plans) == explore + 1, plans  # the probe, after `explore` plain rounds
    assert ctx.probing
    for _ in range(3):  # the probe and what follows measure a warm, well-predicted draft
        policy.observe_round(
            ctx, rows=1, forward_tokens=4, rest_seconds=0.1, draft_seconds=0.005,
            survival=torch.tensor([[0.9, 0.8, 0.7]]), verified=[3], accepted=[3],
        )  # fmt: skip
    assert not ctx.probing
    assert ctx.probe_wait[1] == explore  # the probe paid (4 tokens in 0.105 s vs 1 in 0.1 s): shortest wait
    assert policy.plan_length(1, 3, ctx) == 3  # and drafting pays now: the verdict turned


def test_probes_back_off_while_drafting_keeps_losing():
    """Each probe that leaves the verdict at "plain" doubles the wait (16, 32, 64, ..., capped at
    `explore_max`): a draft that cannot pay costs at most one round in `explore_max`."""
    policy = UniformHardwareAwarePolicy(sps=SPSProfile({1: 0.1, 2: 0.1, 3: 0.1, 4: 0.1}), explore=16, explore_max=64)
    ctx = ScheduleContext()
    _cold_start(policy, ctx)
    probes, since = [], 0
    for _ in range(400):
        length = policy.plan_length(1, 3, ctx)
        since += 1
        if length:
            probes.append(since)
            since = 0
            policy.observe_round(  # the probe loses again: slow draft, nothing accepted
                ctx, rows=1, forward_tokens=1 + length, rest_seconds=0.3, draft_seconds=0.2,
                survival=torch.tensor([[0.05, 0.01, 0.001]]), verified=[length], accepted=[0],
            )  # fmt: skip
        else:
            policy.observe_round(ctx, rows=1, forward_tokens=1, rest_seconds=0.1)
    assert probes[:4] == [17, 33, 65, 65], probes  # each wait, plus the probe round itself
    assert set(probes[3:]) == {65}


def _drive(policy, ctx, rounds, *, rows=1, gamma=3, rest=0.1, draft=0.05, accepted=0, survival=(0.9, 0.8, 0.7)):
    """Run `rounds` planned rounds at batch size `rows` and return the planned lengths. A drafting round (the
    plan > 0) takes `rest` + `draft` seconds and keeps `accepted` drafts per row under confidences `survival`;
    a plain round emits one token per row in 0.1 s."""
    plans = []
    for _ in range(rounds):
        length = policy.plan_length(rows, gamma, ctx)
        plans.append(length)
        if length:
            policy.observe_round(
                ctx, rows=rows, forward_tokens=rows * (1 + length), rest_seconds=rest, draft_seconds=draft,
                survival=torch.tensor([list(survival)] * rows), verified=[length] * rows, accepted=[accepted] * rows,
            )  # fmt: skip
        else:
            policy.observe_round(ctx, rows=rows, forward_tokens=rows, rest_seconds=0.1)
    return plans


@pytest.mark.parametrize("guard_after", [4, 0])
def test_the_payoff_guard_overrules_a_plan_that_measured_rounds_contradict(guard_after):
    """The plan trusts confidences that promise 2.4 accepted drafts a round (a large calibration pseudo-count
    keeps it from learning otherwise); the drafting rounds really accept nothing and emit 1 token in 0.15 s
    where plain rounds emit 1 in 0.1 s. The guard stops drafting after `guard_after` such rounds; without it
    (`guard_after=0`, the control) the policy keeps drafting."""
    policy = UniformHardwareAwarePolicy(
        sps=SPSProfile({1: 0.1, 4: 0.1}), prior_weight=100.0, guard_after=guard_after, explore=0
    )
    ctx = ScheduleContext()
    plans = _drive(policy, ctx, 20)
    assert plans[:3] == [0, 0, 0]  # plain rounds measured first
    if guard_after:
        assert plans[3:7] == [3, 3, 3, 3] and set(plans[7:]) == {0}, plans
        state = ctx.payoff[1]
        assert state.draft_rate < state.plain_rate
    else:
        assert plans[3:].count(3) >= 16, plans  # drafting on (but for the one plain refresh in 16)


@pytest.mark.parametrize("inherit", [True, False])
def test_a_loss_measured_at_a_small_batch_stands_for_larger_ones(inherit):
    """The guard settles that drafting loses at batch size 1 (as in the test above); then the batch grows to 4,
    where the plan alone (confidences promising 2.4 accepted drafts) would draft. With `inherit_veto` the policy
    neither drafts nor probes at 4; the control (`inherit_veto=False`) drafts there again, paying its own
    warm-up drafts as a server does at every batch size it passes through."""
    policy = UniformHardwareAwarePolicy(
        sps=SPSProfile({1: 0.1, 4: 0.1, 8: 0.1, 32: 0.1}), prior_weight=100.0, inherit_veto=inherit
    )
    ctx = ScheduleContext()
    _drive(policy, ctx, 12)  # batch 1: plain rounds, then drafting rounds that accept nothing, until the guard stops
    assert ctx.payoff[1].drafts >= policy.guard_after and ctx.payoff[1].draft_rate < ctx.payoff[1].plain_rate
    # batch 4, past the probe wait (explore = 16): confidences of 0.8, one draft a row accepted
    plans = _drive(policy, ctx, 40, rows=4, accepted=1, survival=(0.8, 0.8, 0.8))
    if inherit:
        assert set(plans) == {0}, plans
    else:
        assert any(plans), plans


@pytest.mark.parametrize("margin", [0.1, 0.0])
def test_a_gain_inside_the_guard_margin_is_not_trusted(margin):
    """Drafting rounds emit 2 tokens in 0.19 s where plain rounds emit 1 in 0.1 s: 5% more per second, inside
    the scatter of round times on a shared host. With the default margin (10%) the guard stops drafting after
    its `guard_after` rounds; with `guard_margin=0` (the control) the 5% counts as a gain and drafting goes on."""
    policy = UniformHardwareAwarePolicy(
        sps=SPSProfile({1: 0.1, 4: 0.1}), prior_weight=100.0, explore=0, guard_margin=margin
    )
    ctx = ScheduleContext()
    plans = _drive(policy, ctx, 24, rest=0.14, accepted=1)
    drafting = sum(1 for n in plans[3:] if n)
    if margin:
        assert drafting == policy.guard_after, plans
    else:
        assert drafting >= 18, plans


@pytest.mark.parametrize("scaled", [True, False])
def test_the_guard_margin_and_waits_shrink_with_what_drafting_costs(scaled):
    """One request on a CPU: a drafting round takes 0.12 s where a plain one takes 0.1 s (a stake of 20%) and
    emits 1.25 tokens: 4% more per second. Scaled by the stake, the margin is 2% and the 4% pays, and a probe is
    due after a fifth of the wait; unscaled (the control) the 10% margin rejects it and the wait is the full 16.
    Where drafting costs a whole plain round or more (a batch) both rules are the same."""
    from dspark_hf.scheduling.payoff import PayoffGuard

    guard = PayoffGuard(after=2, margin=0.1, explore=16, scale_by_stake=scaled)
    for _ in range(5):
        guard.add_round(1, False, 1.0, 0.1)
    for _ in range(3):
        guard.add_round(1, True, 1.25, 0.12)
    assert guard.states[1].stake == pytest.approx(0.2)
    assert guard.vetoed_here(1) is not scaled
    guard.since[1] = 3
    assert guard.probe_due(1) is scaled
    guard.since[1] = 16
    assert guard.probe_due(1)

    for _ in range(5):  # a batch: drafting rounds cost 2.5 plain ones and emit 2.6x the tokens (4% more per second)
        guard.add_round(8, False, 8.0, 0.1)
    for _ in range(3):
        guard.add_round(8, True, 20.8, 0.25)
    assert guard.states[8].stake == pytest.approx(1.5)
    assert guard.vetoed_here(8)
    guard.since[8] = 15
    assert not guard.probe_due(8)


def test_the_shipped_policy_scales_its_guard_by_the_stake():
    assert UniformHardwareAwarePolicy().scale_by_stake
    policy = UniformHardwareAwarePolicy(sps=SPSProfile({1: 0.1, 4: 0.1}))
    ctx = ScheduleContext()
    _drive(policy, ctx, 6)
    assert ctx.guard.scale_by_stake
