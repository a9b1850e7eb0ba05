"""Drive the demo page in a headless Chromium: what the browser test (`tests/apps/test_demo_browser.py`) and the
docs' screenshot (`scripts/demo_screenshot.py`) share.

It uses Debian's `chromium` through the `playwright` package; the browser is never downloaded (`playwright
install` is not used). Nothing here is imported by the app itself.
"""

from __future__ import annotations

import importlib.util
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: Debian's Chromium (`apt-get install -y chromium`)
CHROMIUM = "/usr/bin/chromium"
#: headless on a machine without a display, a GPU or a network to reach
CHROMIUM_FLAGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
#: a reply ends when the statistics box says so: after the speculative reply and its plain baseline
DONE = '.dspark-stats[data-phase="done"]'


def browser_missing() -> str | None:
    """What is missing to drive the demo in a browser (Chromium, playwright, gradio), or `None`."""
    if not Path(CHROMIUM).exists():
        return f"Chromium is not installed at {CHROMIUM} (apt-get install -y chromium)"
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed (pip install playwright; never `playwright install`)"
    if importlib.util.find_spec("gradio") is None:
        return "gradio is not installed (pip install 'dspark-hf[demo]')"
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def open_page(url: str, width: int = 1280, height: int = 900, timeout_ms: int = 30_000) -> Iterator:
    """A playwright `Page` on the demo at `url`, loaded (its Send button shown); the browser closes on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=list(CHROMIUM_FLAGS))
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(timeout_ms)
            page.goto(url)
            page.wait_for_selector("#dspark-send")
            yield page
        finally:
            browser.close()


def set_number(page, elem_id: str, value) -> None:
    """Type into a gradio slider's number box and check the slider took the value."""
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")
    page.wait_for_function(
        "([id, v]) => document.querySelector(`#${id} input[type=range]`).value === v", arg=[elem_id, str(value)]
    )


def send(page, prompt: str, timeout_ms: int = 600_000) -> dict:
    """Send `prompt`, wait until the reply and its plain baseline are done; returns the chart's verified lengths
    per round (`verified`) and the statistics box's text (`stats`)."""
    page.locator("#dspark-input textarea").fill(prompt)
    page.locator("#dspark-send").click()
    page.wait_for_selector(DONE, timeout=timeout_ms)
    verified = page.locator("#dspark-chart svg.dspark-chart").get_attribute("data-verified")
    return {
        "verified": [int(v) for v in verified.split(",")] if verified else [],
        "stats": page.locator("#dspark-stats").inner_text(),
    }


def clear(page) -> None:
    """Press Clear and wait until the page is back to an empty conversation."""
    page.locator("#dspark-clear").click()
    page.wait_for_selector('.dspark-stats[data-phase="idle"]')
