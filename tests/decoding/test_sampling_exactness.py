"""Speculative *sampling* with a DSpark draft is exact: it draws from the target's own distribution.

What is tested. A tiny Llama target with a 4-token vocabulary (`markov=True`, `logit_scale=0.2`, fp64) and
the prompt `[1, 2]`. Its exact joint distribution of the first three generated tokens,
`P(x1, x2, x3) = P(x1) P(x2 | x1) P(x3 | x1, x2)`, is computed by enumerating all 4**3 = 64 continuations
through the target's own forward pass (fp64, no approximation; cells range from 0.0065 to 0.028, so none is
negligible). `target.generate(do_sample=True, max_new_tokens=4, assistant_model=draft)` is then run
N = 3000 times (seeded, so the test is deterministic) and the counts of the first three tokens are compared
with `N * P` by Pearson's chi-square goodness-of-fit test (`scipy.stats.chisquare`, 63 degrees of freedom);
the test passes when the p-value is >= alpha = 0.001.

Why `max_new_tokens=4` while only three tokens are scored. The first token always comes from the target's
prefill (the draft needs the target's hidden states). With 4 new tokens the next round may draft and verify
two tokens (x2, x3), so the scored window contains chains of accepts, a rejection + residual resample at
either position and (with the threshold policy) the target's bonus token after a shorter verification.
The first three tokens of an exact sampler follow the marginal `P` whatever comes after them.

The draft (`make_aligned_draft`, block 4) is made *over-confident*: its sequential head's logits are twice
the target's, so `q != p` and both branches of rejection sampling carry weight, while acceptance stays
high (~87% of verified drafts; asserted >= 50%, so the accept path really matters). Two policies run:
`"fixed"` (the whole block every round) and `"threshold:0.5"` with a confidence head set so that the
confidence of position k depends on the previously drafted token: the verified length then varies from
round to round, is 0 in some rounds (asserted) and depends on drafted token values (prefix-only, as the
scheduler requires for losslessness).

Power. Let a "2% shift" be moving 0.02 of probability mass from one cell of the joint to another. The
chi-square statistic is then approximately noncentral chi-square with df = 63 and noncentrality
`lambda = N * sum(delta**2 / p) = N * 0.02**2 * (1/p_a + 1/p_b)`, smallest for the two most probable cells.
At N = 3000 and alpha = 0.001, lambda >= 86 and the power against the *worst* such pair is 0.989 (asserted
>= 0.9 in `test_power_against_a_two_percent_shift`, computed with `scipy.stats.ncx2`); every expected count
is >= 19.

Negative controls (the same procedure must fail, p < alpha):
* a biased acceptance rule: transformers' own `_speculative_sampling` with its uniform `r` divided by
  1.15, i.e. it accepts when `r <= 1.15 * p/q` (residual unchanged);
* a draft-side bug: the draft reports the *uncorrected* backbone logits (without its sequential head) as
  `q`, not the distribution it actually sampled from.

Both controls use the "fixed" policy, where every round sends two drafts through the acceptance test.
(Under "threshold:0.5" a third of the rounds verify nothing, so the same bias moves less mass: p = 0.005 at
this N, not below alpha, hence not asserted.) Runtime: about 6-9 ms per generate() call on one CPU thread,
four runs of N = 3000, about 1.5-2 min in all (measured 85-130 s on a loaded 2-core machine).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import transformers.generation.utils as generation_utils
from scipy import stats
from transformers import GenerationConfig

from dspark_hf import last_generation_stats
from dspark_hf.decoding.generation import DSparkCandidateGenerator
from dspark_hf.scheduling.policies import HardwareAwarePolicy, LaggedHardwareAwarePolicy
from dspark_hf.scheduling.sps import SPSProfile

from helpers import make_aligned_draft, make_target

VOCAB = 4
LOGIT_SCALE = 0.2  # keeps the target's joint far from degenerate (every cell >= 0.0065)
PROMPT = torch.tensor([[1, 2]])
WINDOW = 3  # tokens whose joint distribution is tested
MAX_NEW_TOKENS = 4  # lets one round verify two drafts inside the window (see module docstring)
BLOCK_SIZE = 4
DRAFT_SHARPNESS = 2.0  # the draft's logits are this multiple of the target's: q != p
N = 3000
ALPHA = 1e-3
SHIFT = 0.02
MIN_POWER = 0.9
SEED = 20240607
# the jagged CPU shape measured for SmolLM2-135M (seconds per verification forward at B tokens)
JAGGED = SPSProfile({1: 0.065, 2: 0.107, 16: 0.107, 32: 0.142, 64: 0.307})
POLICIES = [
    "fixed",
    "threshold:0.5",
    HardwareAwarePolicy(sps=JAGGED, background_tokens=0),
    LaggedHardwareAwarePolicy(sps=JAGGED, background_tokens=8),
]
# confidence logit of a block position, by the token before it (c = sigmoid: 0.27, 0.62, 0.88, 0.95)
CONFIDENCE_BY_PREV_TOKEN = [-1.0, 0.5, 2.0, 3.0]
ACCEPTANCE_BIAS = 1.15  # the negative control accepts when r <= ACCEPTANCE_BIAS * p/q


pytestmark = pytest.mark.usefixtures("one_thread")


def _exact_joint(target) -> np.ndarray:
    """`P(x1..x3 | prompt)` for all `VOCAB**3` continuations, in `itertools.product` order (fp64)."""
    cells = torch.tensor(list(itertools.product(range(VOCAB), repeat=WINDOW)))
    ids = torch.cat([PROMPT.expand(len(cells), -1), cells], dim=1)
    start = PROMPT.shape[1] - 1  # logits at position i predict token i + 1
    with torch.no_grad():
        logprobs = torch.log_softmax(target(ids).logits.double(), dim=-1)[:, start : start + WINDOW]
    joint = logprobs.gather(-1, cells[..., None])[..., 0].sum(-1).exp().numpy()
    assert abs(joint.sum() - 1.0) < 1e-12
    return joint


def _make_draft(target):
    draft = make_aligned_draft(target, block_size=BLOCK_SIZE)
    with torch.no_grad():
        draft.markov_head.markov_w2.weight.mul_(DRAFT_SHARPNESS)
        # Backbone states are 0 (the aligned draft zeroes its final norm), so the confidence logit is
        # w . W1[prev]; solve for w so that each previous token gets the logit listed above.
        proj = draft.confidence_head.proj
        d = proj.in_features - draft.markov_head.markov_w1.weight.shape[1]
        w1 = draft.markov_head.markov_w1.weight.double()  # [V, r]
        target_logits = torch.tensor(CONFIDENCE_BY_PREV_TOKEN, dtype=torch.float64)
        w = torch.linalg.lstsq(w1, target_logits[:, None]).solution[:, 0]
        proj.weight.zero_()
        proj.weight[0, d:] = w.to(proj.weight.dtype)
        proj.bias.zero_()
    return draft


@pytest.fixture(scope="module")
def setup():
    target = make_target("llama", vocab_size=VOCAB, num_layers=2, markov=True, logit_scale=LOGIT_SCALE)
    return target, _exact_joint(target)


def _sample(target, draft, policy: str) -> tuple[np.ndarray, dict]:
    """Counts of the first `WINDOW` generated tokens over `N` seeded speculative generate() calls."""
    config = GenerationConfig(do_sample=True, max_new_tokens=MAX_NEW_TOKENS, dspark_policy=policy)
    index = {cell: i for i, cell in enumerate(itertools.product(range(VOCAB), repeat=WINDOW))}
    counts = np.zeros(len(index), dtype=np.int64)
    info = {"accepted": 0, "verified": 0, "lengths": {}, "policy_zero": 0, "rounds_with_drafts": 0}
    torch.manual_seed(SEED)
    for _ in range(N):
        out = target.generate(PROMPT, generation_config=config, assistant_model=draft)
        new = out[0, PROMPT.shape[1] :].tolist()
        assert len(new) == MAX_NEW_TOKENS
        counts[index[tuple(new[:WINDOW])]] += 1
        for r in last_generation_stats(draft).rounds:
            info["accepted"] += r.accepted
            info["verified"] += r.verified
            if r.drafted:  # a drafted round (not the final target-only step when the budget is spent)
                info["lengths"][r.verified] = info["lengths"].get(r.verified, 0) + 1
                info["policy_zero"] += r.verified == 0
                info["rounds_with_drafts"] += r.verified > 0
    return counts, info


def _p_value(counts: np.ndarray, joint: np.ndarray) -> float:
    return float(stats.chisquare(counts, N * joint).pvalue)


def test_power_against_a_two_percent_shift(setup):
    """At N and alpha, any move of 0.02 mass between two cells is detected with probability >= 0.9."""
    _, joint = setup
    df = joint.size - 1
    critical = stats.chi2.isf(ALPHA, df)
    # lambda = N * sum(delta^2 / p) with delta = +-SHIFT on cells a, b: smallest for the two largest cells
    inv = 1.0 / joint
    lam = N * SHIFT**2 * (inv[:, None] + inv[None, :])
    np.fill_diagonal(lam, np.inf)
    power = stats.ncx2.sf(critical, df, lam.min())
    assert power >= MIN_POWER, f"power {power:.3f} < {MIN_POWER} at N={N}, alpha={ALPHA}"
    assert N * joint.min() >= 5, "chi-square approximation needs every expected count >= 5"
    assert joint.min() >= 0.002, "target distribution is (near-)degenerate"


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p if isinstance(p, str) else p.name)
def test_speculative_sampling_matches_target_joint(setup, policy, monkeypatch):
    target, joint = setup
    draft = _make_draft(target)
    original = generation_utils._speculative_sampling
    calls = []

    def spy(*args, **kwargs):  # proves the rejection sampler the negative control patches is the one used
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(generation_utils, "_speculative_sampling", spy)
    counts, info = _sample(target, draft, policy)
    p_value = _p_value(counts, joint)
    print(f"\n{policy}: p={p_value:.4g} acceptance={info['accepted'] / info['verified']:.3f} lengths={info['lengths']}")

    assert p_value >= ALPHA, f"{policy}: first-{WINDOW}-token joint differs from the target's (p={p_value:.3g})"
    assert len(calls) == info["rounds_with_drafts"] > N // 2
    assert info["verified"] > N and info["accepted"] >= 0.5 * info["verified"], info
    if policy == "fixed":
        assert info["policy_zero"] == 0 and max(info["lengths"]) == 2, info
    elif isinstance(policy, str) and policy.startswith("threshold"):
        assert info["policy_zero"] > 0.05 * N, f"the policy should sometimes verify nothing: {info}"
        assert len([k for k, v in info["lengths"].items() if v > 0.05 * N]) == 3, info


@pytest.mark.slow
def test_biased_acceptance_is_detected(setup, monkeypatch):
    """transformers' own rule with `r ~ U(0, 1/1.15)`, i.e. accept iff `r <= 1.15 p/q`, must fail the test."""
    target, joint = setup
    draft = _make_draft(target)
    original = generation_utils._speculative_sampling
    real_rand_like = torch.rand_like

    def biased(*args, **kwargs):
        monkeypatch.setattr(torch, "rand_like", lambda x, *a, **k: real_rand_like(x, *a, **k) / ACCEPTANCE_BIAS)
        try:
            return original(*args, **kwargs)
        finally:
            monkeypatch.setattr(torch, "rand_like", real_rand_like)

    monkeypatch.setattr(generation_utils, "_speculative_sampling", biased)
    counts, info = _sample(target, draft, "fixed")
    p_value = _p_value(counts, joint)
    print(f"\nbiased acceptance: p={p_value:.4g} acceptance={info['accepted'] / info['verified']:.3f}")
    assert p_value < ALPHA


@pytest.mark.slow
def test_uncorrected_draft_distribution_is_detected(setup, monkeypatch):
    """A draft that samples from its corrected `q` but reports the backbone's uncorrected logits must fail."""
    target, joint = setup
    draft = _make_draft(target)
    original = DSparkCandidateGenerator._sample_sequentially

    def uncorrected(self, input_ids, hidden, base_logits):
        tokens, logits, conf = original(self, input_ids, hidden, base_logits)
        return tokens, base_logits.to(logits.dtype), conf

    monkeypatch.setattr(DSparkCandidateGenerator, "_sample_sequentially", uncorrected)
    counts, info = _sample(target, draft, "fixed")
    p_value = _p_value(counts, joint)
    print(f"\nuncorrected q: p={p_value:.4g} acceptance={info['accepted'] / info['verified']:.3f}")
    assert p_value < ALPHA


# temperature, top-k and repetition penalty: the target's logits processors are applied to the draft too
PROCESSED = {"temperature": 0.7, "top_k": 3, "repetition_penalty": 1.3}


def _exact_processed_joint(target) -> np.ndarray:
    """Exact joint of the first tokens when sampling with `PROCESSED` (processors applied per prefix)."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

    processors = LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(PROCESSED["repetition_penalty"]),
            TemperatureLogitsWarper(PROCESSED["temperature"]),
            TopKLogitsWarper(PROCESSED["top_k"]),
        ]
    )
    cells = list(itertools.product(range(VOCAB), repeat=WINDOW))
    joint = np.zeros(len(cells))
    with torch.no_grad():
        for i, cell in enumerate(cells):
            prob = 1.0
            for t in range(WINDOW):
                prefix = torch.cat([PROMPT, torch.tensor([cell[:t]], dtype=torch.long)], dim=1)
                logits = target(prefix).logits[:, -1].double()
                probs = torch.softmax(processors(prefix, logits), dim=-1)[0]
                prob *= float(probs[cell[t]])
            joint[i] = prob
    assert abs(joint.sum() - 1.0) < 1e-9
    return joint


@pytest.mark.slow
def test_sampling_with_temperature_top_k_and_repetition_penalty_is_exact(setup):
    """Same chi-square test with processors: the draft must sample from the *processed* distribution."""
    target, _ = setup
    joint = _exact_processed_joint(target)
    draft = _make_draft(target)
    config = GenerationConfig(do_sample=True, max_new_tokens=MAX_NEW_TOKENS, dspark_policy="fixed", **PROCESSED)
    index = {cell: i for i, cell in enumerate(itertools.product(range(VOCAB), repeat=WINDOW))}
    counts = np.zeros(len(index), dtype=np.int64)
    accepted = verified = 0
    torch.manual_seed(SEED + 1)
    for _ in range(N):
        out = target.generate(PROMPT, generation_config=config, assistant_model=draft)
        counts[index[tuple(out[0, PROMPT.shape[1] : PROMPT.shape[1] + WINDOW].tolist())]] += 1
        accepted += sum(r.accepted for r in last_generation_stats(draft).rounds)
        verified += sum(r.verified for r in last_generation_stats(draft).rounds)
    nonzero = joint > 0  # top-k removes some continuations entirely: they must never appear
    assert counts[~nonzero].sum() == 0
    p_value = float(stats.chisquare(counts[nonzero], N * joint[nonzero] / joint[nonzero].sum()).pvalue)
    print(f"\nprocessed sampling: p={p_value:.4g} acceptance={accepted / max(verified, 1):.3f}")
    assert p_value >= ALPHA and accepted >= 0.3 * verified
