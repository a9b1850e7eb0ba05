"""The runtime options of speculative decoding, resolved in one place.

Every option that changes *how* a round runs (not what it outputs: verification decides that) is a field of
[`SpeculationOptions`], and [`resolve_options`] is the one function that fills it, with one precedence:

1. the call (a `generate()` keyword, a `DSparkEngine(...)` argument, a CLI flag);
2. the call's `GenerationConfig` (`dspark_policy`, `dspark_lookup`, ...);
3. the draft's own defaults: its `generation_config.json`, saved and loaded with its weights (as transformers
   stores an assistant's `num_assistant_tokens`);
4. the library's default.

`generate()`, `DSparkEngine`, `dspark serve`, `dspark eval`, the demo and the CLI all call it; nothing else
reconciles an option.

| option | `GenerationConfig` attribute | values | library default |
|---|---|---|---|
| `policy` | `dspark_policy` | a policy string or object, see [`resolve_policy`] | `hardware_aware_uniform` for a draft with a calibrated confidence head, else `fixed` |
| `lookup` | `dspark_lookup` | `True`/`False`, `"on"`/`"off"`, a token count or a [`LookupConfig`] | off |
| `cuda_graphs` | `dspark_cuda_graphs` | `True`/`False` | on for a CUDA draft |
| `kernels` | `dspark_kernels` | `"stock"`, `"packed"`, `"exact"` or `"exact-bf16"` | the kernels package's default for the target |
| `compiled` | `dspark_compiled` | `True`/`False` | on (used where the compiled round is eligible) |
| `guessed_path` | `dspark_guessed_path` | `True`/`False` | on for a CPU draft |

`None` at any level means "not set here": the next level decides.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..scheduling.policies import VerificationPolicy
    from .lookup import LookupConfig

#: The options, in the order of [`SpeculationOptions`]'s fields.
OPTION_NAMES = ("policy", "lookup", "cuda_graphs", "kernels", "compiled", "guessed_path")


def config_key(name: str) -> str:
    """The `GenerationConfig` attribute (and `generate()` keyword) that carries option `name`: `dspark_<name>`."""
    return f"dspark_{name}"


#: The `GenerationConfig` attributes (and `generate()` keywords) of the options.
CONFIG_KEYS = tuple(config_key(name) for name in OPTION_NAMES)


@dataclass(frozen=True)
class SpeculationOptions:
    """The resolved runtime options of one driver (one `generate()` call, one `DSparkEngine`).

    Args:
        policy ([`VerificationPolicy`] or `None`): how many drafted tokens each round verifies; `None` only for a
            driver without a draft (plain decoding).
        lookup ([`LookupConfig`] or `None`): prompt lookup as a proposer tried before the draft; `None` is off.
        cuda_graphs (`bool`): capture the draft step as a CUDA graph (CUDA drafts only).
        kernels (`str`): the target's kernel mode, one of `dspark_hf.kernels.KERNEL_MODES`.
        compiled (`bool`): run the drafting round as compiled calls where that backend is eligible.
        guessed_path (`bool`, *optional*): sample the sequential head's greedy guessed path
            (`dspark_hf.decoding.drafting`); `None` (options built by hand) leaves it to the device (on for a CPU).
    """

    policy: VerificationPolicy | None
    lookup: LookupConfig | None
    cuda_graphs: bool
    kernels: str
    compiled: bool
    guessed_path: bool | None = None


def resolve_options(
    draft, target, *, call: Mapping[str, Any] | None = None, generation_config=None
) -> SpeculationOptions:
    """Resolve every runtime option for one driver: the call, then its generation config, then the draft's
    defaults, then the library's default (see the module docs for the table).

    Args:
        draft ([`DSparkDraftModel`] or `None`): the draft; its defaults are `draft.generation_config`'s `dspark_*`
            attributes (its `generation_config.json`). `None` for plain decoding: only `kernels` is resolved (the
            others come back off).
        target (`PreTrainedModel`): the target; the library's default kernel mode depends on it.
        call (`Mapping[str, Any]`, *optional*): the call's own values by option name (`{"policy": "fixed:4",
            "lookup": None, ...}`); `None` values and missing names are unset.
        generation_config (`GenerationConfig`, *optional*): the call's generation config; its `dspark_*`
            attributes are the second level.

    Returns:
        [`SpeculationOptions`]

    Raises:
        ValueError: an unknown option name in `call`, or a value an option does not accept (the message says
            which level set it).
    """
    call = dict(call or {})
    unknown = sorted(set(call) - set(OPTION_NAMES))
    if unknown:
        raise ValueError(
            f"Unknown speculation option(s) {unknown}; the options are {list(OPTION_NAMES)} (as `generate()` "
            f"keywords and GenerationConfig attributes: {list(CONFIG_KEYS)})."
        )
    levels = [("the call", call.get), ("the call's generation config", _attribute_getter(generation_config))]
    if draft is not None:
        levels.append(("the draft's generation_config.json", _attribute_getter(draft_defaults(draft))))

    def pick(name: str) -> tuple[Any, str]:
        for source, get in levels:
            value = get(name)
            if value is not None:
                return value, source
        return None, "the library default"

    kernels = _kernel_mode(*pick("kernels"), target)
    if draft is None:
        return SpeculationOptions(policy=None, lookup=None, cuda_graphs=False, kernels=kernels, compiled=False)
    on_cuda = draft.device.type == "cuda"
    return SpeculationOptions(
        policy=_policy(*pick("policy"), draft),
        lookup=_lookup(*pick("lookup")),
        cuda_graphs=_flag("cuda_graphs", *pick("cuda_graphs"), default=on_cuda),
        kernels=kernels,
        compiled=_flag("compiled", *pick("compiled"), default=True),
        guessed_path=_flag("guessed_path", *pick("guessed_path"), default=draft.device.type == "cpu"),
    )


def draft_defaults(draft):
    """The draft's own option defaults: its `generation_config` (a `GenerationConfig`, `None` when it has none)."""
    return getattr(draft, "generation_config", None)


def call_options(kwargs: dict) -> dict[str, Any]:
    """Pop the `dspark_*` keywords of a `generate()` call out of `kwargs` (transformers would reject them) and
    return them by option name (`{"policy": ..., ...}`), unset ones left out."""
    return {name: kwargs.pop(key) for name, key in zip(OPTION_NAMES, CONFIG_KEYS) if key in kwargs}


# ---------------------------------------------------------------------- one check per option
def _attribute_getter(config):
    """`name -> config.dspark_<name>` (`None` when the config, or the attribute, is missing)."""
    return lambda name: getattr(config, config_key(name), None) if config is not None else None


def _policy(value, source: str, draft) -> VerificationPolicy:
    from ..scheduling.policies import resolve_policy

    try:
        return resolve_policy(
            value,
            has_confidence=draft.confidence_head is not None,
            calibrated=bool(draft.config.confidence_calibrated),
        )
    except (ValueError, TypeError) as err:
        raise type(err)(f"dspark_policy={value!r} (set by {source}): {err}") from None


def _lookup(value, source: str) -> LookupConfig | None:
    from .lookup import DEFAULT_LOOKUP, resolve_lookup

    try:
        return resolve_lookup(DEFAULT_LOOKUP if value is None else value)
    except ValueError as err:
        raise ValueError(f"{err} (set by {source})") from None


def _flag(name: str, value, source: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(
            f"{config_key(name)} must be True or False (or None for the next level's value), got {value!r} (set by "
            f"{source}). Pass a bool, or leave it unset."
        )
    return value


def _kernel_mode(value, source: str, target) -> str:
    from ..kernels import KERNEL_MODES

    mode = _library_kernels(target) if value is None else value
    if mode not in KERNEL_MODES:
        raise ValueError(
            f"dspark_kernels={mode!r} (set by {source}): kernels must be one of "
            f"{', '.join(repr(m) for m in KERNEL_MODES)}, or unset for the library's default."
        )
    return mode


def _library_kernels(target) -> str:
    """The library's one default kernel mode for `target` (`dspark_hf.kernels.default_kernels`)."""
    from ..kernels import default_kernels

    return default_kernels(target)
