"""The Gradio demo without a browser: token marks from hand-built statistics, policy strings from the controls,
caps, and a streamed reply on a tiny model (the browser test drives the real page)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from dspark_hf import GenerationStats, RoundStats, resolve_policy
from dspark_hf.demo import (
    Caps,
    Settings,
    check_request,
    classify_tokens,
    confidence_colour,
    policy_string,
    render_chart,
    render_stats,
    render_tokens,
    stream_reply,
)
from train_helpers import make_char_tokenizer, make_chat_target

from helpers import make_aligned_draft


def _round(drafted, conf, verified, accepted):
    survival = torch.cumprod(torch.tensor(conf), 0).tolist()
    return RoundStats(
        drafted=drafted,
        confidence_logits=[0.0] * len(conf),
        confidence=conf,
        calibrated_confidence=conf,
        survival=survival,
        verified=verified,
        accepted=accepted,
    )


@pytest.fixture
def stats():
    """Three rounds: 2 of 3 verified drafts accepted; nothing verified; 1 of 2 accepted."""
    return GenerationStats(
        block_size=4,
        policy="test",
        rounds=[
            _round([10, 11, 12, 13], [0.9, 0.8, 0.3, 0.2], verified=3, accepted=2),
            _round([20, 21, 22, 23], [0.1, 0.1, 0.1, 0.1], verified=0, accepted=0),
            _round([30, 31, 32, 33], [0.6, 0.5, 0.4, 0.3], verified=2, accepted=1),
        ],
    )


# prefill token 5; round 1 emits 10 11 + bonus 40; round 2 bonus 41; round 3 emits 30 + bonus 50; 60 not yet recorded
NEW_IDS = [5, 10, 11, 40, 41, 30, 50, 60]


def test_classify_tokens_round_by_round(stats):
    marks = classify_tokens(NEW_IDS, stats)
    got = [(m.token_id, m.kind, m.round, m.position) for m in marks]
    assert got == [
        (5, "tok-bonus", 0, None),
        (10, "tok-accepted", 1, 1),
        (11, "tok-accepted", 1, 2),
        (12, "tok-rejected", 1, 3),  # the verified draft the target refused (not in the reply)
        (40, "tok-bonus", 1, None),
        (41, "tok-bonus", 2, None),  # nothing verified: no rejected mark
        (30, "tok-accepted", 3, 1),
        (31, "tok-rejected", 3, 2),
        (50, "tok-bonus", 3, None),
        (60, "tok-pending", -1, None),
    ]
    assert [m.confidence for m in marks if m.kind != "tok-bonus"][:3] == [0.9, 0.8, 0.3]
    assert marks[2].survival == pytest.approx(0.72)
    # the emitted tokens are exactly the reply, in order
    assert [m.token_id for m in marks if m.kind != "tok-rejected"] == NEW_IDS


def test_classify_tokens_round_cut_at_an_accepted_end_of_sequence():
    # transformers drops the bonus token after an accepted EOS draft: accepted=1 is recorded, but the token at
    # the bonus position is the second draft itself
    stats = GenerationStats(
        block_size=3, policy="t", rounds=[_round([7, 2, 9], [0.9, 0.9, 0.9], verified=3, accepted=1)]
    )
    marks = classify_tokens([5, 7, 2], stats)
    assert [m.kind for m in marks] == ["tok-bonus", "tok-accepted", "tok-accepted"]


def test_classify_tokens_while_streaming_and_before_any_token(stats):
    assert classify_tokens([], stats) == []
    marks = classify_tokens([5, 10], stats)  # round 1 only partly streamed
    assert [m.kind for m in marks] == ["tok-bonus", "tok-accepted"]
    assert [m.kind for m in classify_tokens([5, 9, 9], None)] == ["tok-bonus", "tok-pending", "tok-pending"]


def test_render_tokens_html(stats):
    tok = make_char_tokenizer()
    ids = tok.convert_tokens_to_ids(list("a<b&cdefg"))  # 9 distinct characters, two need escaping
    new_ids = [ids[i] for i in (0, 1, 2, 3, 4, 5, 6)]
    # make the rounds draft those same ids so the accepted ones match
    stats.rounds[0].drafted = [ids[1], ids[2], ids[8], ids[7]]
    stats.rounds[2].drafted = [ids[5], ids[7], ids[7], ids[7]]
    page = render_tokens(tok, new_ids, stats)
    spans = re.findall(r'<span class="tok (tok-\w+)"([^>]*)>([^<]*)</span>', page)
    assert [(kind, text) for kind, _, text in spans] == [
        ("tok-bonus", "a"),
        ("tok-accepted", "&lt;"),
        ("tok-accepted", "b"),
        ("tok-rejected", "g"),
        ("tok-bonus", "&amp;"),
        ("tok-bonus", "c"),
        ("tok-accepted", "d"),
        ("tok-rejected", "f"),
        ("tok-bonus", "e"),
    ]
    accepted = [attrs for kind, attrs, _ in spans if kind == "tok-accepted"]
    assert 'data-conf="0.900"' in accepted[0] and 'data-survival="0.900"' in accepted[0]
    assert f"background: {confidence_colour(0.9)}" in accepted[0]
    assert 'data-conf="0.800"' in accepted[1] and 'data-survival="0.720"' in accepted[1]
    assert all("data-conf" not in attrs for kind, attrs, _ in spans if kind == "tok-bonus")
    assert page.startswith('<div class="dspark-reply"')


def test_confidence_colours_run_red_to_green():
    assert confidence_colour(0.0) == "hsl(0, 80%, 82%)"
    assert confidence_colour(0.5) == "hsl(60, 80%, 82%)"
    assert confidence_colour(1.0) == "hsl(120, 80%, 82%)"
    assert confidence_colour(1.7) == confidence_colour(1.0) and confidence_colour(-1) == confidence_colour(0)


def test_chart_carries_the_numbers_it_draws(stats):
    svg = render_chart(stats, block_size=4, considered=3)
    assert 'data-verified="3,0,2"' in svg and 'data-accepted="2,0,1"' in svg and 'data-gamma="4"' in svg
    assert svg.count('class="bar-verified"') == 3 and 'class="line-considered"' in svg
    assert 'data-rounds="0"' in render_chart(None, block_size=4)


@pytest.mark.parametrize(
    "settings, expected",
    [
        (Settings(policy="fixed", gamma=3), "fixed:3"),
        (Settings(policy="threshold", threshold=0.25), "threshold:0.25"),
        (Settings(policy="hardware-aware", background_tokens=4096), "hardware_aware:4096"),
        (Settings(policy="hardware-aware lagged", background_tokens=0), "hardware_aware_lagged:0"),
        (Settings(policy="hardware-aware", background_tokens=12.0), "hardware_aware:12"),
    ],
)
def test_policy_string_from_the_controls(settings, expected):
    assert policy_string(settings) == expected
    resolve_policy(expected)  # the scheduler understands it


def test_policy_string_rejects_unknown_policy():
    with pytest.raises(ValueError, match="choose one of fixed, threshold"):
        policy_string(Settings(policy="sometimes"))


def test_gamma_is_the_fixed_policys_length():
    """γ is the length `fixed:N` verifies; the other policies choose from the whole block, and no wrapper around a
    policy cuts it: the request's policy is a plain string resolved like any other call's."""
    assert policy_string(Settings(policy="fixed", gamma=2)) == "fixed:2"
    assert policy_string(Settings(policy="threshold", threshold=0.5, gamma=2)) == "threshold:0.5"
    assert policy_string(Settings(policy="hardware-aware lagged", gamma=3)) == "hardware_aware_lagged:0"


def test_caps_are_enforced():
    caps = Caps(max_prompt_tokens=100, max_new_tokens=32)
    ok = Settings(max_new_tokens=32, gamma=7)
    assert check_request(ok, prompt_tokens=100, caps=caps, block_size=7) is None
    assert "101 tokens long" in check_request(ok, 101, caps, 7) and "at most 100" in check_request(ok, 101, caps, 7)
    assert "between 1 and 32, got 33" in check_request(Settings(max_new_tokens=33), 10, caps, 7)
    assert "block size 7, got 8" in check_request(Settings(max_new_tokens=8, gamma=8), 10, caps, 7)
    assert "temperature" in check_request(Settings(max_new_tokens=8, temperature=-1), 10, caps, 7)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        Caps(max_new_tokens=0)


@pytest.fixture(scope="module")
def tiny():
    tok, target = make_char_tokenizer(), make_chat_target(dtype=torch.float64)
    target.generation_config.eos_token_id = None  # the tiny chain reaches <|im_end|> within a few tokens
    return target, tok, make_aligned_draft(target)


def test_stream_reply_streams_then_measures_the_baseline(tiny):
    target, tok, draft = tiny
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "count to five"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    settings = Settings(policy="threshold", threshold=0.3, max_new_tokens=24)
    updates = list(stream_reply(target, draft, dict(inputs), settings, poll_seconds=0.001))
    assert [u.phase for u in updates[-2:]] == ["baseline", "done"]
    final = updates[-1]
    plain = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    assert final.new_ids == plain[0, inputs["input_ids"].shape[1] :].tolist()
    assert final.identical is True and final.speedup > 0 and final.plain_new_tokens == len(final.new_ids)
    assert final.stats.tau > 1  # the aligned draft is mostly right: the accept path is exercised
    marks = classify_tokens(final.new_ids, final.stats)
    assert "tok-pending" not in {m.kind for m in marks} and "tok-accepted" in {m.kind for m in marks}
    assert sum(m.kind in ("tok-accepted", "tok-bonus") for m in marks) == len(final.new_ids)
    page = render_stats(final)
    assert 'data-phase="done"' in page and "speedup" in page and "identical to plain generate(): <b>yes" in page
    # the γ control is the fixed policy's length, carried to generate() on the call's GenerationConfig
    fixed = list(stream_reply(target, draft, dict(inputs), Settings(policy="fixed", gamma=2, max_new_tokens=12)))
    assert fixed[-1].identical is True and fixed[-1].policy == "fixed:2"
    assert {r.verified for r in fixed[-1].stats.rounds} <= {0, 1, 2} and fixed[-1].stats.policy == "FixedPolicy(n=2)"


def test_the_app_refuses_requests_over_the_caps(tiny):
    pytest.importorskip("gradio")
    from dspark_hf.demo import build_app, make_respond

    target, tok, draft = tiny
    respond = make_respond(target, tok, draft, Caps(max_prompt_tokens=40, max_new_tokens=16))
    long_message = "tell me a joke " * 5
    with pytest.warns(UserWarning, match="at most 40 prompt tokens"):
        (chat, history, _, stats_page, box), *_ = list(respond(long_message, [], [], 0, 8, "fixed", 5, 0.3, 0))
    assert chat == [] and history == [] and box == long_message.strip() and "at most 40 prompt tokens" in stats_page
    with pytest.warns(UserWarning, match="between 1 and 16, got 17"):
        list(respond("hi", [], [], 0, 17, "fixed", 5, 0.3, 0))
    *_, (chat, history, chart, stats_page, box) = respond("hi", [], [], 0, 8, "fixed", 2, 0.3, 0)
    assert len(chat) == 2 and 'class="tok ' in chat[1]["content"] and history[0]["content"] == "hi"
    assert 'data-phase="done"' in stats_page and 'class="dspark-chart"' in chart and box == ""
    assert build_app(target, tok, draft, fresh=True).__class__.__name__ == "Blocks"


def test_demo_module_and_cli_do_not_import_gradio():
    code = (
        "import sys; import dspark_hf.demo, dspark_hf.cli; dspark_hf.cli.build_parser(); print('gradio' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_cli_defaults_are_safe():
    from dspark_hf.cli import build_parser

    args = build_parser().parse_args(["demo"])
    assert args.host == "127.0.0.1" and args.share is False
    assert args.max_prompt_tokens == 1024 and args.max_new_tokens_cap == 256


def test_cli_loads_the_models_off_the_main_thread(monkeypatch, tiny):
    """Replies decode in worker threads: a main thread that ran the loading kernels would keep a second OpenMP pool
    and slow every reply (`dspark_hf._threads`; the mechanism itself is measured in tests/serve/test_serve_threads.py)."""
    import threading

    import dspark_hf.default_model as default_model
    import dspark_hf.demo as demo
    from dspark_hf.cli import build_parser
    from dspark_hf.commands.demo import main

    target, tok, draft = tiny
    where = []

    def load_target(name):
        where.append(("target", threading.current_thread() is threading.main_thread()))
        return target, tok

    def load_draft(loaded, name):
        where.append(("draft", threading.current_thread() is threading.main_thread()))
        return draft, False

    launched = []

    class App:
        def launch(self, **kwargs):
            launched.append(kwargs)

    monkeypatch.setattr(default_model, "load_target", load_target)
    monkeypatch.setattr(default_model, "load_draft", load_draft)
    monkeypatch.setattr(demo, "build_app", lambda *args, **kwargs: App())
    assert main(build_parser().parse_args(["demo", "--port", "7999"])) == 0
    assert where == [("target", False), ("draft", False)]
    assert launched and launched[0]["server_port"] == 7999
