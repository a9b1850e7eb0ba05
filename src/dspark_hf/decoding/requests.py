"""The requests of [`DSparkEngine`]: what a caller submits ([`SamplingParams`]) and gets back ([`RequestOutput`],
[`StreamEvent`]), the engine's own state of one request, and the request intake and output text helpers."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from .caches import SlotRow
from .prefix_cache import PrefixProgress
from .speculator import DraftRow
from .stats import GenerationStats
from .target_forward import RequestSampler


@dataclass
class SamplingParams:
    """How one request is decoded.

    Args:
        max_new_tokens (`int`, *optional*, defaults to 64): tokens to generate at most.
        do_sample (`bool`, *optional*, defaults to `False`): sample (exact rejection sampling) or greedy.
        temperature (`float`, *optional*, defaults to 1.0): sampling temperature (ignored when greedy).
        top_k (`int`, *optional*): keep the `top_k` most likely tokens (sampling only).
        top_p (`float`, *optional*): nucleus sampling mass (sampling only).
        repetition_penalty (`float`, *optional*): as in transformers (greedy and sampling).
        eos_token_id (`int` or `list[int]`, *optional*): stop tokens; defaults to the target's
            `generation_config.eos_token_id`.
        ignore_eos (`bool`, *optional*, defaults to `False`): never stop at an EOS token.
        seed (`int`, *optional*): seed of the request's random generator (default: drawn from torch's global
            generator when the request is added, so `torch.manual_seed` makes runs reproducible).
    """

    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    eos_token_id: int | list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None


@dataclass
class RequestOutput:
    """The result of one request.

    Args:
        request_id (`int`): the id [`DSparkEngine.add_request`] returned.
        prompt_token_ids (`list[int]`): the tokenized prompt (empty if it could not be built).
        token_ids (`list[int]`): generated tokens (the EOS token included when generation stopped there).
        text (`str`, *optional*): `token_ids` decoded (with the engine's tokenizer, special tokens skipped).
        finish_reason (`str`): `"eos"`, `"length"` (`max_new_tokens`), `"context"` (the target's context
            is full) or `"error"`.
        error (`str`, *optional*): why the request was refused (the other requests are not affected).
        stats ([`GenerationStats`], *optional*): the request's speculative rounds (τ, lengths, acceptance).
        times (`dict[str, float]`): `perf_counter` stamps `added`, `admitted`, `first_token`, `finished`.
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None = None
    finish_reason: str = "length"
    error: str | None = None
    stats: GenerationStats | None = None
    times: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """`bool`: whether the request ran (no error)."""
        return self.error is None

    def summary(self) -> dict:
        """Per-request statistics: τ, mean verification length, acceptance per position, tokens/s, latencies."""
        t = self.times
        out = {"request_id": self.request_id, "new_tokens": len(self.token_ids), "finish_reason": self.finish_reason}
        if self.stats is not None:
            out.update(
                rounds=self.stats.num_rounds,
                tau=self.stats.tau,
                mean_verification_length=self.stats.mean_verified,
                acceptance_by_position=self.stats.acceptance_by_position,
            )
        if "finished" in t and "admitted" in t:
            busy = t["finished"] - t["admitted"]
            out.update(
                queue_seconds=t["admitted"] - t["added"],
                time_to_first_token=t.get("first_token", t["finished"]) - t["added"],
                latency_seconds=t["finished"] - t["added"],
                tokens_per_second=len(self.token_ids) / busy if busy > 0 else math.nan,
            )
        return out


@dataclass
class StreamEvent:
    """Tokens accepted for one request in one round (what [`DSparkEngine.stream`] yields).

    Args:
        request_id (`int`): the request.
        token_ids (`list[int]`): newly accepted tokens (may be empty for a finished, failed request).
        text (`str`, *optional*): their text (the decoded difference), with a tokenizer.
        finished (`bool`): whether the request is done; then `output` holds its [`RequestOutput`].
        output ([`RequestOutput`], *optional*): the final result, on the last event of a request.
    """

    request_id: int
    token_ids: list[int]
    text: str | None = None
    finished: bool = False
    output: RequestOutput | None = None


@dataclass
class Request:
    """Engine-side state of one request (not part of the public API)."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    sampler: RequestSampler
    eos: set[int]
    max_new: int
    reserve: int
    times: dict[str, float]
    stats: GenerationStats
    tokens: list[int] = field(default_factory=list)
    kv: SlotRow | None = None  # the request's slot in the engine's target KV (and `dkv` in the draft's)
    dkv: SlotRow | None = None
    prefilled: int = 0  # prompt tokens in the target's KV so far: the request decodes once all of them are
    text_done: int = 0  # tokens whose text has been streamed (incremental detokenisation)
    text_prefix: int = 0  # where the decoded window starts (the previous call's `text_done`)
    text_len: int = 0  # characters streamed
    text: str | None = None  # the whole output's text, once finished
    finish_reason: str | None = None
    draft: DraftRow | None = None  # the draft side: its context's slot, pending features, lookup index
    prefix: PrefixProgress | None = None  # its place in the engine's prefix cache (`None`: not looked up yet)

    @property
    def pending_tokens(self) -> int:
        """Committed tokens whose features the draft has not ingested yet."""
        return self.draft.pending_tokens if self.draft is not None else 0


def tokenize_prompt(tokenizer, prompt) -> list[int]:
    """A prompt's token ids: token ids as given (a list, or a 1-D / `[1, T]` tensor), a string tokenized, chat
    messages rendered with the tokenizer's chat template."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1:
            raise ValueError(f"a tensor prompt must be 1-D or [1, T], got shape {tuple(prompt.shape)}.")
        return prompt.tolist()
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], Mapping)):
        if tokenizer is None:
            raise ValueError("text and chat-message prompts need a tokenizer: DSparkEngine(..., tokenizer=tok).")
        if isinstance(prompt, str):
            return list(tokenizer(prompt)["input_ids"])
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
        return list(ids[0] if ids and isinstance(ids[0], list) else ids)
    if isinstance(prompt, Iterable):
        ids = list(prompt)
        if not all(isinstance(t, int) for t in ids):
            raise TypeError("a prompt list must hold token ids (int) or chat messages (dict).")
        return ids
    raise TypeError(f"unsupported prompt type {type(prompt).__name__}: use token ids, a string or chat messages.")


def new_text(tokenizer, req: Request, final: bool) -> str:
    """The text of the tokens not yet streamed, decoding only a short window, not the whole output.

    The window starts at the tokens streamed by the previous call, so that merges across the boundary (a
    byte-level token completing a character, a tokenizer's space rules) are seen; text that ends in an
    incomplete character is held back. The last call decodes the whole output once and sends what the
    stream still lacks, so the streamed pieces always add up to `RequestOutput.text`.
    """
    decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
    if final:
        req.text = decode(req.tokens)
        new, req.text_len = req.text[req.text_len :], len(req.text)
        return new
    before = decode(req.tokens[req.text_prefix : req.text_done])
    after = decode(req.tokens[req.text_prefix :])
    if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
        return ""  # nothing complete yet: held back until a later round (or the final flush)
    new = after[len(before) :]
    req.text_prefix, req.text_done = req.text_done, len(req.tokens)
    req.text_len += len(new)
    return new


def per_prompt(sampling_params, n: int) -> list:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts; give one, or one per prompt.")
    return params


def check_params(params: SamplingParams) -> None:
    """Refuse sampling parameters transformers would refuse, naming the allowed range."""
    checks = [
        (params.max_new_tokens >= 1, "max_new_tokens must be >= 1", params.max_new_tokens),
        (params.temperature > 0, "temperature must be > 0 (use do_sample=False for greedy)", params.temperature),
        (params.top_k is None or params.top_k >= 0, "top_k must be >= 0", params.top_k),
        (params.top_p is None or 0 < params.top_p <= 1, "top_p must be in (0, 1]", params.top_p),
        (params.repetition_penalty is None or params.repetition_penalty > 0, "repetition_penalty must be > 0",
         params.repetition_penalty),
    ]  # fmt: skip
    for ok, message, value in checks:
        if not ok:
            raise ValueError(f"{message}, got {value}.")
