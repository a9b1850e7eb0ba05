"""The efficiency benchmark's oracle proposer (`benchmarks/bench_efficiency.py`): plugged into the Speculator as
just another proposer, it keeps the engine's output exactly the target's and reaches the τ it is set to."""

import importlib.util
from pathlib import Path

import pytest
import torch

from dspark_hf import DSparkEngine, SamplingParams

from helpers import make_aligned_draft, make_target

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_efficiency.py"
_SPEC = importlib.util.spec_from_file_location("bench_efficiency", _PATH)
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)

VOCAB, MAX_NEW = 96, 31


@pytest.fixture(scope="module")
def setup():
    target = make_target("llama", vocab_size=VOCAB, markov=True)
    draft = make_aligned_draft(target, "markov", block_size=6)
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    plain = DSparkEngine(target, None, max_batch_size=1)
    ref = plain.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))[0].token_ids
    return target, draft, prompt, ref


def test_the_schedule_averages_tau():
    for tau in bench.TAUS:
        oracle = bench.OracleProposer({}, tau, VOCAB)
        rights = [oracle.right_tokens(k) for k in range(60)]
        assert abs(sum(rights) / 60 - (tau - 1)) < 1 / 60 + 1e-9, (tau, rights[:8])
        assert max(rights) <= bench.verified_length(tau)


@pytest.mark.parametrize("tau", [1.0, 2.5, 4.0])
def test_the_oracle_keeps_the_output_and_reaches_its_tau(setup, tau):
    target, draft, prompt, ref = setup
    engine, oracle = bench.oracle_engine(target, draft, {0: prompt + ref}, tau, kernels=None)
    out = engine.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))[0]
    assert out.token_ids == ref  # verification is the target's: the oracle cannot change the output
    rounds = engine.metrics.rounds
    # every round drafts but a last one left room for the target's own token only
    assert rounds - 1 <= oracle.rounds == engine.metrics.drafting_rounds <= rounds
    # each round emits its scheduled m_k + 1 tokens (the last one cut by max_new_tokens); the prefill emits one
    assert (MAX_NEW - 1) / rounds == pytest.approx(tau, abs=(tau + 1) / rounds), (MAX_NEW, rounds)


def test_a_wrong_oracle_is_caught(setup):
    """The negative control: an oracle proposing from a shifted continuation accepts (almost) nothing."""
    target, draft, prompt, ref = setup
    shifted = prompt + ref[1:] + [0]
    engine, _ = bench.oracle_engine(target, draft, {0: shifted}, 4.0, kernels=None)
    out = engine.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))[0]
    assert out.token_ids == ref
    assert engine.metrics.rounds > MAX_NEW / 2  # far from τ = 4
