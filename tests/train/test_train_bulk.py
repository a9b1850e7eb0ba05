"""The bulk generator (prepare-data's default backend): the target's own continuations, rows refilled as they
finish, sampling from exactly the target's distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from dspark_hf.train.bulk import BulkGenerator, UnsupportedModelError, choose_dtype, cpu_bf16_capability

from helpers import make_target


def _prompts(n: int, vocab: int = 96, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, vocab, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_continuations_are_the_targets_own(arch):
    """fp64: each row's greedy continuation equals `target.generate()` on that prompt alone, with 3 rows for 7
    prompts (rows refilled and moved to the front as others finish) and a stop token that ends some early."""
    target = make_target(arch, seed=3)
    prompts = _prompts(7)
    refs = [
        target.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :].tolist() for p in prompts
    ]
    # the stop token: one that some continuations reach and others do not
    seen = [set(r) for r in refs]
    stop = max((t for s in seen for t in s if not all(t in o for o in seen)), key=lambda t: sum(t in o for o in seen))
    outputs = BulkGenerator(target, 3, torch.float64).generate(prompts, 16, [stop], do_sample=False)
    stopped = 0
    for out, ref in zip(outputs, refs):
        assert out == (ref[: ref.index(stop) + 1] if stop in ref else ref)
        stopped += out[-1] == stop
    assert 0 < stopped < len(prompts)  # both endings were exercised


def test_sampling_draws_from_the_targets_distribution():
    """4,000 first tokens of one prompt, sampled in rows of 250: their counts fit the target's softmax (chi-square),
    and the same counts reject the distribution at temperature 1.25 (the test has power)."""
    target = make_target("llama", seed=1)
    prompt = _prompts(1, seed=4)[0]
    generator = BulkGenerator(target, 250, torch.float64)
    firsts = [o[0] for o in generator.generate([prompt] * 4000, 1, [], temperature=1.0, seed=7)]
    counts = torch.bincount(torch.tensor(firsts), minlength=96).double()
    with torch.no_grad():
        logits = target(torch.tensor([prompt])).logits[0, -1]

    def p_value(temperature: float) -> float:
        expected = (logits / temperature).softmax(-1) * len(firsts)
        keep = expected >= 5  # chi-square needs populated cells; pool the rest
        f_obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
        f_exp = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
        if f_exp[-1] == 0:
            f_obs, f_exp = f_obs[:-1], f_exp[:-1]
        return chisquare(f_obs.numpy(), f_exp.numpy()).pvalue

    assert p_value(1.0) > 1e-3
    assert p_value(1.25) < 1e-6


def test_top_k_keeps_only_the_k_likeliest_tokens():
    target = make_target("llama", seed=1, logit_scale=0.3)
    prompt = _prompts(1, seed=4)[0]
    firsts = BulkGenerator(target, 64, torch.float64).generate([prompt] * 300, 1, [], top_k=3, seed=0)
    with torch.no_grad():
        top3 = set(target(torch.tensor([prompt])).logits[0, -1].topk(3).indices.tolist())
    assert {o[0] for o in firsts} == top3


def test_bf16_continuations_track_the_fp32_target():
    """bf16 weights and activations: not bit-exact, but greedy continuations stay close to the fp32 target's."""
    target = make_target("llama", seed=2, dtype=torch.float32)
    prompts = _prompts(6, seed=5)
    bf16 = BulkGenerator(target, 4, torch.bfloat16).generate(prompts, 8, [], do_sample=False)
    fp32 = BulkGenerator(target, 4, torch.float32).generate(prompts, 8, [], do_sample=False)
    first_agree = sum(a[0] == b[0] for a, b in zip(bf16, fp32))
    assert first_agree >= 5, (bf16, fp32)


def test_unsupported_targets_and_bad_arguments_are_refused():
    target = make_target("llama")
    target.config.model_type = "gpt2"
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        BulkGenerator(target, 2)
    generator = BulkGenerator(make_target("llama"), 2, torch.float64)
    with pytest.raises(ValueError, match="needs a token"):
        generator.generate([[1, 2], []], 4, [])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        generator.generate([[1, 2]], 4, [], temperature=0.0)
    assert generator.generate([], 4, []) == []


def test_dtype_choice_follows_the_cpu():
    dtype, why = choose_dtype("auto", torch.device("cpu"))
    assert (dtype == torch.bfloat16) == (cpu_bf16_capability() is not None), why
    assert choose_dtype("float32", torch.device("cpu"))[0] == torch.float32
    with pytest.raises(ValueError, match="'auto', 'bfloat16' or 'float32'"):
        choose_dtype("fp8", torch.device("cpu"))
