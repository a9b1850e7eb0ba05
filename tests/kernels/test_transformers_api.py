"""The contract of `dspark_hf/_transformers.py` (every private or version-dependent transformers API we use)
against the installed release. A failure here names the accessor to update, before anything downstream
breaks in a less obvious way."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, PretrainedConfig

from dspark_hf import _transformers as api
from dspark_hf import last_generation_stats

from helpers import make_target


def test_hidden_states_selection_and_the_plus_one_offset():
    target = make_target("llama", num_layers=4)
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    layers = [0, 2, 3]
    with torch.no_grad():
        full = target(ids, output_hidden_states=True).hidden_states
        picked = target(ids, output_hidden_states=api.hidden_states_request(layers)).hidden_states
    assert len(full) == target.config.num_hidden_layers + 1  # entry 0 is the embeddings: layer i is i + 1
    expected = torch.cat([full[i + 1] for i in layers], dim=-1)
    torch.testing.assert_close(api.selected_hidden_states(picked, layers), expected)


def test_eos_token_ids():
    assert api.eos_token_ids(GenerationConfig(eos_token_id=3)) == {3}
    assert api.eos_token_ids(GenerationConfig(eos_token_id=[3, 5])) == {3, 5}
    config = GenerationConfig()
    assert api.eos_token_ids(config) == set()
    config._eos_token_tensor = torch.tensor([7, 9])  # what generate() fills in
    assert api.eos_token_ids(config) == {7, 9}


def test_cache_keyword_and_logits_to_keep_are_forward_parameters():
    target = make_target("llama", num_layers=1)
    assert api.cache_kwarg(target) in ("cache", "past_key_values")
    assert api.forward_accepts(target, api.cache_kwarg(target))
    assert api.forward_accepts(target, "logits_to_keep")
    assert not api.forward_accepts(target, "no_such_argument")


def test_filled_cache_holds_the_tensors_without_copying():
    keys = [torch.randn(2, 2, 5, 8) for _ in range(3)]
    values = [torch.randn(2, 2, 5, 8) for _ in range(3)]
    cache = api.filled_cache(list(zip(keys, values)))
    assert cache.get_seq_length() == 5
    for i in range(3):
        k, v = api.cache_layer_kv(cache, i)
        assert k.data_ptr() == keys[i].data_ptr() and v.data_ptr() == values[i].data_ptr()


def test_config_provenance_and_quantizer():
    config = PretrainedConfig()
    config.name_or_path = "org/model"  # the public property
    assert api.model_name(config) == "org/model"
    assert api.commit_hash(config) is None  # set by from_pretrained from the Hub; None for a local config
    target = make_target("llama", num_layers=1)
    target.hf_quantizer = object()  # what a quantized (e.g. GGUF) load leaves on the model
    target.config.quantization_config = {"quant_method": "gguf"}
    api.drop_quantizer(target)
    assert target.hf_quantizer is None and not hasattr(target.config, "quantization_config")


def test_forward_with_features_records_what_output_hidden_states_returns():
    for arch in ("llama", "qwen2", "qwen3"):
        target = make_target(arch, num_layers=5)
        ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            for layers in ([0, 2, 3], [3, 1], [-1, 2], [1, 4]):  # -1 and the last layer: output_hidden_states
                expected = api.selected_hidden_states(target(ids, output_hidden_states=True).hidden_states, layers)
                out, feats = api.forward_with_features(target, layers, ids)
                assert torch.equal(feats, expected), (arch, layers)
                assert torch.equal(out.logits, target(ids).logits)
            assert api.forward_with_features(target, None, ids)[1] is None
    # the hooks are gone after the call, and a layer list that is not a transformers one falls back
    fresh = make_target("llama", num_layers=4)
    with torch.no_grad():
        api.forward_with_features(fresh, [0, 1], ids)
    assert not any(layer._forward_hooks for layer in fresh.model.layers)
    assert api.decoder_layers(torch.nn.Linear(2, 2)) is None


def test_the_engine_leaves_no_transformers_capturing_hooks_on_the_target():
    # transformers' output_hidden_states installs capturing hooks on every layer for good (a ~3% cost per
    # forward ever after); the engine records its features with hooks of its own, for the call only
    from dspark_hf import DSparkEngine, SamplingParams

    from helpers import make_aligned_draft

    target = make_target("qwen2", num_layers=4)
    engine = DSparkEngine(target, make_aligned_draft(target, block_size=4), policy="fixed")
    out = engine.generate([[1, 2, 3, 4, 5], [7, 8]], SamplingParams(max_new_tokens=10))
    assert all(o.ok and len(o.token_ids) == 10 for o in out)
    assert engine.metrics.drafting_rounds > 0
    modules = list(target.modules())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def test_speculative_generate_records_features_without_transformers_capturing_hooks():
    from helpers import make_aligned_draft

    target = make_target("llama", num_layers=6, markov=True)
    draft = make_aligned_draft(target, block_size=4)
    assert api.can_record(target, draft.config.target_layer_ids)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    spec = target.generate(ids, assistant_model=draft, max_new_tokens=24, do_sample=False, dspark_policy="fixed")
    assert max(r.accepted for r in last_generation_stats(draft).rounds) >= 2  # the draft had real context
    assert torch.equal(spec, target.generate(ids, max_new_tokens=24, do_sample=False))
    # transformers' output_hidden_states was never asked for (it would have left capturing hooks everywhere),
    # and the call's own hooks are gone
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in target.modules())
    assert not hasattr(draft, "_call_recorder")  # the call's hooks were never parked on the draft


# ------------------------------------------------------------------ the exact CPU kernels' helpers (dspark_hf.kernels)
def test_attention_implementation_and_backend_support():
    target = make_target("llama", num_layers=1)
    assert api.attn_implementation(target) == api.attn_implementation(target.config) == "sdpa"
    assert api.supports_attention_backend(target)
    assert not api.supports_attention_backend(torch.nn.Linear(2, 2))  # a DSpark draft calls its own attention


def test_registered_attention_is_used_and_sdpa_is_reachable():
    from transformers import AttentionInterface

    calls = []

    def counting(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        calls.append(query.shape)
        return api.sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)

    api.register_attention("dspark_contract_test", counting)
    api.register_attention("dspark_contract_test", counting)  # a second registration is a no-op
    assert "dspark_contract_test" in AttentionInterface._global_mapping
    target = make_target("llama", num_layers=1)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        reference = target(ids).logits
        target.set_attn_implementation("dspark_contract_test")
        got = target(ids).logits
    assert calls and api.attn_implementation(target) == "dspark_contract_test"
    torch.testing.assert_close(got, reference)


def test_output_collector_and_capturing_hooks():
    target = make_target("llama", num_layers=2)
    assert api.active_output_collector() is None  # outside any forward (not UNKNOWN_COLLECTOR: the name exists)
    seen = []
    hook = target.model.layers[0].register_forward_hook(lambda *a: seen.append(api.active_output_collector()))
    with torch.no_grad():
        target(torch.tensor([[1, 2]]), output_hidden_states=True)
    hook.remove()
    assert seen and seen[0] is not None  # inside a capturing forward: the collector is visible
    attention = target.model.layers[0].self_attn
    assert any(api.is_output_capturing_hook(h) for h in api.forward_hooks(attention))
    assert not api.is_output_capturing_hook(lambda *a: None)


def test_module_hook_queries():
    layer = torch.nn.Linear(2, 2)
    assert api.forward_hooks(layer) == [] and not api.has_forward_pre_hooks(layer)
    handles = [layer.register_forward_hook(lambda *a: None), layer.register_forward_pre_hook(lambda *a: None)]
    assert len(api.forward_hooks(layer)) == 1 and api.has_forward_pre_hooks(layer)
    assert not api.global_module_hooks()
    handles.append(torch.nn.modules.module.register_module_forward_hook(lambda *a: None))
    assert api.global_module_hooks()
    for handle in handles:
        handle.remove()
    assert not api.global_module_hooks()


def test_lean_layer_and_model_types_are_the_families_classes():
    for arch in ("llama", "qwen2", "qwen3"):
        target = make_target(arch, num_layers=1)
        layer = target.model.layers[0]
        attention_type, norm_type = api.lean_layer_types()[type(layer)]
        assert type(layer.self_attn) is attention_type and type(layer.input_layernorm) is norm_type
        assert type(target.model) in api.lean_model_types()
        assert api.takes_mask_dict(target.model) == (arch != "llama")


def test_base_model_output_cache_and_causal_mask():
    target = make_target("llama", num_layers=1)
    assert api.base_output_has_cache()
    cache = api.new_dynamic_cache(target.config)
    assert cache.get_seq_length() == 0
    hidden = torch.randn(1, 3, target.config.hidden_size)
    out = api.base_model_output(hidden, cache)
    assert out.last_hidden_state is hidden and out.cache is cache
    mask = api.causal_mask(target.config, hidden, None, cache, torch.arange(3)[None])
    assert mask is None or tuple(mask.shape[-2:]) == (3, 3)


def test_dynamic_layer_grows_in_place_and_holds_what_concatenation_holds():
    from transformers import DynamicCache

    grown, concatenated = DynamicCache(), DynamicCache()
    pointers = set()
    for step, new in enumerate((4, 1, 1, 3)):
        keys, values = torch.randn(1, 2, new, 8), torch.randn(1, 2, new, 8)
        concatenated.update(keys, values, 0)
        if step == 0:
            grown.update(keys, values, 0)  # a layer must be filled before it can grow in place
            continue
        k, v = api.grow_dynamic_layer(grown, 0, keys, values, {})
        pointers.add(k.data_ptr())
        assert torch.equal(k, concatenated.layers[0].keys) and torch.equal(v, concatenated.layers[0].values)
    assert len(pointers) == 1  # one buffer, written in place
    room = api.dynamic_layer_room(grown, 0, 1, 2, 1, 8, torch.float32)
    assert room is not None and room[3] == 9
    assert api.dynamic_layer_room(grown, 0, 1, 3, 1, 8, torch.float32) is None  # other shapes: the cache's update
    assert api.dynamic_layer_room(grown, 5, 1, 2, 1, 8, torch.float32) is None  # no such layer
    layer, keys_buffer, values_buffer, n = room
    api.hold_dynamic_layer(layer, keys_buffer, values_buffer, keys_buffer[:, :, :n], values_buffer[:, :, :n])
    assert grown.get_seq_length() == 9


# ------------------------------------------------------------------ the private API stays in this one module
#: transformers' (and torch's module-hook) private names dspark_hf has needed; each now sits behind a helper above.
PRIVATE_NAMES = {
    "_attn_implementation",
    "_supports_attention_backend",
    "_global_mapping",
    "_active_collector",
    "_name_or_path",
    "_commit_hash",
    "_eos_token_tensor",
    "_get_candidate_generator",
    "_forward_hooks",
    "_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
}
#: `transformers.utils` holds public helpers (`logging`, `ModelOutput`) next to private modules.
PUBLIC_UTILS = {"logging", "ModelOutput"}


def private_uses(source: str) -> list[str]:
    """The private transformers names a module's code uses as attributes or imports (not in docstrings, comments or
    the keys of a saved `config.json`, which is a file format)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_NAMES:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
            names = [a.name for a in node.names]
            if node.module.startswith("transformers.utils.") or any(n.startswith("_") for n in names):
                found.append(f"{node.lineno}: from {node.module} import {', '.join(names)}")
            elif node.module == "transformers.utils" and set(names) - PUBLIC_UTILS:
                found.append(f"{node.lineno}: from transformers.utils import {', '.join(names)}")
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr")
            and len(node.args) > 1
            and getattr(node.args[1], "value", None) in PRIVATE_NAMES
        ):
            found.append(f"{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")  # an attribute all the same
    return found


def test_no_private_transformers_api_outside_this_module():
    from pathlib import Path

    package = Path(api.__file__).parent
    uses = {
        str(path.relative_to(package)): found
        for path in sorted(package.rglob("*.py"))
        if path.name != "_transformers.py" and (found := private_uses(path.read_text()))
    }
    assert uses == {}, f"private transformers API outside dspark_hf/_transformers.py: {uses}"
    # negative control: the check sees each kind of use
    assert len(private_uses("m.config._attn_implementation\nfrom transformers.utils.output_capturing import x\n")) == 2
    assert private_uses('getattr(c, "_name_or_path")') and not private_uses('"""model._forward_hooks"""')
    assert not private_uses('config_dict.get("_name_or_path")')
