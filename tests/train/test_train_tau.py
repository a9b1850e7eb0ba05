"""The trainer's held-out `τ_est` predicts τ measured in real speculative decoding; DSpark beats DFlash.

Target: a tiny near-Markov model (`make_target(markov=True)`: the next token depends mostly on the current
one), which a one-layer draft learns in seconds. Held-out data and decoding both sample at temperature 1
(τ_est is defined with temperature-1 distributions) and stop at the end-of-turn token, so the contexts seen
by the estimate and by decoding come from the same distribution.

Tolerance: `|τ − τ_est| ≤ 3·SE(τ) + 0.1·(τ_est − 1)`.

* `3·SE(τ)`: τ is a mean over a few hundred rounds; `SE = std(tokens per round) / √rounds`, estimated from
  the rounds themselves (≈ 0.1 here), so a correct estimator fails this part with probability ≈ 0.3%.
* `0.1·(τ_est − 1)`: the estimator's known approximations, up to 10% of the drafted part: it multiplies
  per-position *mean* acceptances (a product of means, not a mean of per-round products) and conditions
  each slot on ground-truth previous tokens, where decoding conditions on accepted draft tokens.

Only rounds that verified all γ drafts count toward τ: near `max_length` the generator drafts fewer, which
is a property of the request length, not of the draft. The tolerance is well below the effect of training
(τ_est moves from ≈ 2.2 untrained to ≈ 3.7) and below the DSpark–DFlash gap, so the check has teeth.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GenerationConfig

from dspark_hf import last_generation_stats
from dspark_hf.train import DataArguments, ModelArguments, TrainArguments, train
from dspark_hf.train.data import load_token_dataset
from train_helpers import make_char_tokenizer, make_chat_target, sampled_data

GAMMA = 5


def _measured_tau(target, tok, draft, num_prompts: int) -> tuple[float, float, int]:
    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=None, top_p=None, max_new_tokens=200, eos_token_id=1, pad_token_id=1
    )
    per_round = []
    for i in range(num_prompts):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": f"held out {i}"}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        torch.manual_seed(1000 + i)
        with torch.no_grad():
            target.generate(ids, generation_config=config, assistant_model=draft)
        per_round += [r.accepted + 1 for r in last_generation_stats(draft).rounds if r.verified == GAMMA]
    t = torch.tensor(per_round, dtype=torch.float64)
    return float(t.mean()), float(t.std() / math.sqrt(len(t))), len(t)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tau")
    target, tok = make_chat_target(), make_char_tokenizer()
    path = sampled_data(
        root / "data.jsonl",
        target,
        tok,
        [f"prompt number {i}" for i in range(48)],
        max_new_tokens=120,
        batch_size=16,
        backend="engine",  # the data this test's tolerance was set on (the bulk backend: test_train_bulk.py)
    )
    train_ds, eval_ds = load_token_dataset(path).split(0.25, seed=0)
    return root, target, tok, train_ds, eval_ds


def test_tau_est_matches_decoding_and_dspark_beats_dflash(data):
    root, target, tok, train_ds, eval_ds = data
    results = {}
    for preset in ("dspark", "dflash"):
        res = train(
            ModelArguments(preset=preset, num_hidden_layers=1, block_size=GAMMA, markov_rank=32),
            DataArguments(num_anchors=64),
            TrainArguments(
                output_dir=str(root / preset),
                max_steps=150,
                per_device_batch_size=4,
                learning_rate=1e-2,
                report_to="none",
                progress=False,
            ),
            target=target,
            train_dataset=train_ds,
            eval_dataset=eval_ds,
        )
        tau_est = res.eval_metrics["tau_est"]
        tau, se, rounds = _measured_tau(target, tok, res.model.eval(), num_prompts=40)
        tolerance = 3 * se + 0.1 * (tau_est - 1)
        results[preset] = (tau_est, tau, tolerance)
        print(f"{preset}: tau_est={tau_est:.3f} tau={tau:.3f} ± {se:.3f} ({rounds} rounds), tolerance {tolerance:.3f}")
        assert rounds >= 200
        assert abs(tau - tau_est) <= tolerance, (preset, tau_est, tau, tolerance)
    (dspark_est, dspark_tau, tol), (dflash_est, dflash_tau, _) = results["dspark"], results["dflash"]
    # The Markov head knows the previous token; DFlash's later slots cannot, which the paper's comparison shows.
    assert dspark_est - dflash_est > tol and dspark_tau > dflash_tau
