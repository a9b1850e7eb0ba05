"""SPS profiles stay trustworthy: noisy measurements are repaired, stale or contradicted ones re-measured."""

from __future__ import annotations

import json
import time

import pytest
import torch

from dspark_hf import cli
from dspark_hf.kernels import exact_kernels_build
from dspark_hf.scheduling import sps
from dspark_hf.scheduling.policies import HardwareAwarePolicy, ScheduleContext, UniformHardwareAwarePolicy
from dspark_hf.scheduling.sps import SPSProfile, get_sps_profile, monotone_fit, profile_sps, stale_reason

from helpers import make_target


@pytest.mark.parametrize(
    ("measured", "fitted"),
    [
        # the profile once measured under load: B=2 slower than B=8
        ({1: 0.101, 2: 0.152, 8: 0.090}, {1: 0.090, 2: 0.090, 8: 0.090}),
        ({1: 0.05, 2: 0.1, 4: 0.08, 8: 0.2}, {1: 0.05, 2: 0.08, 4: 0.08, 8: 0.2}),
        ({1: 0.05, 2: 0.06, 4: 0.07}, {1: 0.05, 2: 0.06, 4: 0.07}),  # monotone already: unchanged
        ({4: 0.3}, {4: 0.3}),
    ],
)
def test_monotone_fit_repairs_a_non_monotonic_measurement(measured, fitted):
    out = monotone_fit(measured)
    assert out == pytest.approx(fitted)
    values = [out[k] for k in sorted(out)]
    assert values == sorted(values)


def test_extrapolation_past_the_last_point_never_makes_tokens_free():
    # a stock SmolLM2 profile whose monotone fit left a flat tail (48 and 64 equal): the old extrapolation used
    # the last segment's slope, 0, so a forward over 4,096 tokens cost the same as over 64 and the demo's
    # heavy background load admitted a whole draft (tests/apps/test_demo_browser.py failed with 7 < 7)
    from dspark_hf.scheduling.policies import hardware_aware_lengths

    seconds = {1: 0.0978, 2: 0.1736, 4: 0.1977, 8: 0.2183, 12: 0.2376, 16: 0.2376, 24: 0.2671, 32: 0.3189, 48: 0.3965}
    profile = SPSProfile({**seconds, 64: 0.3965})
    assert profile.time(64) == pytest.approx(0.3965)
    assert profile.time(4096) == pytest.approx(0.3965 * 4096 / 64)  # proportional: the slope is 0
    steep = SPSProfile({1: 0.1, 2: 0.3})  # a steeper last segment keeps its slope
    assert steep.time(4) == pytest.approx(0.7)
    survival = torch.tensor([[0.663, 0.441, 0.293, 0.194, 0.129, 0.085, 0.057]])
    assert hardware_aware_lengths(survival, profile.sps, 4096).item() == 0
    assert hardware_aware_lengths(survival, profile.sps, 8).item() > 0


def _tiny():
    return make_target("llama", vocab_size=64, hidden_size=32, num_layers=2, dtype=torch.float32)


def test_profile_sps_is_monotone_and_records_what_it_was_measured_with():
    profile = profile_sps(_tiny(), token_counts=(1, 2, 4, 8), context_length=16, repeats=3, warmup=1)
    values = [profile.seconds[b] for b in (1, 2, 4, 8)]
    assert values == sorted(values)
    meta = profile.meta
    assert set(meta["raw_seconds"]) == {1, 2, 4, 8}
    assert all(profile.seconds[b] <= meta["raw_seconds"][b] for b in (1, 2, 4, 8))  # a lower envelope
    assert meta["format"] == sps.PROFILE_FORMAT and meta["kernels"] == "stock" and meta["repeats"] == 3
    assert meta["torch"] == torch.__version__ and "transformers" in meta and meta["threads"] >= 1


def _fresh_meta(**changes):
    meta = {"format": sps.PROFILE_FORMAT, **sps._versions(), "measured_at_epoch": time.time()}
    meta.update(changes)
    return meta


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({}, None),
        ({"format": 1}, "older procedure"),
        ({"torch": "1.0.0"}, "torch 1.0.0"),
        ({"transformers": "4.0.0"}, "transformers 4.0.0"),
        ({"inconsistent": {"median_live_over_profile": 3.1}}, "inconsistent with live round times"),
        ({"measured_at_epoch": time.time() - 30 * 24 * 3600}, "h old"),
        ({"kernels": "exact", "kernels_build": "cpp-0123456789ab"}, "another build of the exact kernels"),
        ({"kernels": "exact"}, "another build of the exact kernels"),  # a profile from before builds were recorded
        ({"kernels": "exact", "kernels_build": exact_kernels_build()}, None),
    ],
)
def test_stale_profiles_are_recognised(changes, reason):
    found = stale_reason(SPSProfile({1: 0.1}, _fresh_meta(**changes)))
    if reason is None:
        assert found is None
    else:
        assert reason in found
    assert stale_reason(SPSProfile({1: 0.1}, _fresh_meta(measured_at_epoch=0)), max_age=None) is None


@pytest.mark.parametrize(
    ("changes", "remeasured"),
    [({}, False), ({"format": 1}, True), ({"torch": "1.0.0"}, True), ({"inconsistent": {"x": 1}}, True)],
)
def test_get_sps_profile_reuses_a_good_cached_profile_and_remeasures_a_stale_one(changes, remeasured):
    target = _tiny()
    path = sps._cache_path(target, 16)
    sps._LOADED.pop(path, None)
    sps._REMEASURED.discard(path)  # another test in this worker may have re-measured this tiny target already
    bogus = {1: 123.0, 2: 124.0}  # no real forward takes two minutes: tells a re-measured profile apart
    SPSProfile(bogus, _fresh_meta(**changes)).save(path)
    profile = get_sps_profile(target, context_length=16, token_counts=(1, 2), repeats=1, warmup=0)
    assert (profile.seconds != bogus) == remeasured
    on_disk = json.loads(path.read_text())
    assert (on_disk["meta"].get("inconsistent") is None) == (remeasured or not changes)
    # refresh=True always re-measures
    again = get_sps_profile(target, context_length=16, refresh=True, token_counts=(1, 2), repeats=1, warmup=0)
    assert again.seconds != bogus and again.meta["measured_at_epoch"] >= profile.meta.get("measured_at_epoch", 0)


@pytest.mark.parametrize(
    ("live_factor", "flagged"),
    [(1.0, False), (1.8, False), (0.6, False), (3.0, True), (0.3, True)],
)
def test_a_profile_contradicted_by_live_rounds_is_flagged_and_then_remeasured(live_factor, flagged):
    target = _tiny()
    path = sps._cache_path(target, 16)
    sps._LOADED.pop(path, None)
    sps._REMEASURED.discard(path)
    SPSProfile({1: 0.5, 8: 1.0}, _fresh_meta()).save(path)
    profile = get_sps_profile(target, context_length=16, token_counts=(1, 2), repeats=1, warmup=0)
    assert profile.seconds == {1: 0.5, 8: 1.0}
    results = []
    with pytest.warns(UserWarning, match="disagrees with live round times") if flagged else _no_warning():
        for _ in range(sps.LIVE_MIN_ROUNDS + 2):
            results.append(profile.observe(8, 1.0 * live_factor))
    assert any(results) == flagged
    assert results[: sps.LIVE_MIN_ROUNDS - 1] == [False] * (sps.LIVE_MIN_ROUNDS - 1)  # needs enough rounds
    assert bool(json.loads(path.read_text())["meta"].get("inconsistent")) == flagged
    fresh = get_sps_profile(target, context_length=16, token_counts=(1, 2), repeats=1, warmup=0)
    assert (fresh.seconds != {1: 0.5, 8: 1.0}) == flagged


class _no_warning:
    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


@pytest.mark.parametrize("policy_cls", [HardwareAwarePolicy, UniformHardwareAwarePolicy])
def test_hardware_aware_policies_report_live_rounds_to_their_profile(policy_cls):
    profile = SPSProfile({1: 0.01, 16: 0.01})
    policy = policy_cls()
    context = ScheduleContext(sps=profile.sps)
    with pytest.warns(UserWarning, match="disagrees"):
        for _ in range(sps.LIVE_MIN_ROUNDS):
            policy.observe_round(context, rows=1, forward_tokens=4, rest_seconds=0.1)  # 10x the profile
    assert profile.meta["inconsistent"]["median_live_over_profile"] == pytest.approx(10.0)
    batched = SPSProfile({1: 0.01, 16: 0.01})
    for _ in range(sps.LIVE_MIN_ROUNDS):  # a batched round is not comparable with a single-request curve
        policy.observe_round(ScheduleContext(sps=batched.sps), rows=4, forward_tokens=8, rest_seconds=0.1)
    assert "inconsistent" not in batched.meta


def test_dspark_generate_has_a_refresh_flag():
    args = cli.build_parser().parse_args(["generate", "--refresh-sps", "--kernels", "exact"])
    assert args.refresh_sps and args.kernels == "exact"
    assert not cli.build_parser().parse_args(["generate"]).refresh_sps


def test_a_profile_contradicted_again_after_remeasuring_is_kept():
    """Live rounds of a tiny model are mostly overhead: re-measuring on every call would cost more than it tells."""
    target = _tiny()
    path = sps._cache_path(target, 16)
    sps._LOADED.pop(path, None)
    sps._REMEASURED.discard(path)
    kw = {"context_length": 16, "token_counts": (1, 2), "repeats": 1, "warmup": 0}
    first = get_sps_profile(target, **kw)
    with pytest.warns(UserWarning, match="disagrees"):
        for _ in range(sps.LIVE_MIN_ROUNDS):
            first.observe(1, first.time(1) * 10)
    second = get_sps_profile(target, **kw)
    assert second is not first  # re-measured once
    with pytest.warns(UserWarning, match="disagrees"):
        for _ in range(sps.LIVE_MIN_ROUNDS):
            second.observe(1, second.time(1) * 10)
    assert get_sps_profile(target, **kw) is second  # contradicted again: kept
    assert get_sps_profile(target, refresh=True, **kw) is not second  # an explicit refresh still measures
