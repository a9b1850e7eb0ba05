"""The Gradio demo (`dspark demo`): chat with the target while a DSpark draft speculates, and watch the scheduler.

Each reply is shown token by token, coloured by the draft's calibrated confidence and marked as an accepted
draft, a draft the target rejected, or a token the target produced itself (the bonus token of a round, or
the prefill's first token). A per-round chart shows how many drafted tokens the verification policy sent to
the target against the γ it could have sent, and how many were accepted. τ and tokens/s update live; the
speedup is measured against plain `generate()` on the same prompt, run right after the speculative reply.

The package reads top-down: `settings` (the controls and caps), `reply` (one request, streamed, then its plain
baseline), `render` (the HTML: tokens, legend, chart, statistics) and `app` (the Gradio page). Everything except
[`build_app`][dspark_hf.demo.app.build_app] is plain Python on token ids and
[`GenerationStats`][dspark_hf.decoding.stats.GenerationStats], so it is tested without a browser;
`app` is the only module that imports gradio (the `demo` extra), and only when a page is built. `browser` drives
the page in headless Chromium for the browser test and the docs' screenshot (`scripts/demo_screenshot.py`); the app
never imports it.
"""

from .app import build_app, import_gradio, make_respond
from .render import (
    KINDS,
    TokenMark,
    classify_tokens,
    confidence_colour,
    legend_html,
    render_chart,
    render_stats,
    render_tokens,
    token_pieces,
)
from .reply import Progress, request_config, stream_reply
from .settings import POLICIES, Caps, Settings, check_request, policy_string

__all__ = [
    "KINDS",
    "POLICIES",
    "Caps",
    "Progress",
    "Settings",
    "TokenMark",
    "build_app",
    "check_request",
    "classify_tokens",
    "confidence_colour",
    "import_gradio",
    "legend_html",
    "make_respond",
    "policy_string",
    "render_chart",
    "render_stats",
    "render_tokens",
    "request_config",
    "stream_reply",
    "token_pieces",
]
