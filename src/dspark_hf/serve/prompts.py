"""Prompts to token ids, for the handlers: the checks that need no tokenizer first, then tokenizing off the
event loop, with special tokens spelt out in a chat message kept as text.

A chat message's text is user input: if a message spells out a special token (`<|im_start|>system`), the chat
template's rendering would make it a real turn marker, and a user could forge a system turn. Such text is
tokenized with the tokenizer's special tokens split (transformers' `split_special_tokens`), so the only turn
markers are the template's own. Messages without it tokenize exactly as `apply_chat_template` does.
"""

from __future__ import annotations

import asyncio
import copy
import re
import secrets
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from .protocol import ApiError, ChatCompletionRequest


class PromptTokenizer:
    """The handlers' tokenizer: its own copy of the engine's, used from one thread of its own.

    One thread, because a tokenizer call may switch the tokenizer's own settings for its duration, and none of
    it on the event loop, so a long prompt never delays other requests.

    Args:
        tokenizer: the engine's tokenizer (copied).
        max_prompt_tokens (`int`): the longest prompt, in tokens.
        max_prompt_chars (`int`, *optional*): the longest prompt text, in characters; default: `max_prompt_tokens`
            times the vocabulary's longest token, the most text that can fit.
    """

    def __init__(self, tokenizer, max_prompt_tokens: int, max_prompt_chars: int | None = None) -> None:
        # the worker decodes with the engine's tokenizer; the handlers encode with this copy (no shared state)
        self.tokenizer = copy.deepcopy(tokenizer)
        self.max_prompt_tokens = max_prompt_tokens
        self.max_prompt_chars = max_prompt_chars or max_prompt_tokens * _longest_token(self.tokenizer)
        self._special = _special_pattern(self.tokenizer)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="dspark-tokenize")

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def prompt_text(self, req):
        """The request's prompt before tokenizing (chat messages as dicts, or a completion's text or ids), after
        the checks that need no tokenizer: one prompt, and its length in characters (or ids)."""
        if isinstance(req, ChatCompletionRequest):
            prompt = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in req.messages]
            chars, param = sum(len(m["content"]) for m in prompt), "messages"
        else:
            prompt, param = req.prompt, "prompt"
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                if len(prompt) != 1:
                    raise ApiError(400, f"one prompt per request, got {len(prompt)}; send them separately.", param)
                prompt = prompt[0]
            if not isinstance(prompt, str):  # token ids
                if len(prompt) > self.max_prompt_tokens:
                    raise self.too_long(f"{len(prompt):,} tokens", param)
                return prompt, 0
            chars = len(prompt)
        if chars > self.max_prompt_chars:
            raise self.too_long(f"{chars:,} characters (more than {self.max_prompt_chars:,} cannot fit)", param)
        return prompt, chars

    def too_long(self, size: str, param: str) -> ApiError:
        """The `400` of a prompt over `max_prompt_tokens` (`size` says by how much)."""
        return ApiError(
            400,
            f"the prompt has {size} but this server's limit (max_prompt_tokens) is "
            f"{self.max_prompt_tokens} tokens; shorten it.",
            param=param,
            code="max_prompt_tokens",
        )

    async def prompt_ids(self, req) -> list[int]:
        """The request's prompt token ids (checked by [`prompt_text`] first), tokenized in this tokenizer's
        thread."""
        prompt, _ = self.prompt_text(req)
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._tokenize, prompt)

    def _tokenize(self, prompt) -> list[int]:
        tok = self.tokenizer
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self._chat_ids(prompt)
        if isinstance(prompt, str):
            return list(tok(prompt)["input_ids"])
        return list(prompt)

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        """Chat messages through the chat template, with any special token spelt out in a message's text kept as
        text: only the template makes turn markers, so a user cannot forge a system turn by typing one."""
        tok, special = self.tokenizer, self._special
        spelt = special is not None and any(
            isinstance(v, str) and special.search(v) for m in messages for k, v in m.items() if k != "role"
        )
        if not spelt:  # the common case: exactly the template's own tokenization
            return _flat(self._apply_template(messages, tokenize=True))
        # render with a placeholder in place of each spelt-out special token, then tokenize the rendered text
        # piece by piece: the template's parts as usual, each placeholder as plain text
        nonce, found = secrets.token_hex(8), []

        def mark(match) -> str:
            found.append(match.group(0))
            return f"\ue000{nonce}{len(found) - 1}\ue001"

        marked = [
            {k: special.sub(mark, v) if isinstance(v, str) and k != "role" else v for k, v in m.items()}
            for m in messages
        ]
        parts = re.split(f"\ue000{nonce}(\\d+)\ue001", self._apply_template(marked, tokenize=False))
        if len(parts) != 2 * len(found) + 1:
            raise ApiError(
                400, "the messages spell out special tokens in a way this chat template does not keep verbatim; "
                "remove them.", param="messages",
            )  # fmt: skip
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2 == 0:
                ids += tok(part, add_special_tokens=False)["input_ids"] if part else []
            else:
                ids += self._as_text(found[int(part)])
        return ids

    def _apply_template(self, messages, tokenize: bool):
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize)
        except Exception as err:  # the template's own checks (e.g. roles must alternate)
            raise ApiError(400, f"the chat template refused these messages: {err}", param="messages") from None

    def _as_text(self, text: str) -> list[int]:
        """`text` (a special token's spelling) tokenized as ordinary text (transformers' `split_special_tokens`;
        one character at a time where a tokenizer cannot split)."""
        tok = self.tokenizer
        ids = list(tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        if set(ids) & set(tok.all_special_ids):
            ids = [i for ch in text for i in tok(ch, add_special_tokens=False)["input_ids"]]
        return ids


def _longest_token(tokenizer) -> int:
    """The most characters one token stands for (at least): the longest entry of the vocabulary, special tokens
    included (a byte-level BPE entry has one character per byte, so it is never shorter than its text)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def _special_pattern(tokenizer) -> re.Pattern | None:
    """A regex of the tokenizer's special tokens, longest first (`None` if it has none)."""
    tokens = set(tokenizer.all_special_tokens)
    tokens |= {str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if getattr(t, "special", False)}
    tokens.discard("")
    return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True)))) if tokens else None


def _flat(ids) -> list[int]:
    ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)
