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


def _nav_pages(nav) -> set[str]:
    pages: set[str] = set()
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(value, list):
            pages |= _nav_pages(value)
        else:
            pages.add(value)
    return pages


def test_every_page_is_in_the_nav_and_none_is_hidden_by_hand():
    """A page in docs/ is reachable from the nav; `not_in_nav` would hide pages from the build's check."""
    yaml = pytest.importorskip("yaml")

    config = yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert "not_in_nav" not in config, "mkdocs.yml hides pages from the nav by hand"
    docs = REPO_ROOT / "docs"
    pages = {p.relative_to(docs).as_posix() for p in docs.rglob("*.md")}
    nav = _nav_pages(config["nav"])
    assert pages - nav == set(), f"pages outside the nav: {sorted(pages - nav)}"
    assert nav - pages == set(), f"nav entries without a page: {sorted(nav - pages)}"


def test_docs_hold_what_holds_now():
    """The docs stay a user's docs, not a lab journal: under 3 MB, and no dated per-round section headings
    (dated experiments go to research/, one folder each)."""
    import re

    docs = REPO_ROOT / "docs"
    size = sum(p.stat().st_size for p in docs.rglob("*") if p.is_file())
    assert size <= 3 * 1024 * 1024, f"docs/ holds {size / 2**20:.1f} MB; move experiments' files to research/"
    heading = re.compile(r"^#{1,6} .*(\bRound \d|\b20\d\d-\d\d-\d\d\b)", re.IGNORECASE)
    found = []
    for page in sorted(docs.rglob("*.md")):
        in_code = False
        for i, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            in_code ^= line.lstrip().startswith("```")  # a `# comment` in a code block is no heading
            if not in_code and heading.match(line):
                found.append(f"{page.relative_to(REPO_ROOT)}:{i}: {line}")
    assert not found, "dated or per-round sections in the docs (move them to research/):\n" + "\n".join(found)
