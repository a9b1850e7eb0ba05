"""Test-suite set-up shared by every test file.

The suite gets cache folders of its own, made fresh for each run: a timing profile or a converted model left
in the user's `~/.cache/dspark_hf` by an earlier run (on a busy machine, say) must neither steer a test nor
hide a missing install step, and the tests must never write there. The variables are set here, at import,
before any test module imports `huggingface_hub` (which reads `HF_HOME` once, at import).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

#: the user's own cache folder, as it would be without this file (what the suite must not touch)
USER_CACHE = Path(os.environ.get("DSPARK_HF_CACHE", Path.home() / ".cache" / "dspark_hf")).resolve()
SUITE_CACHE_ROOT = Path(tempfile.mkdtemp(prefix="dspark-tests-"))
SUITE_CACHE = SUITE_CACHE_ROOT / "dspark_hf"
os.environ["DSPARK_HF_CACHE"] = str(SUITE_CACHE)
os.environ["HF_HOME"] = str(SUITE_CACHE_ROOT / "huggingface")
os.environ["TORCH_EXTENSIONS_DIR"] = str(SUITE_CACHE_ROOT / "torch_extensions")


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its size and modification time (empty when the folder does not exist)."""
    if not folder.is_dir():
        return {}
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file() or p.is_symlink()
    }


_USER_CACHE_BEFORE = _snapshot(USER_CACHE)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if anything under the user's cache folder appeared, changed or vanished during it."""
    after = _snapshot(USER_CACHE)
    if after != _USER_CACHE_BEFORE:
        changed = sorted(set(after.items()) ^ set(_USER_CACHE_BEFORE.items()))
        print(f"\nERROR: the test suite touched the user's cache folder {USER_CACHE}: {changed[:5]}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    shutil.rmtree(SUITE_CACHE_ROOT, ignore_errors=True)


@pytest.fixture(scope="session")
def user_cache_folder() -> Path:
    """The user's real dspark_hf cache folder (which no test may write to)."""
    return USER_CACHE


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and do not fight other test processes for cores). A module
    opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
