"""Hardware-aware prefix scheduler (paper Algorithm 1), its lagged variant, and why early stopping matters.

The Appendix A counterexample of the DSpark paper is computed *exactly* (enumeration over the draft token,
no sampling): a retrospective global search biases the output to P(A) = 0.85, the early-stopping and the
lagged schedulers give the target's P(A) = 0.7.
"""

from __future__ import annotations

import pytest
import torch

from dspark_hf.decoding.verification import emitted_token_distribution, greedy_accept, speculative_accept
from dspark_hf.scheduling.policies import (
    HardwareAwarePolicy,
    LaggedHardwareAwarePolicy,
    ScheduleContext,
    UniformHardwareAwarePolicy,
    best_capacity,
    hardware_aware_lengths,
    resolve_policy,
    top_k_lengths,
)
from dspark_hf.scheduling.sps import SPSProfile

# Appendix A: SPS(1)=1.0, SPS(2)=0.5, SPS(3)=0.45 (verification steps per second at B tokens)
APPENDIX_SPS = {1: 1.0, 2: 0.5, 3: 0.45}.__getitem__
P_TARGET = torch.tensor([0.7, 0.3], dtype=torch.float64)  # tokens A, B
Q_DRAFT = torch.tensor([0.5, 0.5], dtype=torch.float64)
C2_GIVEN_X1 = {0: 0.9, 1: 0.0}  # the confidence head reads x1: A -> 0.9, B -> 0


def retrospective_lengths(survival, sps, background_tokens=0):
    """The *wrong* scheduler: search every prefix length and keep the best (peeks past a drop)."""
    lengths = []
    for row in survival.tolist():
        thetas = [(1 + sum(row[:ell])) * sps(1 + ell + background_tokens) for ell in range(len(row) + 1)]
        lengths.append(max(range(len(thetas)), key=thetas.__getitem__))
    return torch.tensor(lengths)


def exact_first_token_distribution(choose_length):
    """Enumerate x1 ~ q; the policy sees a = (0.8, 0.8·c2(x1)); return the emitted first token's law."""
    out = torch.zeros(2, dtype=torch.float64)
    for x1 in (0, 1):
        survival = torch.tensor([[0.8, 0.8 * C2_GIVEN_X1[x1]]], dtype=torch.float64)
        ell = int(choose_length(survival)[0])
        if ell == 0:
            out += Q_DRAFT[x1] * P_TARGET
        else:  # x1 verified: accepted w.p. min(1, p/q), otherwise a residual sample
            accept = min(1.0, float(P_TARGET[x1] / Q_DRAFT[x1]))
            residual = torch.clamp(P_TARGET - Q_DRAFT, min=0)
            residual = residual / residual.sum()
            emitted = torch.zeros(2, dtype=torch.float64)
            emitted[x1] += accept
            emitted += (1 - accept) * residual
            out += Q_DRAFT[x1] * emitted
    return out


def test_appendix_a_retrospective_search_is_biased():
    dist = exact_first_token_distribution(lambda a: retrospective_lengths(a, APPENDIX_SPS))
    torch.testing.assert_close(dist, torch.tensor([0.85, 0.15], dtype=torch.float64))


def test_appendix_a_early_stop_is_exact():
    for x1 in (0, 1):
        survival = torch.tensor([[0.8, 0.8 * C2_GIVEN_X1[x1]]], dtype=torch.float64)
        assert hardware_aware_lengths(survival, APPENDIX_SPS).tolist() == [0]
    dist = exact_first_token_distribution(lambda a: hardware_aware_lengths(a, APPENDIX_SPS))
    torch.testing.assert_close(dist, P_TARGET)


@pytest.mark.parametrize(
    "previous", [None, [[0.8, 0.72]], [[0.8, 0.0]], [[0.99, 0.98]], [[0.1, 0.01]]], ids=lambda p: str(p)
)
def test_appendix_a_lagged_is_exact(previous):
    policy = LaggedHardwareAwarePolicy(sps=SPSProfile({1: 1.0, 2: 2.0, 3: 1 / 0.45}))
    ctx = ScheduleContext(previous_survival=None if previous is None else torch.tensor(previous))
    dist = exact_first_token_distribution(lambda a: policy.choose_lengths(a, ctx))
    torch.testing.assert_close(dist, P_TARGET)


def test_emitted_distribution_is_target_whenever_decision_ignores_token():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        p = torch.rand(6, generator=gen, dtype=torch.float64).softmax(-1)
        q = (3 * torch.rand(6, generator=gen, dtype=torch.float64)).softmax(-1)
        for verified in (False, True):
            torch.testing.assert_close(emitted_token_distribution(p, q, verified), p)


FLAT = SPSProfile({1: 0.1, 64: 0.1}).sps  # verifying more is free
STEEP = SPSProfile({1: 0.1, 2: 0.2, 64: 6.4}).sps  # every token costs a full forward
# the CPU shape measured for SmolLM2-135M: 65 ms at 1, ~107 ms for 2..16, 142 ms at 32, 307 ms at 64
JAGGED = SPSProfile({1: 0.065, 2: 0.107, 16: 0.107, 32: 0.142, 64: 0.307}).sps


@pytest.mark.parametrize(
    "survival, sps, background, expected",
    [
        ([[0.9, 0.8, 0.7]], FLAT, 0, [3]),  # free tokens: verify everything with a > 0
        ([[0.9, 0.8, 0.0]], FLAT, 0, [2]),  # a = 0 is never worth a token
        ([[0.9, 0.8, 0.7]], STEEP, 0, [0]),  # cost doubles with the first token: a=0.9 cannot pay
        ([[0.9, 0.8, 0.7]], JAGGED, 0, [3]),  # past the 1->2 cliff, tokens up to 16 are free
        ([[0.3, 0.1, 0.05]], JAGGED, 0, [0]),  # 1.3 * (1/0.107) < 1/0.065: stuck before the cliff
        ([[0.9, 0.5], [0.95, 0.2]], FLAT, 0, [2, 2]),
        # two requests, second more confident: admission order follows survival across requests
        ([[0.6, 0.3], [0.95, 0.9]], SPSProfile({1: 1.0, 4: 1.0, 5: 3.0, 6: 3.0}).sps, 0, [0, 2]),
        # background load pushes B past the cheap region: fewer tokens verified
        ([[0.9, 0.8, 0.7, 0.6]], SPSProfile({1: 0.1, 4: 0.1, 5: 0.13, 64: 2.0}).sps, 0, [3]),
        ([[0.9, 0.8, 0.7, 0.6]], SPSProfile({1: 0.1, 4: 0.1, 5: 0.13, 64: 2.0}).sps, 30, [0]),
    ],
)
def test_hardware_aware_table(survival, sps, background, expected):
    assert hardware_aware_lengths(torch.tensor(survival), sps, background).tolist() == expected


def test_lagged_escapes_the_jagged_local_optimum():
    """Low per-token survival cannot pay for the 1->2 cliff one token at a time; a global K can."""
    survival = torch.tensor([[0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2]])
    assert hardware_aware_lengths(survival, JAGGED).tolist() == [0]
    k = best_capacity(survival, JAGGED)
    assert k == 7
    assert top_k_lengths(survival, k).tolist() == [7]
    policy = LaggedHardwareAwarePolicy(sps=SPSProfile({1: 0.065, 2: 0.107, 16: 0.107, 32: 0.142, 64: 0.307}))
    assert policy.choose_lengths(survival, ScheduleContext(previous_survival=survival)).tolist() == [7]


def test_top_k_respects_prefix_and_ties():
    survival = torch.tensor([[0.9, 0.5, 0.5], [0.5, 0.4, 0.1]])
    assert top_k_lengths(survival, 2).tolist() == [2, 0]
    assert top_k_lengths(survival, 3).tolist() == [3, 0]
    assert top_k_lengths(survival, 4).tolist() == [3, 1]


def test_verified_length_falls_with_background_load():
    policy = HardwareAwarePolicy(sps=SPSProfile({1: 0.065, 2: 0.107, 16: 0.107, 32: 0.142, 64: 0.307, 128: 0.62}))
    survival = torch.tensor([[0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5]])
    lengths = [
        int(policy.choose_lengths(survival, ScheduleContext(background_tokens=bg))[0]) for bg in (0, 14, 30, 60, 120)
    ]
    assert lengths[0] == 7 and lengths[-1] < lengths[0]
    assert all(a >= b for a, b in zip(lengths, lengths[1:])), lengths


def test_resolve_hardware_policies():
    assert resolve_policy("hardware_aware") == HardwareAwarePolicy()
    assert resolve_policy("hardware_aware:32") == HardwareAwarePolicy(background_tokens=32)
    assert resolve_policy("hardware_aware_lagged:8") == LaggedHardwareAwarePolicy(background_tokens=8)
    assert resolve_policy(None, has_confidence=True, calibrated=True) == UniformHardwareAwarePolicy()
    assert resolve_policy(None, has_confidence=True, calibrated=False).name == "fixed"
    with pytest.raises(ValueError, match="needs the target's SPS profile"):
        HardwareAwarePolicy().choose_lengths(torch.tensor([[0.5]]))


def test_greedy_and_speculative_accept_rules():
    logits = torch.tensor([[0.0, 5.0, 0.0], [4.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    assert greedy_accept(torch.tensor([1, 0]), logits) == (2, 2)
    assert greedy_accept(torch.tensor([1, 2]), logits) == (1, 0)
    assert greedy_accept(torch.tensor([], dtype=torch.long), logits) == (0, 1)
    # speculative: empirical first-token law equals p (q very different)
    p = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.1, 0.8]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(20000):
        x = int(torch.multinomial(q[0], 1, generator=gen))
        n, nxt = speculative_accept(torch.tensor([x]), q, p, gen)
        counts[x if n == 1 else nxt] += 1
    torch.testing.assert_close(counts / counts.sum(), p[0].float(), atol=0.012, rtol=0)
