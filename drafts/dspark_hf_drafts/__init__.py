"""The drafts dspark-hf ships for its default target, SmolLM2-135M-Instruct, kept out of the library's wheel.

Each draft is a folder in the Hugging Face Hub layout (`config.json`, `generation_config.json`,
`model.safetensors`, a `README.md` model card), so the same files pushed to a Hub repo load with
`DSparkDraftModel.from_pretrained(repo_id)`; installed, they load offline by name:

    import dspark_hf_drafts
    from dspark_hf import DSparkDraftModel

    draft = DSparkDraftModel.from_pretrained(dspark_hf_drafts.path("smollm2-135m-dspark"), target=target)

dspark-hf finds them by name too: `load_draft(target)`, `dspark generate --draft smollm2-135m-dspark`.
"""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"
__all__ = ["names", "path"]

_ROOT = Path(__file__).resolve().parent
_FILES = ("config.json", "model.safetensors")


def names() -> tuple[str, ...]:
    """The stable names of the drafts in this package (their folder names), sorted."""
    return tuple(sorted(p.name for p in _ROOT.iterdir() if all((p / f).is_file() for f in _FILES)))


def path(name: str) -> Path:
    """The folder of the draft `name` (one of [`names`]), ready for `DSparkDraftModel.from_pretrained`."""
    if name not in names():
        raise ValueError(f"Unknown draft {name!r}; this package holds {', '.join(names())}.")
    return _ROOT / name
