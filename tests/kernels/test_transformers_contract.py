"""The private transformers API we rely on, checked loudly, and every non-DSpark mode left untouched."""

from __future__ import annotations

import inspect

import torch
from transformers import GenerationMixin
from transformers.generation import candidate_generator as cg_module
from transformers.generation.candidate_generator import CandidateGenerator

import dspark_hf
from dspark_hf.decoding.generation import EXPECTED_GET_CANDIDATE_GENERATOR_PARAMS, install_generate_hook

from helpers import make_target


def test_private_signature_unchanged():
    original = GenerationMixin._get_candidate_generator._dspark_original
    assert tuple(inspect.signature(original).parameters) == EXPECTED_GET_CANDIDATE_GENERATOR_PARAMS


def test_model_outputs_protocol_present():
    assert hasattr(CandidateGenerator, "requires_model_outputs")
    source = inspect.getsource(GenerationMixin._assisted_decoding)
    for needle in (
        "requires_model_outputs",
        "model_kwargs_overrides",
        "n_last_matches",
        "model_outputs=outputs",
        "update_candidate_strategy",
        "_get_candidate_generator",
    ):
        assert needle in source, f"transformers' assisted decoding no longer mentions {needle!r}"


def test_hook_installed_once():
    hooked = GenerationMixin._get_candidate_generator
    install_generate_hook()
    assert GenerationMixin._get_candidate_generator is hooked
    assert getattr(hooked, "_dspark_wrapped", False)


def _spy_generators(monkeypatch):
    made = []
    hooked = GenerationMixin._get_candidate_generator

    def spy(self, *args, **kwargs):
        gen = hooked(self, *args, **kwargs)
        made.append(type(gen))
        return gen

    monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", spy)
    return made


def test_other_modes_untouched(monkeypatch):
    target = make_target("llama", markov=True)
    assistant = make_target("llama", num_layers=2, seed=5)
    made = _spy_generators(monkeypatch)
    ids = torch.randint(0, 96, (1, 12))
    ref = target.generate(ids, max_new_tokens=16, do_sample=False)
    # an EOS id the run never reaches: prompt lookup in transformers < 5.13 needs one to be set
    unused = next(t for t in range(96) if t not in ref[0].tolist())
    target.generation_config.eos_token_id = assistant.generation_config.eos_token_id = unused
    assert torch.equal(target.generate(ids, max_new_tokens=16, do_sample=False), ref)
    assert torch.equal(target.generate(ids, max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=3), ref)
    assert torch.equal(target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=assistant), ref)
    assert made == [cg_module.PromptLookupCandidateGenerator, cg_module.AssistedCandidateGenerator]
    draft = dspark_hf.DSparkDraftModel.from_target(target, num_hidden_layers=1, markov_rank=8)
    assert torch.equal(target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=draft), ref)
    assert made[-1] is dspark_hf.DSparkCandidateGenerator


def test_import_is_light():
    """`import dspark_hf` imports none of the heavy optional packages itself.

    transformers' `modeling_utils` imports accelerate whenever accelerate is installed, so accelerate is
    compared against that baseline; the others must not be imported at all.
    """
    import subprocess
    import sys

    code = (
        "import sys; heavy = ['accelerate', 'peft', 'datasets', 'gradio', 'evaluate', 'matplotlib', 'fastapi', 'uvicorn']; "
        "from transformers import PreTrainedModel, GenerationMixin; before = set(sys.modules); "
        "import dspark_hf; after = set(sys.modules); "
        "print(sorted({m.split('.')[0] for m in after - before} & set(heavy)), "
        "sorted(m for m in heavy[1:] if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] []", out.stdout + out.stderr


# ------------------------------------------------------------------ the generate() hook's helpers (_transformers.py)
def test_the_signature_guard_refuses_a_changed_private_method():
    """The guard in front of the one private method the hook wraps fails loudly, naming what changed."""
    import pytest

    from dspark_hf import _transformers as api

    api.check_candidate_generator_signature()  # the installed release: unchanged
    assert api.original_candidate_generator_factory() is GenerationMixin._get_candidate_generator._dspark_original

    def changed(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, assistant_model):
        return None

    with pytest.raises(RuntimeError, match="cannot hook into this transformers release"):
        api.check_candidate_generator_signature(changed)


def test_generate_is_wrapped_once_and_a_call_keyword_rides_on_the_generation_config(monkeypatch):
    """`generate()` is wrapped once; a `dspark_*` keyword reaches the candidate generator on (a copy of) the call's
    `GenerationConfig`, which transformers carries to `_get_candidate_generator`, and the caller's own config is
    left alone."""
    from transformers import GenerationConfig

    from dspark_hf import _transformers as api

    wrapped = GenerationMixin.generate
    api.hook_generate(lambda original, model, *args, **kwargs: None)  # a second wrap is refused
    assert GenerationMixin.generate is wrapped and wrapped._dspark_original is not None
    seen = []
    hooked = GenerationMixin._get_candidate_generator

    def spy(self, generation_config, *args, **kwargs):
        seen.append(getattr(generation_config, "dspark_policy", None))
        return hooked(self, generation_config, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", spy)
    target = make_target("llama", markov=True)
    draft = dspark_hf.DSparkDraftModel.from_target(target, num_hidden_layers=1, markov_rank=8)
    mine = GenerationConfig(max_new_tokens=4, do_sample=False)
    target.generate(torch.tensor([[1, 2, 3]]), generation_config=mine, assistant_model=draft, dspark_policy="fixed:2")
    target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, assistant_model=draft, dspark_policy="fixed:3")
    assert seen == ["fixed:2", "fixed:3"]
    assert getattr(mine, "dspark_policy", None) is None
