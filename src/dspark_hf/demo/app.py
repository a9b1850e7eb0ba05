"""The Gradio app of `dspark demo`: the only module that imports gradio (the `demo` extra)."""

from __future__ import annotations

import html

from .._transformers import model_name
from .render import legend_html, render_chart, render_stats, render_tokens
from .reply import stream_reply
from .settings import POLICIES, Caps, Settings, check_request


def import_gradio():
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
    gr = import_gradio()
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
        considered = settings.gamma if POLICIES[settings.policy] == "fixed" else None
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
    gr = import_gradio()
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
                gamma = gr.Slider(1, block_size, value=block_size, step=1, label="γ: drafted tokens verified every round (fixed policy)", elem_id="dspark-gamma")  # fmt: skip
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
