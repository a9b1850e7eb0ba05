"""The Gradio demo (`dspark demo`): chat with the target while a DSpark draft speculates, and watch the scheduler.

Each reply is shown token by token, coloured by the draft's calibrated confidence and marked as an accepted
draft, a draft the target rejected, or a token the target produced itself (the bonus token of a round, or
the prefill's first token). A per-round chart shows how many drafted tokens the verification policy sent to
the target against the γ it could have sent, and how many were accepted. τ and tokens/s update live; the
speedup is measured against plain `generate()` on the same prompt, run right after the speculative reply.

Everything except [`build_app`] is plain Python on token ids and [`GenerationStats`], so it is tested
without a browser; [`build_app`] is the only place that imports gradio (the `demo` extra).
"""

from __future__ import annotations

import dataclasses
import html
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers.generation.streamers import BaseStreamer

from ._transformers import model_name
from .decoding.stats import GenerationStats
from .scheduling.policies import ScheduleContext, VerificationPolicy, resolve_policy

#: UI label → policy name understood by [`resolve_policy`].
POLICIES = {
    "fixed": "fixed",
    "threshold": "threshold",
    "hardware-aware": "hardware_aware",
    "hardware-aware lagged": "hardware_aware_lagged",
}

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
class Caps:
    """Safety limits of a running demo.

    Args:
        max_prompt_tokens (`int`, *optional*, defaults to 1024): longest templated conversation accepted.
        max_new_tokens (`int`, *optional*, defaults to 256): upper bound of the "max new tokens" control.
    """

    max_prompt_tokens: int = 1024
    max_new_tokens: int = 256

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < 1 or self.max_new_tokens < 1:
            raise ValueError(
                f"Caps must be >= 1, got max_prompt_tokens={self.max_prompt_tokens}, "
                f"max_new_tokens={self.max_new_tokens}."
            )


@dataclass
class Settings:
    """The controls of one request.

    Args:
        temperature (`float`): 0 means greedy.
        max_new_tokens (`int`): tokens to generate at most.
        policy (`str`): a key of [`POLICIES`].
        gamma (`int`): drafted tokens the policy may consider (at most the draft's block size); for the
            fixed policy, the number verified every round.
        threshold (`float`): survival threshold of the threshold policy.
        background_tokens (`int`): tokens of other requests assumed to share each verification forward
            (hardware-aware policies).
        seed (`int`, *optional*, defaults to 0): torch seed set before each generation (sampling).
    """

    temperature: float = 0.0
    max_new_tokens: int = 64
    policy: str = "hardware-aware"
    gamma: int = 7
    threshold: float = 0.3
    background_tokens: int = 0
    seed: int = 0


def policy_string(settings: Settings) -> str:
    """The policy string of the controls: `fixed:N`, `threshold:T`, `hardware_aware:BG` or `hardware_aware_lagged:BG`."""
    if settings.policy not in POLICIES:
        raise ValueError(f"Unknown policy {settings.policy!r}; choose one of {', '.join(POLICIES)}.")
    name = POLICIES[settings.policy]
    if name == "fixed":
        return f"fixed:{int(settings.gamma)}"
    if name == "threshold":
        return f"threshold:{float(settings.threshold):g}"
    return f"{name}:{int(settings.background_tokens)}"


@dataclass
class FirstTokensPolicy(VerificationPolicy):
    """Runs `inner` on the first `gamma` drafted tokens only (the demo's γ control).

    Cutting the block at a length fixed before drafting keeps every policy's prefix property, so this stays
    lossless. The lagged policy's history is cut the same way.
    """

    inner: VerificationPolicy
    gamma: int

    def __post_init__(self) -> None:
        self.name = self.inner.name
        self.needs_confidence = self.inner.needs_confidence
        self.needs_sps = self.inner.needs_sps
        self.sps = getattr(self.inner, "sps", None)

    def choose_lengths(self, survival: torch.Tensor, context: ScheduleContext | None = None) -> torch.Tensor:
        if context is not None and context.previous_survival is not None:
            context = dataclasses.replace(context, previous_survival=context.previous_survival[..., : self.gamma])
        return self.inner.choose_lengths(survival[..., : self.gamma], context)


def make_policy(settings: Settings, block_size: int, has_confidence: bool = True) -> VerificationPolicy | str:
    """The policy to pass as `generate(dspark_policy=...)`: the controls' string, cut to γ drafted tokens."""
    spec = policy_string(settings)
    gamma = int(settings.gamma)
    if POLICIES[settings.policy] == "fixed" or gamma >= block_size:
        return spec
    return FirstTokensPolicy(inner=resolve_policy(spec, has_confidence=has_confidence), gamma=gamma)


def check_request(settings: Settings, prompt_tokens: int, caps: Caps, block_size: int) -> str | None:
    """`None` if the request is within the caps, else a message saying what was asked and what is allowed."""
    if prompt_tokens > caps.max_prompt_tokens:
        return (
            f"The conversation is {prompt_tokens} tokens long; this demo accepts at most {caps.max_prompt_tokens} "
            "prompt tokens. Clear the chat or send a shorter message."
        )
    if not 1 <= settings.max_new_tokens <= caps.max_new_tokens:
        return f"max new tokens must be between 1 and {caps.max_new_tokens}, got {settings.max_new_tokens}."
    if not 1 <= settings.gamma <= block_size:
        return f"γ must be between 1 and the draft's block size {block_size}, got {settings.gamma}."
    if settings.temperature < 0:
        return f"temperature must be >= 0 (0 = greedy), got {settings.temperature}."
    if not 0.0 <= settings.threshold <= 1.0:
        return f"threshold must be between 0 and 1, got {settings.threshold}."
    if settings.background_tokens < 0:
        return f"background load must be >= 0 tokens, got {settings.background_tokens}."
    return None


# ---------------------------------------------------------------------------------------------- rendering
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
        considered (`int`, *optional*): the demo's γ control when it limits the policy to fewer tokens.

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
        lines.append((considered, "line-considered", "2 3", "γ considered"))
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


# ---------------------------------------------------------------------------------------------- generation
@dataclass
class Progress:
    """A snapshot of one request, yielded while it runs.

    `phase` is `"speculative"` while streaming, `"baseline"` while plain `generate()` runs for the speedup,
    then `"done"`.
    """

    phase: str
    new_ids: list[int]
    stats: GenerationStats | None
    elapsed: float
    policy: str
    plain_seconds: float | None = None
    plain_new_tokens: int | None = None
    identical: bool | None = None

    @property
    def tokens_per_second(self) -> float:
        return len(self.new_ids) / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def speedup(self) -> float | None:
        if not self.plain_seconds or not self.plain_new_tokens or not self.elapsed:
            return None
        return self.tokens_per_second / (self.plain_new_tokens / self.plain_seconds)


class _TokenCollector(BaseStreamer):
    """Collects the token ids `generate()` streams (the first `put` is the prompt and is skipped)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.ids.extend(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


def stream_reply(
    target, draft, inputs: dict, settings: Settings, pad_token_id: int | None = None, poll_seconds: float = 0.2
) -> Iterator[Progress]:
    """Speculative generation in a thread, yielding [`Progress`] as tokens arrive; then plain `generate()`.

    The speculative run's time covers the `generate()` call only (measured inside its thread); the baseline
    runs afterwards on the same inputs, settings and seed, so the speedup is a side-by-side measurement.
    """
    policy = make_policy(settings, draft.config.block_size, draft.confidence_head is not None)
    sample = settings.temperature > 0
    kwargs = dict(
        **inputs,
        max_new_tokens=int(settings.max_new_tokens),
        do_sample=sample,
        temperature=settings.temperature if sample else None,
        top_p=None,
        top_k=None,
        pad_token_id=pad_token_id,
    )
    label = policy_string(settings) + (
        f" (first γ={settings.gamma} drafted tokens)" if not isinstance(policy, str) else ""
    )
    collector = _TokenCollector()
    box: dict = {}
    previous_stats = getattr(draft, "last_generation_stats", None)

    def run() -> None:
        try:
            torch.manual_seed(settings.seed)
            start = time.perf_counter()
            with torch.no_grad():
                box["out"] = target.generate(**kwargs, assistant_model=draft, dspark_policy=policy, streamer=collector)
            box["seconds"] = time.perf_counter() - start
        except BaseException as err:  # re-raised in the caller's thread
            box["error"] = err

    def current_stats() -> GenerationStats | None:
        stats = getattr(draft, "last_generation_stats", None)
        return None if stats is previous_stats else stats

    worker = threading.Thread(target=run, name="dspark-demo-generate", daemon=True)
    start = time.perf_counter()
    worker.start()
    while worker.is_alive():
        worker.join(poll_seconds)
        yield Progress("speculative", list(collector.ids), current_stats(), time.perf_counter() - start, label)
    if "error" in box:
        raise box["error"]
    prompt_len = inputs["input_ids"].shape[1]
    spec_ids = box["out"][0, prompt_len:].tolist()
    done = Progress("baseline", spec_ids, current_stats(), box["seconds"], label)
    yield done

    torch.manual_seed(settings.seed)
    start = time.perf_counter()
    with torch.no_grad():
        plain = target.generate(**kwargs)
    yield dataclasses.replace(
        done,
        phase="done",
        plain_seconds=time.perf_counter() - start,
        plain_new_tokens=plain.shape[1] - prompt_len,
        identical=torch.equal(plain, box["out"]) if not sample else None,
    )


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


# ---------------------------------------------------------------------------------------------- the app
def _import_gradio():
    try:
        import gradio as gr
    except ImportError as err:
        raise ImportError(
            "The demo needs gradio, which is an optional extra: pip install -e '.[demo]' in your dspark-hf clone "
            "(or pip install 'gradio>=5.0')."
        ) from err
    return gr


def make_respond(target, tokenizer, draft, caps: Caps):
    """The chat handler of [`build_app`]: a generator of `(chat, history, chart, stats, textbox)` updates.

    `chat` holds the rendered HTML (gradio's messages format), `history` the plain-text conversation that is
    sent to the chat template. Requests over the caps are refused with a message before anything runs.
    """
    gr = _import_gradio()
    block_size = draft.config.block_size
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def respond(message, chat, history, temperature, max_new_tokens, policy, gamma, threshold, background):
        settings = Settings(
            temperature=float(temperature),
            max_new_tokens=int(max_new_tokens),
            policy=policy,
            gamma=int(gamma),
            threshold=float(threshold),
            background_tokens=int(background),
        )
        chat, history = list(chat or []), list(history or [])
        message = (message or "").strip()
        if not message:
            yield chat, history, gr.update(), render_stats(None, "Type a message first."), message
            return
        conversation = [*history, {"role": "user", "content": message}]
        inputs = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        problem = check_request(settings, inputs["input_ids"].shape[1], caps, block_size)
        if problem is not None:
            gr.Warning(problem)
            yield chat, history, gr.update(), render_stats(None, problem), message
            return
        # The chat box renders HTML unsanitised (its sanitiser drops the data-* attributes of the token
        # spans), so everything put into it is escaped here: the user's text and every token piece.
        chat.append({"role": "user", "content": f'<div style="white-space: pre-wrap;">{html.escape(message)}</div>'})
        chat.append({"role": "assistant", "content": ""})
        considered = settings.gamma if POLICIES[settings.policy] != "fixed" else None
        progress = None
        for progress in stream_reply(target, draft, dict(inputs), settings, pad_token_id):
            chat[-1] = {"role": "assistant", "content": render_tokens(tokenizer, progress.new_ids, progress.stats)}
            chart = render_chart(progress.stats, block_size, considered)
            if progress.phase == "done":
                reply = tokenizer.decode(progress.new_ids, skip_special_tokens=True)
                history = [*conversation, {"role": "assistant", "content": reply}]
            yield chat, history, chart, render_stats(progress), ""

    return respond


def build_app(target, tokenizer, draft, *, fresh: bool = False, caps: Caps | None = None, title: str | None = None):
    """The demo as a `gr.Blocks` (queued: one generation at a time), ready for `.launch()`.

    Args:
        target (`PreTrainedModel`): the causal LM to chat with.
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer, with a chat template.
        draft ([`DSparkDraftModel`]): the draft, bound to `target`.
        fresh (`bool`, *optional*, defaults to `False`): the draft is untrained; a note says so on the page.
        caps ([`Caps`], *optional*): prompt and generation limits (defaults: 1024 prompt tokens, 256 new).
        title (`str`, *optional*): page heading.
    """
    gr = _import_gradio()
    caps = caps or Caps()
    block_size = draft.config.block_size
    name = model_name(target)
    respond = make_respond(target, tokenizer, draft, caps)

    with gr.Blocks(title="dspark demo", analytics_enabled=False) as app:
        gr.Markdown(
            f"## {html.escape(title or 'DSpark speculative decoding')}\nTarget `{name}`, draft block size γ = {block_size}."
        )
        if fresh:
            gr.Markdown(
                "**Note:** this draft is fresh (untrained): almost every drafted token is rejected, τ stays near 1 "
                "and speculative decoding is slower than plain `generate()`. The reply is still exactly the "
                "target's. Pass `--draft` to use a trained draft.",
                elem_id="dspark-fresh-note",
            )
        history = gr.State([])
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(
                    label="chat",
                    elem_id="dspark-chat",
                    height=380,
                    sanitize_html=False,  # safe: make_respond escapes everything it puts in the chat
                    render_markdown=False,  # token pieces are text, not markdown
                    **_chatbot_kwargs(gr),
                )
                gr.HTML(legend_html(), elem_id="dspark-legend")
                with gr.Row():
                    box = gr.Textbox(placeholder="Message", show_label=False, scale=5, elem_id="dspark-input")
                    send = gr.Button("Send", variant="primary", scale=1, elem_id="dspark-send")
                    clear = gr.Button("Clear", scale=1, elem_id="dspark-clear")
                stats_html = gr.HTML(render_stats(None), elem_id="dspark-stats")
                chart = gr.HTML(render_chart(None, block_size), elem_id="dspark-chart")
            with gr.Column(scale=2):
                policy = gr.Radio(
                    list(POLICIES), value="hardware-aware", label="verification policy", elem_id="dspark-policy"
                )
                gamma = gr.Slider(1, block_size, value=block_size, step=1, label="γ: drafted tokens considered (fixed: verified every round)", elem_id="dspark-gamma")  # fmt: skip
                threshold = gr.Slider(0.0, 1.0, value=0.3, step=0.01, label="threshold (survival ≥ T)", elem_id="dspark-threshold")  # fmt: skip
                background = gr.Slider(0, 8192, value=0, step=1, label="background load: tokens of other requests in each verification forward (hardware-aware)", elem_id="dspark-background")  # fmt: skip
                temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="temperature (0 = greedy)", elem_id="dspark-temperature")  # fmt: skip
                max_new = gr.Slider(1, caps.max_new_tokens, value=min(64, caps.max_new_tokens), step=1, label=f"max new tokens (cap {caps.max_new_tokens})", elem_id="dspark-max-new-tokens")  # fmt: skip
                gr.Markdown(
                    f"Prompts are limited to {caps.max_prompt_tokens} tokens (the whole conversation). One "
                    "generation runs at a time; others wait in the queue."
                )
        inputs = [box, chatbot, history, temperature, max_new, policy, gamma, threshold, background]
        outputs = [chatbot, history, chart, stats_html, box]
        send.click(respond, inputs, outputs)
        box.submit(respond, inputs, outputs)
        clear.click(
            lambda: ([], [], render_chart(None, block_size), render_stats(None)),
            None,
            [chatbot, history, chart, stats_html],
        )
    app.queue(default_concurrency_limit=1)
    return app


def _chatbot_kwargs(gr) -> dict:
    # gradio 5 defaults the Chatbot to (user, bot) tuples and warns; 6 only knows the messages format.
    import inspect

    return {"type": "messages"} if "type" in inspect.signature(gr.Chatbot.__init__).parameters else {}
