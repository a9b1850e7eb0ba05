"""The demo's HTML: each token marked (accepted draft, rejected draft, the target's own token) and coloured by
the draft's confidence, the legend, the per-round chart (inline SVG) and the live statistics panel.

Everything here is plain Python on token ids and [`GenerationStats`][dspark_hf.decoding.stats.GenerationStats],
so it is tested without a browser.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from ..decoding.stats import GenerationStats
from .reply import Progress

# Marks of rendered tokens: CSS class → (legend text, inline style). Styles are inline so the page needs no
# stylesheet (gradio 5 and 6 take custom CSS in different places) and the chat box keeps them.
KINDS = {
    "tok-accepted": ("accepted draft (colour: calibrated confidence)", ""),
    "tok-rejected": (
        "draft the target rejected (not in the reply)",
        "text-decoration: line-through; color: #b91c1c; opacity: 0.75;",
    ),
    "tok-bonus": (
        "token from the target itself (a round's bonus token, or the prefill's)",
        "background: #e5e7eb; border-bottom: 2px solid #4b5563;",
    ),
    "tok-pending": ("round not recorded yet (streaming)", "background: #f3f4f6;"),
}


@dataclass
class TokenMark:
    """One rendered token: its id, CSS class (a key of [`KINDS`]) and what the draft thought of it."""

    token_id: int
    kind: str
    round: int  # 0 = the prefill; i >= 1 = the i-th speculative round
    position: int | None = None  # 1-based position in the drafted block (drafted tokens only)
    confidence: float | None = None  # calibrated confidence of that position
    survival: float | None = None  # prefix survival up to that position


def classify_tokens(new_ids: list[int], stats: GenerationStats | None) -> list[TokenMark]:
    """Label the generated tokens round by round (plus the rejected drafts, which are not in `new_ids`).

    The first new token comes from the prefill; each recorded round then emits its `accepted` drafts and one
    target token. Tokens past the recorded rounds (streaming: the round's statistics arrive just after its
    tokens) are `tok-pending`.
    """
    rounds = stats.rounds if stats is not None else []
    marks: list[TokenMark] = []
    i = 0
    if new_ids:
        marks.append(TokenMark(new_ids[0], "tok-bonus", 0))
        i = 1
    for number, r in enumerate(list(rounds), start=1):
        if i >= len(new_ids):
            break

        def drafted_mark(k: int, kind: str, token_id: int, r=r, number=number) -> TokenMark:
            conf = r.calibrated_confidence[k] if k < len(r.calibrated_confidence) else None
            surv = r.survival[k] if k < len(r.survival) else None
            return TokenMark(token_id, kind, number, k + 1, conf, surv)

        for k in range(r.accepted):
            if i >= len(new_ids):
                break
            marks.append(drafted_mark(k, "tok-accepted", new_ids[i]))
            i += 1
        if i >= len(new_ids):
            break
        k = r.accepted
        if k < r.verified and new_ids[i] == r.drafted[k]:
            # transformers cuts a round at an accepted end-of-sequence draft, leaving no bonus token; a
            # rejected draft can never equal the target's replacement, so this draft was accepted.
            marks.append(drafted_mark(k, "tok-accepted", new_ids[i]))
            i += 1
            continue
        if k < r.verified:
            marks.append(drafted_mark(k, "tok-rejected", r.drafted[k]))
        marks.append(TokenMark(new_ids[i], "tok-bonus", number))
        i += 1
    marks.extend(TokenMark(t, "tok-pending", -1) for t in new_ids[i:])
    return marks


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds, decoded incrementally (so multi-byte characters split over tokens survive)."""
    pieces, previous = [], ""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        if text.startswith(previous):
            pieces.append(text[len(previous) :])
        else:  # the decoder rewrote earlier text (rare); show the token on its own
            pieces.append(tokenizer.decode(ids[n - 1 : n]))
        previous = text
    return pieces


def confidence_colour(confidence: float) -> str:
    """Background colour for a calibrated confidence: red (0) through yellow to green (1)."""
    c = min(max(float(confidence), 0.0), 1.0)
    return f"hsl({120 * c:.0f}, 80%, 82%)"


def _span(piece: str, mark: TokenMark) -> str:
    style = KINDS[mark.kind][1]
    attrs = [f'class="tok {mark.kind}"', f'data-round="{mark.round}"', f'data-token-id="{mark.token_id}"']
    title = "prefill" if mark.round == 0 else f"round {mark.round}"
    if mark.position is not None:
        attrs.append(f'data-pos="{mark.position}"')
        title += f", drafted position {mark.position}"
    if mark.confidence is not None:
        attrs.append(f'data-conf="{mark.confidence:.3f}"')
        title += f", confidence {mark.confidence:.2f}"
        if mark.kind == "tok-accepted":
            style = f"background: {confidence_colour(mark.confidence)};" + style
        else:
            style = f"box-shadow: inset 0 -3px 0 {confidence_colour(mark.confidence)};" + style
    if mark.survival is not None:
        attrs.append(f'data-survival="{mark.survival:.3f}"')
    attrs.append(f'title="{html.escape(title)}"')
    attrs.append(f'style="border-radius: 3px; {style}"')
    return f"<span {' '.join(attrs)}>{html.escape(piece)}</span>"


def render_tokens(tokenizer, new_ids: list[int], stats: GenerationStats | None) -> str:
    """HTML of a reply: one `<span class="tok tok-…" data-conf=…>` per token (see [`KINDS`])."""
    marks = classify_tokens(new_ids, stats)
    emitted = [m for m in marks if m.kind != "tok-rejected"]
    pieces = iter(token_pieces(tokenizer, [m.token_id for m in emitted]))
    spans = []
    for mark in marks:
        piece = tokenizer.decode([mark.token_id]) if mark.kind == "tok-rejected" else next(pieces)
        spans.append(_span(piece, mark))
    return f'<div class="dspark-reply" style="white-space: pre-wrap; line-height: 1.7;">{"".join(spans)}</div>'


def legend_html() -> str:
    """The key to the token marks and the confidence colours."""
    stops = ", ".join(confidence_colour(c / 4) for c in range(5))
    items = []
    for kind, (text, style) in KINDS.items():
        if kind == "tok-accepted":
            style = f"background: {confidence_colour(0.8)};"
        items.append(
            f'<div><span class="tok {kind}" style="padding: 0 4px; border-radius: 3px; {style}">tok</span> '
            f"{html.escape(text)}</div>"
        )
    scale = (
        '<div><span style="margin-right: 0.4em;">confidence 0</span><span style="display: inline-block; '
        f'width: 140px; height: 0.9em; vertical-align: middle; background: linear-gradient(to right, {stops});"></span>'
        '<span style="margin-left: 0.4em;">1</span></div>'
    )
    return f'<div class="dspark-legend" style="font-size: 0.9em; line-height: 1.8;">{"".join(items)}{scale}</div>'


def render_chart(
    stats: GenerationStats | None, block_size: int, considered: int | None = None, width: int = 640, height: int = 240
) -> str:
    """Inline SVG: per round, the verified length (bars) against γ (dashed line) and the accepted count (dots).

    Args:
        stats ([`GenerationStats`], *optional*): the rounds so far (`None`: an empty chart).
        block_size (`int`): γ, the tokens the draft proposes per round.
        considered (`int`, *optional*): the demo's γ control when the fixed policy verifies fewer tokens than
            the block.

    The numbers are also attributes (`data-verified`, `data-accepted` on the `<svg>` and on every bar), so a
    test can read what is drawn.
    """
    rounds = list(stats.rounds) if stats is not None else []
    verified = [r.verified for r in rounds]
    accepted = [r.accepted for r in rounds]
    left, right, top, bottom = 36, 12, 30, 34
    plot_w, plot_h = width - left - right, height - top - bottom
    y_max = max([block_size, *verified, 1])

    def y(v: float) -> float:
        return top + plot_h * (1 - v / y_max)

    slot = plot_w / max(len(rounds), 1)
    bar_w = max(slot * 0.7, 1.0)
    parts = [
        f'<svg class="dspark-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" data-gamma="{block_size}" data-considered="{considered or block_size}" '
        f'data-rounds="{len(rounds)}" data-verified="{",".join(map(str, verified))}" '
        f'data-accepted="{",".join(map(str, accepted))}" font-family="sans-serif" font-size="11">',
        f'<text x="{left}" y="16" font-size="13" fill="#111827">Per round: drafted tokens sent to verification '
        "(scheduled length) and accepted</text>",
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#d1d5db"/>',
    ]
    for v in range(0, y_max + 1, max(1, y_max // 4)):
        parts.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end" fill="#4b5563">{v}</text>')
    for i, (ver, acc) in enumerate(zip(verified, accepted)):
        x = left + i * slot
        parts.append(
            f'<rect class="bar-verified" data-round="{i + 1}" data-verified="{ver}" data-accepted="{acc}" '
            f'x="{x + (slot - bar_w) / 2:.1f}" y="{y(ver):.1f}" width="{bar_w:.1f}" height="{plot_h * ver / y_max:.1f}" '
            f'fill="#93c5fd"><title>round {i + 1}: verified {ver} of γ={block_size}, accepted {acc}</title></rect>'
            f'<circle class="dot-accepted" cx="{x + slot / 2:.1f}" cy="{y(acc):.1f}" r="{min(3.5, slot / 3 + 1):.1f}" '
            'fill="#15803d"/>'
        )
    lines = [(block_size, "line-gamma", "5 4", "γ (drafted per round)")]
    if considered is not None and considered < block_size:
        lines.append((considered, "line-considered", "2 3", "γ control (fixed:N)"))
    for value, cls, dash, _ in lines:
        parts.append(
            f'<line class="{cls}" x1="{left}" x2="{left + plot_w}" y1="{y(value):.1f}" y2="{y(value):.1f}" '
            f'stroke="#dc2626" stroke-dasharray="{dash}"/>'
        )
    if not rounds:
        parts.append(
            f'<text x="{left + plot_w / 2}" y="{top + plot_h / 2}" text-anchor="middle" fill="#6b7280">'
            "no speculative rounds yet</text>"
        )
    ly = height - 8
    parts.append(
        f'<text x="{left}" y="{ly}" fill="#374151">round →</text>'
        f'<rect x="{left + 60}" y="{ly - 9}" width="12" height="10" fill="#93c5fd"/>'
        f'<text x="{left + 76}" y="{ly}" fill="#374151">verified</text>'
        f'<circle cx="{left + 134}" cy="{ly - 4}" r="3.5" fill="#15803d"/>'
        f'<text x="{left + 142}" y="{ly}" fill="#374151">accepted</text>'
    )
    x = left + 210
    for _, _, dash, text in lines:
        parts.append(
            f'<line x1="{x}" x2="{x + 22}" y1="{ly - 4}" y2="{ly - 4}" stroke="#dc2626" stroke-dasharray="{dash}"/>'
            f'<text x="{x + 26}" y="{ly}" fill="#374151">{html.escape(text)}</text>'
        )
        x += 160
    parts.append("</svg>")
    return "".join(parts)


def render_stats(progress: Progress | None, message: str | None = None) -> str:
    """The live statistics panel (HTML); `data-phase` tells a test when the request has finished."""
    if progress is None:
        body = html.escape(message or "Send a message to start.")
        return f'<div class="dspark-stats" data-phase="idle">{body}</div>'
    stats = progress.stats
    tau = f"{stats.tau:.2f}" if stats is not None and stats.rounds else "–"
    rounds = stats.num_rounds if stats is not None else 0
    rows = [
        f"<b>τ</b> (tokens per target forward: accepted drafts + 1) = <b class='stat-tau'>{tau}</b> over {rounds} rounds",
        f"<b>speculative</b>: {len(progress.new_ids)} tokens, "
        f"<b class='stat-tps'>{progress.tokens_per_second:.1f}</b> tokens/s",
        f"policy <code>{html.escape(progress.policy)}</code>",
    ]
    if progress.phase == "baseline":
        rows.append("measuring plain <code>generate()</code> on the same prompt…")
    if progress.phase == "done" and progress.plain_seconds:
        plain_tps = progress.plain_new_tokens / progress.plain_seconds
        rows.append(
            f"<b>plain generate()</b>: {plain_tps:.1f} tokens/s → <b>speedup</b> "
            f"<b class='stat-speedup'>{progress.speedup:.2f}×</b> (measured: plain <code>generate()</code> on the "
            "same prompt and settings, run right after; one run each, not a benchmark)"
        )
        if progress.identical is not None:
            rows.append(f"greedy output identical to plain generate(): <b>{'yes' if progress.identical else 'NO'}</b>")
    if message:
        rows.append(html.escape(message))
    return f'<div class="dspark-stats" data-phase="{progress.phase}">{"<br>".join(rows)}</div>'
