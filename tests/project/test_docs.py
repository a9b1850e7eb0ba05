"""The documentation site builds without warnings (`mkdocs build --strict`), API reference included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_docs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        print(result.stderr)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}"


def test_no_unfilled_placeholders():
    """A line that is only an ALL_CAPS token (e.g. `POLICY_SECTION`) is a placeholder left in a page."""
    import re

    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
    found = [
        f"{page.relative_to(REPO_ROOT)}:{i}: {line}"
        for page in pages
        for i, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if re.fullmatch(r"[A-Z][A-Z0-9_]{5,}", line.strip())
    ]
    assert not found, "placeholders left in the docs:\n" + "\n".join(found)
