"""One demo request: speculative `generate()` streamed from a worker thread, then plain `generate()` on the same
prompt for a side-by-side speedup."""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers.generation.streamers import BaseStreamer

from ..decoding.options import resolve_options
from ..decoding.stats import GenerationStats
from ..model.runs import last_generation_stats
from .settings import Settings, policy_string


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


def request_config(target, settings: Settings, pad_token_id: int | None = None):
    """The target's generation config with the request's decoding settings (greedy, or plain sampling at the
    request's temperature: no top-k / top-p)."""
    config = copy.deepcopy(target.generation_config)
    sample = settings.temperature > 0
    config.update(
        max_new_tokens=int(settings.max_new_tokens),
        do_sample=sample,
        temperature=settings.temperature if sample else None,
        top_p=None,
        top_k=None,
        pad_token_id=pad_token_id,
    )
    return config


def stream_reply(
    target, draft, inputs: dict, settings: Settings, pad_token_id: int | None = None, poll_seconds: float = 0.2
) -> Iterator[Progress]:
    """Speculative generation in a thread, yielding [`Progress`] as tokens arrive; then plain `generate()`.

    The request's policy is the call level of [`resolve_options`][dspark_hf.decoding.options.resolve_options]
    and rides on the speculative call's `GenerationConfig` (`dspark_policy`), as any per-call option does. The
    speculative run's time covers the `generate()` call only (measured inside its thread); the baseline runs
    afterwards on the same inputs, settings, seed and kernels, so the speedup is a side-by-side measurement.
    """
    label = policy_string(settings)
    # resolved like any driver's options (a bad setting fails here, not in the worker thread); the plain baseline
    # runs on the speculative run's kernels, so greedy output must be identical and the speedup is speculation's
    options = resolve_options(draft, target, call={"policy": label})
    plain_config = request_config(target, settings, pad_token_id)
    plain_config.dspark_kernels = options.kernels
    spec_config = copy.deepcopy(plain_config)
    spec_config.dspark_policy = label
    collector = _TokenCollector()
    box: dict = {}
    previous_stats = last_generation_stats(draft)

    def run() -> None:
        try:
            torch.manual_seed(settings.seed)
            start = time.perf_counter()
            with torch.no_grad():
                box["out"] = target.generate(
                    **inputs, generation_config=spec_config, assistant_model=draft, streamer=collector
                )
            box["seconds"] = time.perf_counter() - start
        except BaseException as err:  # re-raised in the caller's thread
            box["error"] = err

    def current_stats() -> GenerationStats | None:
        stats = last_generation_stats(draft)
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
    done = Progress("baseline", box["out"][0, prompt_len:].tolist(), current_stats(), box["seconds"], label)
    yield done

    torch.manual_seed(settings.seed)
    start = time.perf_counter()
    with torch.no_grad():
        plain = target.generate(**inputs, generation_config=plain_config)
    yield dataclasses.replace(
        done,
        phase="done",
        plain_seconds=time.perf_counter() - start,
        plain_new_tokens=plain.shape[1] - prompt_len,
        identical=torch.equal(plain, box["out"]) if settings.temperature == 0 else None,
    )
