"""Sharing drafts on the Hugging Face Hub: model cards, pushes (ours or DeepSpec's format) and pulls.

A push is **one atomic commit** holding `config.json` (the draft's fields, calibration temperatures and the
target's provenance), the draft's runtime defaults (`generation_config.json`, when it records any), the
safetensors weights and a generated `README.md` model card. If the upload is cut
off, the repository stays at its previous commit; pushing again completes it (LFS objects that already
arrived are not sent twice).

What is *not* pushed: the SPS profile used by the hardware-aware verification policy (`dspark_hf.scheduling.sps`). It
measures the target's speed on one device, so it is meaningless elsewhere; it is measured and cached on the
machine that runs the draft.

Loading by repo id needs nothing from this module: `DSparkDraftModel.from_pretrained("org/draft",
revision=...)` and `AutoModel.from_pretrained("org/draft")` go through transformers, and DeepSpec-format repos
are converted on the fly: `DSparkDraftModel.from_pretrained` reads the repo's `config.json` with
[`check_remote_draft`] to detect the format, so a missing repo or revision raises `huggingface_hub`'s own
`RepositoryNotFoundError` / `RevisionNotFoundError` (transformers would turn them into an `OSError`).
"""

from __future__ import annotations

import fnmatch
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, is_dataclass
from typing import Any

import torch

from .generation_defaults import dspark_defaults

LIBRARY_NAME = "dspark-hf"
DEFAULT_TAGS = ("dspark", "speculative-decoding", "draft-model")
FORMATS = ("dspark", "deepspec")
# Files a draft repo needs; everything else (other checkpoints, logs, SPS profiles) is left on the Hub.
DRAFT_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "README.md"]
_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json")
_DOCS_URL = "https://dspark-hf.readthedocs.io"


# ---------------------------------------------------------------------------------------------- model card
def is_hub_model_id(name: str | None) -> bool:
    """`bool`: whether `name` looks like a Hub model id (`org/name`) rather than a local path."""
    if not name or os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") != 1:
        return False
    return all(part and all(c.isalnum() or c in "-_." for c in part) for part in name.split("/"))


def _evaluation_rows(evaluation: Any) -> list[dict]:
    if isinstance(evaluation, Mapping):
        if evaluation and all(isinstance(v, Mapping) for v in evaluation.values()):
            return [{"benchmark": name, **dict(metrics)} for name, metrics in evaluation.items()]
        return [dict(evaluation)]
    if isinstance(evaluation, Sequence) and not isinstance(evaluation, str):
        if all(isinstance(row, Mapping) for row in evaluation):
            return [dict(row) for row in evaluation]
    raise TypeError(
        f"`evaluation` must be a mapping {{benchmark: {{metric: value}}}}, one mapping of metrics, or a list of row "
        f"mappings; got {type(evaluation).__name__}. Example: `evaluation={{'gsm8k': {{'tau': 3.1, 'speedup': 2.4}}}}`."
    )


def _format_cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if abs(value) < 1e6 else f"{value:.3g}"
    return str(value).replace("|", "\\|")


def evaluation_table(evaluation: Any) -> str:
    """Render evaluation results as a markdown table (columns: the union of the rows' keys, in order).

    Args:
        evaluation (`Mapping` or `list[Mapping]`): `{benchmark: {metric: value}}`, a single `{metric: value}`
            mapping, or a list of row mappings.

    Returns:
        `str`: the table.
    """
    rows = _evaluation_rows(evaluation)
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_format_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _training_config_dict(training_config: Any) -> dict:
    if is_dataclass(training_config) and not isinstance(training_config, type):
        return asdict(training_config)
    if hasattr(training_config, "to_dict"):
        return dict(training_config.to_dict())
    if isinstance(training_config, Mapping):
        return dict(training_config)
    raise TypeError(
        f"`training_config` must be a mapping, a dataclass or an object with `to_dict()`; got "
        f"{type(training_config).__name__}. Pass e.g. the dict your training script was configured with."
    )


def _usage(repo_id: str, target: str, fmt: str) -> str:
    lines = [
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        "import dspark_hf  # registers the draft with transformers",
        "from dspark_hf import DSparkDraftModel, last_generation_stats",
        "",
        f'target = AutoModelForCausalLM.from_pretrained("{target}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{target}")',
        f'draft = DSparkDraftModel.from_pretrained("{repo_id}", target=target)'
        + ("  # DeepSpec format, converted on load" if fmt == "deepspec" else ""),
        "",
        'inputs = tokenizer("Explain speculative decoding in one sentence.", return_tensors="pt")',
        "out = target.generate(**inputs, assistant_model=draft, max_new_tokens=128)  # same output as without the draft",
        "print(tokenizer.decode(out[0], skip_special_tokens=True))",
        "print(last_generation_stats(draft).tau)  # tokens committed per target forward",
        "```",
    ]
    return "\n".join(lines)


def model_card(
    draft,
    repo_id: str | None = None,
    *,
    format: str = "dspark",  # noqa: A002  (the user-facing name)
    base_model: str | None = None,
    license: str = "apache-2.0",  # noqa: A002
    tags: Sequence[str] | None = None,
    evaluation: Any = None,
    training_config: Any = None,
):
    """Generate the model card pushed with a draft.

    A declarative template (the card's sections, line by line), exempt from the 80-line limit on functions:
    splitting it would scatter one document over several functions without making any of it simpler.

    Args:
        draft ([`DSparkDraftModel`]): the draft.
        repo_id (`str`, *optional*): where it is pushed; used in the usage snippet.
        format (`str`, *optional*, defaults to `"dspark"`): `"dspark"` or `"deepspec"`, the checkpoint format.
        base_model (`str`, *optional*): the target's Hub id for the `base_model` metadata. Defaults to the
            draft's recorded `target_name_or_path` when that is a Hub id (local paths are left out, the Hub
            rejects them).
        license (`str`, *optional*, defaults to `"apache-2.0"`): license of the weights (a Hub license id).
        tags (`Sequence[str]`, *optional*): extra tags, added to `dspark`, `speculative-decoding`, `draft-model`.
        evaluation (*optional*): results rendered as a table, see [`evaluation_table`].
        training_config (*optional*): the training configuration (mapping, dataclass or `to_dict()` object),
            rendered as YAML.

    Returns:
        `huggingface_hub.ModelCard`: YAML metadata (`library_name`, `base_model`, `tags`, `license`) and a body
        with usage, the draft's architecture, the evaluation table and the training configuration.
    """
    import yaml
    from huggingface_hub import ModelCard, ModelCardData

    from .._version import __version__

    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not supported; choose one of {FORMATS}.")
    c = draft.config
    base_model = base_model or (c.target_name_or_path if is_hub_model_id(c.target_name_or_path) else None)
    if base_model is not None and not is_hub_model_id(base_model):
        raise ValueError(
            f"base_model={base_model!r} is not a Hub model id ('org/name'); the Hub rejects other values in the "
            "card metadata. Pass the target's Hub id, or leave base_model unset to omit it."
        )
    all_tags = list(DEFAULT_TAGS) + (["deepspec"] if format == "deepspec" else [])
    all_tags += [t for t in (tags or []) if t not in all_tags]
    data = ModelCardData(library_name=LIBRARY_NAME, license=license, base_model=base_model, tags=all_tags)

    target = base_model or c.target_name_or_path or "<target>"
    repo = repo_id or "<this-repo>"
    head = "none (plain DFlash-style parallel drafting)"
    if c.sequential_head != "none":
        head = f"`{c.sequential_head}`, rank {c.markov_rank}"
    confidence = "no"
    if c.confidence_head:
        confidence = "yes" + (" (reads the Markov feature)" if c.uses_markov_feature else "")
    temps = [round(t, 4) for t in c.calibration_temperatures]
    calibrated = any(t != 1.0 for t in temps) or getattr(c, "confidence_calibrated", False)
    revision = f" (revision `{c.target_revision}`)" if c.target_revision else ""
    fmt_name = "DeepSpec (`Qwen3DSparkModel`; what vLLM / SGLang load)" if format == "deepspec" else "dspark-hf"
    defaults = dspark_defaults(draft.generation_config)  # what every driver runs when the call names nothing
    rows = [
        ("Target", f"`{target}`{revision}"),
        ("Checkpoint format", fmt_name),
        ("Draft layers", c.num_hidden_layers),
        ("Block size γ (tokens drafted per round)", c.block_size),
        ("Target layers read", f"`{list(c.target_layer_ids)}`"),
        ("Sequential head", head),
        ("Confidence head", confidence),
        ("Calibration (per-position temperatures)", f"`{temps}`" if calibrated else "uncalibrated (all 1.0)"),
        (
            "Default verification policy",
            f"`{defaults['dspark_policy']}` (`generation_config.json`)"
            if "dspark_policy" in defaults
            else "the library's",
        ),
        (
            "Prompt lookup before drafting",
            "the library's default (off)"
            if "dspark_lookup" not in defaults
            else f"`{defaults['dspark_lookup']}` (`generation_config.json`)",
        ),
        ("Draft parameters", f"{sum(p.numel() for p in draft.parameters()):,}"),
        ("Written by", f"dspark-hf {c.dspark_version or __version__}"),
    ]
    body = [
        f"# DSpark draft for `{target}`",
        "",
        f"A DSpark speculative-decoding draft for `{target}`, made with [dspark-hf]({_DOCS_URL}). It makes the "
        "target generate with fewer forward passes and **exactly the same output**: greedy output is "
        "token-identical to plain `generate()` in fp32, and sampling keeps the target's distribution. (In bf16 or "
        "fp16, a forward over several tokens can round a near-tie differently from one-token decoding, for any "
        "speculative method.) It is not a "
        "standalone language model; it reads the target's hidden states and uses the target's embedding and "
        "LM head, which are "
        + ("stored here as frozen copies (DeepSpec format)." if format == "deepspec" else "not stored here."),
        "",
        "## Use it with `generate()`",
        "",
        _usage(repo, target, format),
        "",
        "Loading with `target=` checks that the draft fits the target (vocabulary, hidden size, layer ids).",
    ]
    if format == "deepspec":
        body += [
            "",
            "## Serve it",
            "",
            "This repo is in DeepSpec's format, which vLLM and SGLang load next to the target:",
            "",
            "```bash",
            f"vllm serve {target} \\",
            f'  --speculative-config \'{{"method": "dspark", "model": "{repo}", '
            f'"num_speculative_tokens": {c.block_size}}}\'',
            "",
            f"python -m sglang.launch_server --model-path {target} \\",
            f"  --speculative-algorithm DSPARK --speculative-draft-model-path {repo}",
            "```",
            "",
            f"Options differ between engine versions; see [serving exported drafts]({_DOCS_URL}/hub/).",
        ]
    body += ["", "## Draft", "", "| | |", "|---|---|"]
    body += [f"| {k} | {v} |" for k, v in rows]
    body += [
        "",
        "The SPS profile used by the hardware-aware verification policy (the target's measured speed at each "
        "verification length) is specific to a device, so it is not part of this checkpoint: dspark-hf "
        "measures and caches one on the machine that runs the draft.",
        "",
        "## Evaluation",
        "",
        evaluation_table(evaluation)
        if evaluation is not None
        else "No evaluation results were provided with this upload.",
        "",
        "## Training configuration",
        "",
    ]
    if training_config is not None:
        dumped = yaml.safe_dump(_training_config_dict(training_config), sort_keys=False, allow_unicode=True)
        body += ["```yaml", dumped.rstrip(), "```"]
    else:
        body += ["Not provided with this upload."]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n")


# ---------------------------------------------------------------------------------------------- push
def _network_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx"):  # whichever HTTP client this huggingface_hub uses
        try:
            errors.append(__import__(module).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def push_draft(
    draft,
    repo_id: str,
    *,
    format: str = "dspark",  # noqa: A002
    target=None,
    dtype: torch.dtype | None = None,
    revision: str | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    commit_message: str | None = None,
    commit_description: str | None = None,
    create_pr: bool = False,
    max_shard_size: int | str = "50GB",
    card: Any = True,
    endpoint: str | None = None,
    **card_kwargs: Any,
):
    """Push a draft to the Hub as one atomic commit: config, safetensors weights and a model card.

    Args:
        draft ([`DSparkDraftModel`]): the draft.
        repo_id (`str`): destination, `"name"` (in your namespace) or `"org/name"`; created if missing.
        format (`str`, *optional*, defaults to `"dspark"`): `"dspark"` (our format: the draft's own weights,
            loadable with `AutoModel`) or `"deepspec"` (DeepSpec's format, with the target's embedding and LM
            head copied in: what vLLM and SGLang serve).
        target (`PreTrainedModel`, *optional*): needed for `format="deepspec"` unless the draft is bound.
        dtype (`torch.dtype`, *optional*): dtype of the weights written for `format="deepspec"`.
        revision (`str`, *optional*): branch to commit to (created from `main` if missing).
        private (`bool`, *optional*): visibility of a newly created repo (an existing repo keeps its own).
        token (`str` or `bool`, *optional*): Hub token; defaults to `HF_TOKEN` or the stored login.
        commit_message (`str`, *optional*): defaults to `"Upload DSpark draft (<format> format)"`.
        commit_description (`str`, *optional*): longer commit description.
        create_pr (`bool`, *optional*, defaults to `False`): open a pull request instead of committing.
        max_shard_size (`int` or `str`, *optional*, defaults to `"50GB"`): shard size for `format="dspark"`.
        card (`bool`, `str` or `ModelCard`, *optional*, defaults to `True`): `True` generates the card with
            [`model_card`]; `False` leaves the repo's `README.md` alone; a string or `ModelCard` is used as is.
        endpoint (`str`, *optional*): Hub endpoint; defaults to `HF_ENDPOINT` / huggingface.co.
        **card_kwargs: passed to [`model_card`] (`evaluation`, `training_config`, `license`, `tags`,
            `base_model`).

    Returns:
        `huggingface_hub.CommitInfo`: the commit (`.oid`, `.commit_url`, `.pr_url`).
    """
    from huggingface_hub import HfApi

    from .._version import __version__

    _check_push(draft, format, target)
    api = HfApi(endpoint=endpoint, token=token, library_name=LIBRARY_NAME, library_version=__version__)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    if revision is not None and revision != "main" and not revision.startswith("refs/pr/") and not create_pr:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        _write_draft(draft, tmp, format, target, dtype, max_shard_size)
        if card is True:
            card = model_card(draft, repo_id, format=format, **card_kwargs)
        if card is not False:
            with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as f:
                f.write(str(card))
        return _commit(
            api,
            repo_id,
            _operations(api, repo_id, revision, tmp),
            commit_message=commit_message or f"Upload DSpark draft ({format} format)",
            commit_description=commit_description,
            revision=revision,
            create_pr=create_pr,
        )


def _check_push(draft, format: str, target) -> None:  # noqa: A002
    """Refuse an unknown format, and a DeepSpec push with no target to take the embedding and LM head from."""
    if format not in FORMATS:
        raise ValueError(
            f"format={format!r} is not supported; choose 'dspark' (dspark-hf's format, loads with AutoModel) or "
            "'deepspec' (DeepSpec's format, for vLLM / SGLang)."
        )
    if format == "deepspec" and target is None and not draft.is_bound:
        raise ValueError(
            "format='deepspec' stores the target's embedding and LM head and builds on the target's config, but the "
            "draft is not bound to a target. Pass `target=` (the causal LM the draft was built for) or call "
            "`draft.bind_target(target)` first."
        )


def _write_draft(draft, folder: str, format: str, target, dtype, max_shard_size) -> None:  # noqa: A002
    """The draft's files in `folder`: DeepSpec's export, or `save_pretrained` in our format."""
    if format == "deepspec":
        from .formats import export_deepspec

        export_deepspec(draft, folder, target=target, dtype=dtype)
    else:
        draft.save_pretrained(folder, max_shard_size=max_shard_size)


def _operations(api, repo_id: str, revision: str | None, folder: str) -> list:
    """One commit's operations: add every file of `folder`, and delete the repo's top-level weight files that
    this push does not overwrite."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    names = sorted(os.listdir(folder))
    operations: list = [CommitOperationAdd(path_in_repo=n, path_or_fileobj=os.path.join(folder, n)) for n in names]
    # Weights of an earlier push that this one does not overwrite (other shard count or format) would
    # shadow or mix with the new ones, so they go in the same commit.
    existing = api.list_repo_files(repo_id, revision=revision)
    operations += [
        CommitOperationDelete(path_in_repo=p)
        for p in existing
        if p not in names and "/" not in p and any(fnmatch.fnmatch(p, pat) for pat in _WEIGHT_FILES)
    ]
    return operations


def _commit(api, repo_id: str, operations: list, **commit_kwargs):
    """`api.create_commit`, with a cut-off upload reported as a `ConnectionError` that says the repo is unchanged
    and the push can simply be run again."""
    try:
        return api.create_commit(repo_id, operations, **commit_kwargs)
    except (*_network_errors(), RuntimeError) as e:
        if isinstance(e, RuntimeError) and not isinstance(e.__cause__, _network_errors()):
            raise
        raise ConnectionError(
            f"Pushing the draft to {repo_id} was cut off ({type(e).__name__}: {e}). Hub commits are atomic, so the "
            "repository is unchanged (still at its previous commit). Run the same push again; weights that "
            "already reached the Hub are not uploaded twice."
        ) from e


# ---------------------------------------------------------------------------------------------- pull
def check_remote_draft(
    repo_id: str,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    force_download: bool = False,
    local_files_only: bool = False,
    subfolder: str = "",
    **unused: Any,
) -> str | None:
    """Fetch a Hub draft's `config.json`, letting a missing repo or revision raise the client's own error.

    transformers turns `RepositoryNotFoundError` and `RevisionNotFoundError` into a generic `OSError`;
    `DSparkDraftModel.from_pretrained` calls this first so that callers can catch the specific errors.

    Args:
        repo_id (`str`): Hub repo id.
        revision (`str`, *optional*): branch, tag or commit.
        token (`str` or `bool`, *optional*): Hub token.
        cache_dir (`str`, *optional*): Hugging Face cache location.
        force_download (`bool`, *optional*, defaults to `False`): re-download even if cached.
        local_files_only (`bool`, *optional*, defaults to `False`): use the cache only.
        subfolder (`str`, *optional*): folder of the draft inside the repo.
        **unused: other `from_pretrained` arguments, ignored here.

    Returns:
        `str` or `None`: the local path of `config.json`, or `None` if it could not be fetched for another
        reason (offline, not a repo id, no config), which transformers then reports.

    Raises:
        `huggingface_hub.errors.RepositoryNotFoundError`: the repo does not exist or is private to someone else.
        `huggingface_hub.errors.RevisionNotFoundError`: `revision` is not a branch, tag or commit of the repo.
        `huggingface_hub.errors.HfHubHTTPError`: with status 401, the token is invalid.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return hf_hub_download(
            repo_id,
            "config.json",
            subfolder=subfolder or None,
            revision=revision,
            token=token,
            cache_dir=cache_dir,
            force_download=force_download,
            local_files_only=local_files_only,
        )
    except RevisionNotFoundError as e:
        e.append_to_message(
            f"\nrevision={revision!r} is not a branch, tag or commit of {repo_id}. List them with "
            f"`huggingface_hub.list_repo_refs({repo_id!r})`, or omit `revision` to load `main`."
        )
        raise
    except RepositoryNotFoundError as e:
        e.append_to_message(
            f"\nNo draft repo {repo_id!r} is visible with this token. Check the id; for a private repo pass "
            "`token=` (or log in with `hf auth login`) as an account that can read it."
        )
        raise
    except HfHubHTTPError as e:
        if e.response is not None and e.response.status_code == 401:  # an invalid token, not a missing repo
            e.append_to_message("\nThe Hub rejected the token. Pass a valid `token=`, or log in with `hf auth login`.")
            raise
        return None
    except Exception:
        return None


def is_deepspec_repo(repo_id: str, **kwargs: Any) -> bool:
    """Whether a Hub repo holds a DeepSpec-format draft, read from its `config.json` (fetched once).

    Args:
        repo_id (`str`): Hub repo id.
        **kwargs: `revision`, `token`, `cache_dir`, ... as for [`check_remote_draft`], which raises the
            client's `RepositoryNotFoundError` / `RevisionNotFoundError`.

    Returns:
        `bool`: `False` also when the config could not be fetched, so that transformers reports the problem.
    """
    from .formats import is_deepspec_checkpoint

    config_file = check_remote_draft(repo_id, **kwargs)
    return config_file is not None and is_deepspec_checkpoint(os.path.dirname(config_file))


def checkpoint_format(path_or_repo: str, **kwargs: Any) -> str | None:
    """`"deepspec"`, `"speculators"` or `None` (our own format, or unreadable: transformers reports it).

    Args:
        path_or_repo (`str`): local folder or Hub repo id (its `config.json` is fetched once).
        **kwargs: `revision`, `token`, ... as for [`check_remote_draft`].
    """
    from .formats import is_deepspec_config
    from .speculators_format import is_speculators_config

    if os.path.isdir(path_or_repo):
        config_file = os.path.join(path_or_repo, "config.json")
        config_file = config_file if os.path.exists(config_file) else None
    else:
        config_file = check_remote_draft(path_or_repo, **kwargs)
    if config_file is None:
        return None
    with open(config_file, encoding="utf-8") as f:
        cfg = json.load(f)
    if is_speculators_config(cfg):
        return "speculators"
    return "deepspec" if is_deepspec_config(cfg) else None


def draft_format(path: str | os.PathLike) -> str:
    """`str`: `"dspark"`, `"deepspec"` or `"speculators"`, the format of the draft checkpoint in a local folder."""
    from .formats import is_deepspec_config
    from .speculators_format import is_speculators_config

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    if cfg.get("model_type") == "dspark":
        return "dspark"
    if is_speculators_config(cfg):
        return "speculators"
    if is_deepspec_config(cfg):
        return "deepspec"
    raise ValueError(
        f"{path}/config.json is neither a dspark-hf draft (model_type 'dspark'), a DeepSpec draft "
        "(block_size + target_layer_ids) nor a speculators DSpark draft (speculators_model_type); got "
        f"model_type={cfg.get('model_type')!r}. Is this a draft repo?"
    )


def pull_draft(
    repo_id: str,
    *,
    revision: str | None = None,
    local_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    force_download: bool = False,
    local_files_only: bool = False,
    endpoint: str | None = None,
) -> str:
    """Download a draft's files (config, safetensors weights, model card) from the Hub.

    Args:
        repo_id (`str`): Hub repo id, in either format.
        revision (`str`, *optional*): branch, tag or commit; defaults to `main`.
        local_dir (`str`, *optional*): copy the files into this folder instead of only the Hugging Face cache.
        token (`str` or `bool`, *optional*): Hub token.
        cache_dir (`str`, *optional*): Hugging Face cache location.
        force_download (`bool`, *optional*, defaults to `False`): re-download even if cached.
        local_files_only (`bool`, *optional*, defaults to `False`): use the cache only (offline).
        endpoint (`str`, *optional*): Hub endpoint; defaults to `HF_ENDPOINT` / huggingface.co.

    Returns:
        `str`: the local folder, loadable with `DSparkDraftModel.from_pretrained`.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            local_dir=local_dir,
            token=token,
            cache_dir=cache_dir,
            force_download=force_download,
            local_files_only=local_files_only,
            allow_patterns=DRAFT_FILES,
            endpoint=endpoint,
        )
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        e.append_to_message(f"\nCould not pull draft {repo_id!r} at revision {revision or 'main'!r}.")
        raise
    names = os.listdir(path)
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise ValueError(
            f"{repo_id} (revision {revision or 'main'!r}) has no config.json + safetensors weights; found {sorted(names)}. "
            "dspark-hf loads safetensors only. Is this a draft repo, and is the revision right?"
        )
    return path
