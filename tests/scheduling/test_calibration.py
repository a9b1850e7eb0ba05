"""Sequential Temperature Scaling and calibration metrics."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_hf import DSparkDraftModel, last_generation_stats
from dspark_hf.scheduling.calibration import (
    CalibrationRecords,
    auroc,
    brier_score,
    calibrate,
    calibration_report,
    collect_records,
    expected_calibration_error,
    fit_sequential_temperatures,
    reliability_diagram,
)

from helpers import make_aligned_draft, make_target


@pytest.mark.parametrize(
    "pred, label, ece",
    [
        ([0.5, 0.5, 0.5, 0.5], [1, 0, 1, 0], 0.0),  # calibrated on average within the bin
        ([0.9, 0.9, 0.9, 0.9], [1, 0, 1, 0], 0.4),
        ([0.0, 1.0], [0, 1], 0.0),
        ([0.2, 0.8], [1, 0], 0.8),
    ],
)
def test_ece_table(pred, label, ece):
    assert expected_calibration_error(torch.tensor(pred), torch.tensor(label)) == pytest.approx(ece)


def test_auroc_and_brier():
    assert auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert auroc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == pytest.approx(0.5)  # ties count half
    assert math.isnan(auroc(torch.tensor([0.5, 0.6]), torch.tensor([1, 1])))
    assert brier_score(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([1, 1, 0])) == pytest.approx((0 + 1 + 0.25) / 3)


def _synthetic(n=20000, gamma=5, true_temperature=2.5, seed=0):
    """Rounds whose true conditional acceptance is σ(z/T*): the raw head (T=1) is overconfident."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(n, gamma, generator=gen, dtype=torch.float64) + 1.0
    survive = torch.rand(n, gamma, generator=gen, dtype=torch.float64) < torch.sigmoid(logits / true_temperature)
    accepted = torch.cumprod(survive.long(), dim=1).sum(dim=1)
    return CalibrationRecords(logits, torch.full((n,), gamma), accepted)


def test_sts_recovers_the_true_temperature_and_fixes_ece():
    fit, held = _synthetic(seed=0), _synthetic(seed=1)
    temps = fit_sequential_temperatures(fit)
    assert all(1.8 < t < 3.5 for t in temps), temps  # true value 2.5; later positions see fewer rounds
    before = calibration_report(held, [1.0] * 5)["overall"]
    after = calibration_report(held, temps)["overall"]
    assert before["ece"] > 0.03 and after["ece"] < 0.01, (before, after)
    # temperature scaling keeps the ranking of a position's own confidence: AUROC of a_1 = c_1 is unchanged
    # (later a_k multiply differently scaled terms, so their ranking may move)
    b = calibration_report(held, [1.0] * 5)["per_position"][0]
    a = calibration_report(held, temps)["per_position"][0]
    assert b["auroc"] == pytest.approx(a["auroc"], abs=1e-12)


def test_a_fit_that_worsens_the_held_out_ece_is_not_kept():
    """Fit rounds from an overconfident head (T* = 2.5), held-out rounds from a calibrated one (T* = 1): the fit
    makes the held-out ECE worse, so the draft keeps temperatures of 1.0 unless told to keep the fit."""
    target = make_target("llama", markov=True)
    fit, held = _synthetic(gamma=7, seed=0), _synthetic(gamma=7, true_temperature=1.0, seed=1)
    draft = make_aligned_draft(target, "markov", block_size=7)
    report = calibrate(draft, fit, held)
    assert report["kept"] == "identity" and report["temperatures"] == [1.0] * 7
    assert all(1.8 < t < 3.5 for t in report["fitted_temperatures"][:3])
    assert report["held_out"]["after"]["overall"]["ece"] > report["held_out"]["before"]["overall"]["ece"]
    assert draft.config.calibration_temperatures == [1.0] * 7 and draft.config.confidence_calibrated
    kept = make_aligned_draft(target, "markov", block_size=7)
    report = calibrate(kept, fit, held, keep_worse=True)
    assert "kept" not in report and kept.config.calibration_temperatures == report["temperatures"] != [1.0] * 7
    # the same fit is kept when the held-out rounds agree with it
    agreeing = make_aligned_draft(target, "markov", block_size=7)
    report = calibrate(agreeing, fit, _synthetic(gamma=7, seed=1))
    assert "kept" not in report and agreeing.config.calibration_temperatures == report["temperatures"]


def test_records_only_count_observed_positions():
    rec = CalibrationRecords(torch.zeros(3, 4, dtype=torch.float64), torch.tensor([4, 2, 0]), torch.tensor([1, 2, 0]))
    assert rec.observed(1).tolist() == [True, True, False]
    assert rec.observed(2).tolist() == [True, False, False]
    assert rec.survived(1).tolist() == [0.0, 1.0, 0.0]
    report = calibration_report(rec, [1.0] * 4)
    assert [p["n"] for p in report["per_position"]] == [2, 2, 1, 1]


def test_calibrate_end_to_end_on_generate(tmp_path):
    target = make_target("llama", markov=True)
    draft = make_aligned_draft(target, "markov")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (1, 4 + i % 9), generator=gen) for i in range(24)]
    torch.manual_seed(0)
    fit = collect_records(target, draft, prompts[:12], max_new_tokens=30, progress=False)
    held = collect_records(target, draft, prompts[12:], max_new_tokens=30, progress=False)
    assert len(fit) > 50 and fit.logits.shape[1] == draft.config.block_size
    report = calibrate(draft, fit, held)
    assert draft.config.confidence_calibrated and draft.config.calibration_temperatures == report["temperatures"]
    assert report["fit"]["after"]["overall"]["ece"] <= report["fit"]["before"]["overall"]["ece"] + 1e-12
    assert {"ece", "auroc", "brier", "n"} <= set(report["held_out"]["after"]["per_position"][0])
    png = reliability_diagram(held, report["temperatures"], str(tmp_path / "reliability.png"))
    assert (tmp_path / "reliability.png").stat().st_size > 10_000 and png.endswith(".png")
    # temperatures travel with the checkpoint, and a calibrated draft defaults to the hardware-aware policy
    draft.save_pretrained(tmp_path / "draft")
    loaded = DSparkDraftModel.from_pretrained(tmp_path / "draft", target=target)
    assert loaded.config.calibration_temperatures == report["temperatures"] and loaded.config.confidence_calibrated
    from dspark_hf.scheduling.policies import HardwareAwarePolicy
    from dspark_hf.scheduling.sps import SPSProfile

    policy = HardwareAwarePolicy(sps=SPSProfile({1: 0.065, 2: 0.107, 16: 0.107, 32: 0.142}))
    out = target.generate(prompts[0], max_new_tokens=20, do_sample=False, assistant_model=loaded, dspark_policy=policy)
    assert torch.equal(out, target.generate(prompts[0], max_new_tokens=20, do_sample=False))
    stats = last_generation_stats(loaded)
    assert stats.policy.startswith("HardwareAwarePolicy")
    assert all(len(r.calibrated_confidence) == len(r.confidence) for r in stats.rounds if r.drafted)


def test_no_confidence_head_is_refused():
    target = make_target("llama")
    draft = DSparkDraftModel.from_target(target, num_hidden_layers=1, markov_rank=8, confidence_head=False)
    with pytest.raises(ValueError, match="no confidence head"):
        collect_records(target, draft, [torch.zeros(1, 3, dtype=torch.long)], progress=False)
