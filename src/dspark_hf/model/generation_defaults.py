"""A draft's own runtime defaults: its `generation_config.json`, saved and loaded with its weights.

transformers keeps an assistant model's decoding defaults (`num_assistant_tokens`, ...) on the assistant's own
`generation_config`; a DSpark draft does the same with the `dspark_*` options of
`dspark_hf.decoding.options` (`dspark_policy`, `dspark_lookup`, `dspark_cuda_graphs`, `dspark_kernels`,
`dspark_compiled`, `dspark_guessed_path`). `resolve_options` reads them as the third level of its precedence
(after the call and the call's `GenerationConfig`), in every driver alike.

A draft is not a `GenerationMixin` model, so transformers neither gives it a generation config nor saves or loads
one; [`DSparkDraftModel`] does it with the functions here. Checkpoints written before this file existed recorded
two of these defaults as config fields (`default_policy`, `default_lookup`): they are read once, when the draft
is built, into its generation config (and removed from the config, so a re-save writes them in the new place).
"""

from __future__ import annotations

import os

from transformers import GenerationConfig

GENERATION_CONFIG_FILE = "generation_config.json"

#: Config fields of older checkpoints and the generation-config attribute each one became.
LEGACY_FIELDS = {"default_policy": "dspark_policy", "default_lookup": "dspark_lookup"}

#: Draft attributes that once carried runtime options, and the generation-config attribute that does now.
MOVED_ATTRIBUTES = {
    "policy": "dspark_policy",
    "lookup": "dspark_lookup",
    "cuda_graphs": "dspark_cuda_graphs",
    "compiled_round": "dspark_compiled",
    "guessed_path": "dspark_guessed_path",
}

#: `from_pretrained` keywords that say where and how to fetch the file (the rest are for the weights).
_FETCH_KEYWORDS = ("revision", "token", "cache_dir", "local_files_only", "subfolder", "force_download", "proxies")


def check_legacy_fields(values: dict) -> None:
    """Refuse a bad value in the legacy config fields (`default_lookup` must be a bool or `None`)."""
    lookup = values.get("default_lookup")
    if lookup is not None and not isinstance(lookup, bool):
        raise ValueError(
            f"DSparkConfig.default_lookup must be true, false or null (the library's default), got {lookup!r}. "
            "Newer drafts record it as `dspark_lookup` in their generation_config.json."
        )


def check_moved_attribute(name: str, value) -> None:
    """Refuse setting a draft attribute that no driver reads any more (it would be silently ignored)."""
    if name in MOVED_ATTRIBUTES:
        key = MOVED_ATTRIBUTES[name]
        raise AttributeError(
            f"`draft.{name}` is no longer read. Set the draft's default with `draft.generation_config.{key} = "
            f"{value!r}` (saved with it as generation_config.json), or pass `{key}=` to one generate() call "
            "(see dspark_hf.decoding.options)."
        )


def defaults_from_config(config) -> GenerationConfig:
    """A new draft's generation config: empty, or holding the legacy `default_*` fields of `config`, which are
    removed from it (read once, here)."""
    values = {}
    for field, key in LEGACY_FIELDS.items():
        value = config.__dict__.pop(field, None)
        if value is not None:
            values[key] = value
    return GenerationConfig(**values)


def dspark_defaults(generation_config) -> dict:
    """The `dspark_*` entries of `generation_config` that are set (not `None`)."""
    if generation_config is None:
        return {}
    return {k: v for k, v in generation_config.to_dict().items() if k.startswith("dspark_") and v is not None}


def load_defaults(path: str, current: GenerationConfig, **kwargs) -> GenerationConfig:
    """The draft's generation config from `path` (a folder or Hub id) when it has a `generation_config.json`;
    entries it leaves unset keep `current`'s (the legacy config fields). `kwargs`: `from_pretrained`'s."""
    fetch = {k: kwargs[k] for k in _FETCH_KEYWORDS if kwargs.get(k) is not None}
    if os.path.isdir(path) and not os.path.isfile(
        os.path.join(path, fetch.get("subfolder", ""), GENERATION_CONFIG_FILE)
    ):
        return current
    try:
        loaded = GenerationConfig.from_pretrained(path, GENERATION_CONFIG_FILE, **fetch)
    except OSError:  # a Hub draft without the file (every draft saved before it existed)
        return current
    for key, value in dspark_defaults(current).items():
        if getattr(loaded, key, None) is None:
            setattr(loaded, key, value)
    return loaded


def save_defaults(generation_config, directory: str) -> None:
    """Write `generation_config.json` into `directory` when the draft records any default (a draft without one
    saves exactly the files it always did)."""
    if dspark_defaults(generation_config):
        generation_config.save_pretrained(directory)
