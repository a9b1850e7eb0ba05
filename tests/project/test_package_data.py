"""The library's wheel holds code, not weights: the shipped drafts are the separate package `dspark-hf-drafts`
(`drafts/`), one folder per draft in the Hub layout. Static checks (nothing is built): the package-data globs and
the files under `src/dspark_hf/` that a glob could pick up."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIBRARY = REPO / "src" / "dspark_hf"
DRAFTS = REPO / "drafts" / "dspark_hf_drafts"
#: file types that hold weights or tensors
WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx", ".npy", ".npz", ".h5"}
HUB_FILES = ("config.json", "generation_config.json", "model.safetensors", "README.md")


def _pyproject(path: Path) -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (the suite's tested version)
    return tomllib.loads(path.read_text(encoding="utf-8"))


def test_library_package_data_names_no_weights():
    package_data = _pyproject(REPO / "pyproject.toml")["tool"]["setuptools"]["package-data"]
    globs = [glob for patterns in package_data.values() for glob in patterns]
    heavy = [g for g in globs if "drafts" in g or any(g.endswith(s) for s in WEIGHT_SUFFIXES) or g.endswith("*")]
    assert not heavy, f"the library's package data would ship weights: {heavy} (they belong in drafts/)"
    assert not (REPO / "MANIFEST.in").exists(), "a MANIFEST.in could add files to the wheel; keep package data explicit"


def test_no_weight_files_or_large_files_inside_the_library():
    files = [p for p in LIBRARY.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    weights = [str(p.relative_to(REPO)) for p in files if p.suffix in WEIGHT_SUFFIXES]
    large = [str(p.relative_to(REPO)) for p in files if p.stat().st_size > 1_000_000]
    assert not weights, f"weight files inside the library: {weights} (they belong in drafts/)"
    assert not large, f"files over 1 MB inside the library: {large}"


def test_drafts_package_holds_every_shipped_draft_in_the_hub_layout():
    from dspark_hf.default_model import SHIPPED_DRAFTS

    project = _pyproject(REPO / "drafts" / "pyproject.toml")
    assert project["project"]["name"] == "dspark-hf-drafts"
    globs = project["tool"]["setuptools"]["package-data"]["dspark_hf_drafts"]
    folders = sorted(p.name for p in DRAFTS.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(SHIPPED_DRAFTS)
    for name in folders:
        for file in HUB_FILES:
            assert (DRAFTS / name / file).is_file(), f"drafts/dspark_hf_drafts/{name}/{file} is missing"
            assert f"*/{file}" in globs, f"drafts/pyproject.toml does not package {file}"
