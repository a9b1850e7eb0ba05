"""One door for every runtime option (`dspark_hf.decoding.options`), in every driver.

* Every option (policy, lookup, CUDA graphs, kernels, the compiled round, the guessed path) reaches every driver
  (`generate()`, `DSparkEngine`, the engine `load_app` builds for `dspark serve`) through `resolve_options`, with
  one precedence: the call > the call's `GenerationConfig` > the draft's own defaults (its
  `generation_config.json`) > the library's default. Each level is set together with every level below it, so a
  level's value only shows when the driver honours it; a resolver that ignores one level fails the same check
  (the negative control).
* The shipped DSpark draft at its defaults runs one policy and one lookup setting in `generate()`, the engine and
  the served app, with the same greedy tokens (real SmolLM2-135M target, marked `real_model`).
* The draft's defaults travel with its weights (`generation_config.json`), and old checkpoints that carried them as
  config fields load with them.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from transformers import GenerationConfig

from dspark_hf import DSparkDraftModel, DSparkEngine, SamplingParams
from dspark_hf.decoding import engine as engine_module
from dspark_hf.decoding import generation as generation_module
from dspark_hf.decoding import options as options_module
from dspark_hf.decoding.generation import DSparkCandidateGenerator
from dspark_hf.decoding.lookup import LookupConfig
from dspark_hf.decoding.options import OPTION_NAMES, SpeculationOptions, resolve_options
from dspark_hf.scheduling.policies import FixedPolicy, UniformHardwareAwarePolicy

from helpers import make_aligned_draft, make_target

pytestmark = pytest.mark.usefixtures("one_thread")

#: Per option: the library's default (what it resolves to for an uncalibrated float64 draft on the CPU), and the
#: `(raw, resolved)` values the levels may set. A many-valued option gives each level its own value; a two-valued
#: one alternates up the driver's levels, so neighbouring levels always differ and a driver that skips a level
#: shows the next one's value instead.
CASES = {
    "policy": (FixedPolicy(), [(f"fixed:{n}", FixedPolicy(n)) for n in (1, 2, 3)]),
    "lookup": (None, [(n, LookupConfig(max_tokens=n)) for n in (1, 2, 3)]),
    "cuda_graphs": (False, [(True, True), (False, False)]),
    "kernels": ("stock", [("packed", "packed"), ("stock", "stock")]),
    "compiled": (True, [(False, False), (True, True)]),
    "guessed_path": (True, [(False, False), (True, True)]),
}
assert set(CASES) == set(OPTION_NAMES)


def _ladder(name: str, levels) -> dict:
    """`level -> (raw, resolved)` for the driver's `levels` (highest precedence first), plus `"library"`."""
    library, values = CASES[name]
    ladder = {"library": (None, library)}
    for i, level in enumerate(reversed(levels)):
        ladder[level] = values[i % len(values)] if len(values) > 2 else values[i % 2]
    return ladder


def _scenarios(levels):
    """`(levels set, the level that must win)`: the top level alone wins only when every lower one is set too."""
    return [(levels[i:], levels[i]) for i in range(len(levels))] + [((), "library")]


@pytest.fixture(scope="module")
def pair():
    target = make_target("llama", vocab_size=96, markov=True)
    return target, make_aligned_draft(target, "markov", block_size=4)


@contextlib.contextmanager
def _draft_defaults(draft, values: dict):
    """Set `draft.generation_config`'s `dspark_*` entries for the block (what its generation_config.json records)."""
    saved = draft.generation_config
    draft.generation_config = GenerationConfig(**{f"dspark_{k}": v for k, v in values.items()})
    try:
        yield
    finally:
        draft.generation_config = saved


# ---------------------------------------------------------------------------------------------- the drivers
def _via_generate(target, draft, name, values: dict, monkeypatch) -> tuple[SpeculationOptions, str | None]:
    """What `generate()` ran with: its candidate generator's options, and the kernel mode of the call's scope."""
    generators, modes = [], []
    original_init = DSparkCandidateGenerator.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        generators.append(self)

    @contextlib.contextmanager
    def recording_kernels(*models, mode):  # the mode of the scope, without switching any kernels
        modes.append(mode)
        yield

    monkeypatch.setattr(DSparkCandidateGenerator, "__init__", recording_init)
    monkeypatch.setattr(generation_module, "use_kernels", recording_kernels)
    call = {f"dspark_{name}": values["call"]} if "call" in values else {}
    config = GenerationConfig(max_new_tokens=3, do_sample=False)
    if "generation_config" in values:
        setattr(config, f"dspark_{name}", values["generation_config"])
    defaults = {name: values["draft"]} if "draft" in values else {}
    with _draft_defaults(draft, defaults):
        target.generate(torch.tensor([[5, 17, 3, 9, 5, 17]]), generation_config=config, assistant_model=draft, **call)
    return generators[-1].options, modes[-1]


def _via_engine(target, draft, name, values: dict, monkeypatch) -> tuple[SpeculationOptions, str]:
    kwargs = {name: values["call"]} if "call" in values and name != "guessed_path" else {}
    defaults = {name: values["draft"]} if "draft" in values else {}
    with _draft_defaults(draft, defaults):
        engine = DSparkEngine(target, draft, **kwargs)
    return engine.options, engine.kernels


def _via_load_app(folders, name, values: dict, monkeypatch) -> tuple[SpeculationOptions, str]:
    from dspark_hf.serve import load_app

    target_folder, draft_folder = folders
    defaults = {f"dspark_{name}": values["draft"]} if "draft" in values else {}
    config_file = draft_folder / "generation_config.json"
    config_file.write_text(json.dumps(defaults))  # what `save_pretrained` writes, read back by `load_draft`
    kwargs = {name: values["call"]} if "call" in values and name != "guessed_path" else {}
    engine = load_app(target=str(target_folder), draft=str(draft_folder), dtype="float64", **kwargs).state.server.engine
    return engine.options, engine.kernels


#: The levels each driver has: `DSparkEngine` and `load_app` take no GenerationConfig, and their call has no
#: `guessed_path` argument (the draft's default sets it there).
DRIVER_LEVELS = {
    "generate": ("call", "generation_config", "draft"),
    "engine": ("call", "draft"),
    "load_app": ("call", "draft"),
}


@pytest.fixture(scope="module")
def app_folders(tmp_path_factory, pair):
    from train_helpers import make_char_tokenizer

    target, draft = pair
    root = tmp_path_factory.mktemp("options-app")
    target.save_pretrained(root / "target")
    make_char_tokenizer().save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return root / "target", root / "draft"


def _mismatches(driver: str, name: str, pair, app_folders, monkeypatch) -> list[str]:
    """Every scenario of `name` in which `driver` did not run the winning level's value."""
    target, draft = pair
    levels = DRIVER_LEVELS[driver]
    if name == "guessed_path" and driver != "generate":
        levels = ("draft",)
    ladder = _ladder(name, levels)
    wrong = []
    for present, winner in _scenarios(levels):
        values = {level: ladder[level][0] for level in present}
        expected = ladder[winner][1]
        if driver == "generate":
            options, mode = _via_generate(target, draft, name, values, monkeypatch)
        elif driver == "engine":
            options, mode = _via_engine(target, draft, name, values, monkeypatch)
        else:
            options, mode = _via_load_app(app_folders, name, values, monkeypatch)
        got = getattr(options, name)
        if got != expected or (name == "kernels" and mode != expected):
            wrong.append(
                f"{sorted(present)} set: ran {got!r} (kernel scope {mode!r}), expected {winner}'s {expected!r}"
            )
    return wrong


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("driver", list(DRIVER_LEVELS))
def test_every_option_reaches_every_driver_with_one_precedence(driver, name, pair, app_folders, monkeypatch):
    assert _mismatches(driver, name, pair, app_folders, monkeypatch) == []


def _ignoring(level: str, monkeypatch):
    """A resolver that drops one level: what a driver reconciling the options itself would get wrong."""
    real = options_module.resolve_options

    def broken(draft, target, *, call=None, generation_config=None):
        if level == "call":
            call = None
        if level == "generation_config":
            generation_config = None
        with monkeypatch.context() as patch:
            if level == "draft":
                patch.setattr(options_module, "draft_defaults", lambda draft: None)
            return real(draft, target, call=call, generation_config=generation_config)

    return broken


@pytest.mark.parametrize(
    "driver, level",
    [("generate", "call"), ("generate", "generation_config"), ("generate", "draft"), ("engine", "call")]
    + [("engine", "draft"), ("load_app", "call"), ("load_app", "draft")],
)
@pytest.mark.parametrize("name", ["policy", "lookup", "kernels", "compiled"])
def test_negative_control_a_driver_that_loses_a_level_is_caught(driver, level, name, pair, app_folders, monkeypatch):
    """The check above fails for a resolver that ignores one level, and for `generate()` keywords that do not
    reach the call's generation config (where `generate()` carries its call level)."""
    if (driver, level) == ("generate", "call"):
        carry = generation_module._carry_options
        monkeypatch.setattr(generation_module, "_carry_options", lambda args, kwargs, call: carry(args, kwargs, {}))
    else:
        broken = _ignoring(level, monkeypatch)
        monkeypatch.setattr(generation_module, "resolve_options", broken)
        monkeypatch.setattr(engine_module, "resolve_options", broken)
    wrong = _mismatches(driver, name, pair, app_folders, monkeypatch)
    assert wrong, f"{driver} losing the {level} level of {name} went unnoticed"


# ---------------------------------------------------------------------------------------------- the resolver
def test_bad_values_name_the_level_that_set_them(pair):
    target, draft = pair
    with pytest.raises(ValueError, match=r"dspark_kernels='fast' \(set by the call\).*'stock', 'packed', 'exact'"):
        resolve_options(draft, target, call={"kernels": "fast"})
    with pytest.raises(ValueError, match=r"set by the call's generation config"):
        resolve_options(draft, target, generation_config=GenerationConfig(dspark_compiled="yes"))
    with _draft_defaults(draft, {"policy": "fastest"}), pytest.raises(ValueError, match="generation_config.json"):
        resolve_options(draft, target)
    with pytest.raises(ValueError, match=r"Unknown speculation option\(s\) \['polcy'\]"):
        resolve_options(draft, target, call={"polcy": "fixed"})
    with pytest.raises(ValueError, match="only applies with"):
        target.generate(torch.tensor([[1, 2]]), max_new_tokens=2, dspark_lookup=True)


def test_no_runtime_state_on_the_draft(pair):
    target, draft = pair
    gone = ("policy", "_call_policy", "guessed_path", "compiled_round", "cuda_graphs", "_call_cuda_graphs")
    gone += ("lookup", "_call_lookup", "_call_recorder")
    before = dict(vars(draft))
    target.generate(torch.tensor([[5, 17, 3]]), assistant_model=draft, max_new_tokens=6, dspark_policy="fixed:2")
    assert not [a for a in gone if hasattr(draft, a)]
    assert {k for k in vars(draft) if k not in before} == set()  # the call parked nothing new on the module
    # the old attributes would be silently ignored: setting one says where the option lives now
    with pytest.raises(AttributeError, match=r"draft.generation_config.dspark_policy = 'fixed:3'"):
        draft.policy = "fixed:3"
    with pytest.raises(AttributeError, match="dspark_compiled"):
        draft.compiled_round = False


# ---------------------------------------------------------------------------------------------- save and load
def test_a_drafts_defaults_travel_with_its_weights(pair, tmp_path):
    target, draft = pair
    with _draft_defaults(draft, {"policy": "fixed:2", "lookup": True}):
        draft.save_pretrained(tmp_path / "d")
    saved = json.loads((tmp_path / "d" / "generation_config.json").read_text())
    assert saved["dspark_policy"] == "fixed:2" and saved["dspark_lookup"] is True
    assert "default_policy" not in json.loads((tmp_path / "d" / "config.json").read_text())
    loaded = DSparkDraftModel.from_pretrained(tmp_path / "d", target=target)
    assert resolve_options(loaded, target).policy == FixedPolicy(2)
    assert resolve_options(loaded, target).lookup == LookupConfig()
    # a draft without defaults writes no generation_config.json (the files it always wrote)
    draft.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / "generation_config.json").exists()


def test_old_checkpoints_config_fields_become_the_drafts_defaults(pair, tmp_path):
    target, draft = pair
    draft.save_pretrained(tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    config.update(default_policy="fixed:3", default_lookup=True)  # how drafts recorded them before
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    loaded = DSparkDraftModel.from_pretrained(tmp_path / "old", target=target)
    assert resolve_options(loaded, target).policy == FixedPolicy(3)
    assert resolve_options(loaded, target).lookup == LookupConfig()
    assert not hasattr(loaded.config, "default_policy")  # read once, into the generation config
    loaded.save_pretrained(tmp_path / "resaved")
    assert "default_policy" not in json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert json.loads((tmp_path / "resaved" / "generation_config.json").read_text())["dspark_policy"] == "fixed:3"


@pytest.mark.usefixtures("hub")
def test_a_drafts_defaults_travel_through_the_hub_and_its_card_names_them(pair):
    from huggingface_hub import HfApi

    target, draft = pair
    with _draft_defaults(draft, {"policy": "fixed:2", "lookup": True}):
        draft.push_to_hub("alice/with-defaults")
    api = HfApi()
    assert "generation_config.json" in api.list_repo_files("alice/with-defaults")
    with open(api.hf_hub_download("alice/with-defaults", "README.md"), encoding="utf-8") as f:
        assert "| Default verification policy | `fixed:2` (`generation_config.json`) |" in f.read()
    loaded = DSparkDraftModel.from_pretrained("alice/with-defaults", target=target)
    assert (resolve_options(loaded, target).policy, resolve_options(loaded, target).lookup) == (
        FixedPolicy(2),
        LookupConfig(),
    )
    # a draft recording none pushes no such file, and loads with the library's defaults
    draft.push_to_hub("alice/without-defaults")
    assert "generation_config.json" not in api.list_repo_files("alice/without-defaults")
    plain = DSparkDraftModel.from_pretrained("alice/without-defaults", target=target)
    assert resolve_options(plain, target).policy == FixedPolicy() and resolve_options(plain, target).lookup is None


# ---------------------------------------------------------------------------------------------- the shipped draft
@pytest.mark.real_model
@pytest.mark.slow
def test_the_shipped_draft_runs_one_policy_and_lookup_in_every_driver(monkeypatch, smollm):
    from dspark_hf.default_model import load_draft
    from dspark_hf.serve import load_app

    target, tokenizer = smollm
    draft, fresh = load_draft(target)
    assert not fresh
    resolved = []
    real = generation_module.resolve_options

    def recording(*args, **kwargs):
        resolved.append(real(*args, **kwargs))
        return resolved[-1]

    monkeypatch.setattr(generation_module, "resolve_options", recording)
    messages = [{"role": "user", "content": "Count from one to ten, then say done."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt = ids["input_ids"][0].tolist()
    out = target.generate(torch.tensor([prompt]), assistant_model=draft, max_new_tokens=24, do_sample=False)
    in_generate = resolved[-1]
    engine = DSparkEngine(target, draft, tokenizer)
    served = load_app().state.server.engine
    recorded = (
        UniformHardwareAwarePolicy(),
        LookupConfig(),
    )  # the card's one policy and lookup setting (generation_config.json)
    for options in (in_generate, engine.options, served.options):
        assert (options.policy, options.lookup) == recorded
        assert options == in_generate
    tokens = out[0, len(prompt) :].tolist()
    for driver in (engine, served):
        result = driver.generate([prompt], SamplingParams(max_new_tokens=24))[0]
        assert result.ok and result.token_ids == tokens
