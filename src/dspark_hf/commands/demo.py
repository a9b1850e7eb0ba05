"""`dspark demo`: the Gradio app (see `dspark_hf.demo`), on 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import argparse

from ._common import UserError, model_source
from .arguments import add_model_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--draft",
        default=None,
        help="draft path, Hub id or shipped draft name (default: the shipped draft, else fresh)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=7860, help="port to serve on (default: 7860)")
    parser.add_argument(
        "--share", action="store_true", help="also open a public gradio.live link (off by default: nothing public)"
    )
    parser.add_argument("--max-prompt-tokens", type=int, default=1024, help="longest conversation accepted, in tokens")
    parser.add_argument("--max-new-tokens-cap", type=int, default=256, help="upper limit of the max-new-tokens control")
    add_model_arguments(parser, names=("target", "threads"))


def main(args: argparse.Namespace) -> int:
    import torch

    from dspark_hf._threads import run_in_fresh_thread
    from dspark_hf.default_model import SHIPPED_DRAFTS, load_draft, load_target
    from dspark_hf.demo import Caps, build_app, import_gradio

    import_gradio()  # fail before loading models if the extra is missing
    try:
        caps = Caps(max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens_cap)
    except ValueError as err:
        raise UserError(str(err)) from err
    if args.threads:
        torch.set_num_threads(args.threads)
    model_source(args.target, "--target")
    model_source(args.draft, "--draft", names=(*SHIPPED_DRAFTS, "fresh"))

    def load():
        target, tokenizer = load_target(args.target)
        return target, tokenizer, *load_draft(target, args.draft)

    # Replies are decoded in per-reply worker threads; loading on the main thread would leave it a second OpenMP
    # pool for the whole session and slow every forward of every reply (`dspark_hf._threads`, docs/serving.md)
    target, tokenizer, draft, fresh = run_in_fresh_thread(load)
    app = build_app(target, tokenizer, draft, fresh=fresh, caps=caps)
    # Gradio's own banner tells Python users to "set share=True in launch()"; a CLI user needs --share instead
    print(
        f"dspark demo: serving on http://{args.host}:{args.port}"
        + (" and a public gradio.live link" if args.share else " (add --share for a public gradio.live link)"),
        flush=True,
    )
    app.launch(server_name=args.host, server_port=args.port, share=args.share, quiet=not args.share)
    return 0
