"""SPS profiles: how many verification forward passes per second the target manages at `B` tokens.

The hardware-aware scheduler maximises expected throughput `τ_exp · SPS(B)`, so it needs the target's real
cost curve on this device. Real curves are jagged (on a 2-core CPU SmolLM2-135M costs about the same for 2
and for 16 tokens, then jumps), so the curve is *measured*, never assumed: [`profile_sps`] times the
target's forward over `B` new tokens on top of a KV cache of realistic length, for a handful of `B`
values, in a few seconds. Profiles are cached on disk per (model, device, dtype, context bucket) and
reused (keyed by model, device, dtype, CPU thread count and a power-of-two context bucket);
[`SPSProfile`] interpolates linearly (in time per forward) between measured points.

A profile is device-specific: it is never stored inside a draft checkpoint.
"""

from __future__ import annotations

import bisect
import inspect
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .._transformers import model_name
from ..model.cpu_packing import is_packed

DEFAULT_TOKEN_COUNTS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


@dataclass
class SPSProfile:
    """Measured seconds per verification forward at several token counts `B`.

    Args:
        seconds (`dict[int, float]`): forward time in seconds per token count `B` (at least one point).
        meta (`dict`, *optional*): where it was measured (model, device, dtype, context length, date).

    Between measured points the *time* is interpolated linearly; beyond the last point it is extrapolated
    with the slope of the last two points (at least proportional growth is never assumed away).
    """

    seconds: dict[int, float]
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.seconds:
            raise ValueError("An SPSProfile needs at least one measured point {tokens: seconds}.")
        self.seconds = {int(k): float(v) for k, v in sorted(self.seconds.items(), key=lambda kv: int(kv[0]))}
        bad = {k: v for k, v in self.seconds.items() if k < 1 or v <= 0}
        if bad:
            raise ValueError(f"SPSProfile points must have tokens >= 1 and seconds > 0, got {bad}.")
        self._xs = list(self.seconds)
        self._ys = list(self.seconds.values())

    def time(self, tokens: int) -> float:
        """Seconds of one verification forward over `tokens` tokens (interpolated)."""
        xs, ys = self._xs, self._ys
        if len(xs) == 1:
            return ys[0] * max(tokens, 1) / xs[0] if tokens > xs[0] else ys[0]
        if tokens <= xs[0]:
            return ys[0]
        i = bisect.bisect_left(xs, tokens)
        if i < len(xs) and xs[i] == tokens:
            return ys[i]
        if i == len(xs):  # extrapolate with the last segment's slope
            i = len(xs) - 1
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def sps(self, tokens: int) -> float:
        """Verification steps per second at `tokens` tokens in the forward."""
        return 1.0 / self.time(tokens)

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps({"seconds": self.seconds, "meta": self.meta}, indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> SPSProfile:
        """Read a profile written by [`SPSProfile.save`]."""
        data = json.loads(Path(path).read_text())
        return cls(seconds={int(k): v for k, v in data["seconds"].items()}, meta=data.get("meta", {}))


def context_bucket(context_length: int) -> int:
    """Round a context length up to a power of two (>= 128): profiles are cached per bucket."""
    bucket = 128
    while bucket < context_length:
        bucket *= 2
    return bucket


@torch.no_grad()
def profile_sps(
    target,
    token_counts: tuple[int, ...] = DEFAULT_TOKEN_COUNTS,
    context_length: int = 256,
    repeats: int = 5,
    warmup: int = 2,
) -> SPSProfile:
    """Measure the target's verification forward time at each token count, after a `context_length` prefill.

    Each measurement forwards `B` new tokens on top of a KV cache holding `context_length` tokens (the
    cache is cropped back after every call, so every call sees the same context). The median of `repeats`
    timings is kept. Costs roughly `len(token_counts) · (repeats + warmup)` forwards: seconds on a CPU for a
    135M model.

    Args:
        target (`PreTrainedModel`): the causal LM.
        token_counts (`tuple[int, ...]`): the `B` values to measure.
        context_length (`int`, *optional*, defaults to 256): KV context before the measured tokens.
        repeats (`int`, *optional*, defaults to 5): timings per point (median kept).
        warmup (`int`, *optional*, defaults to 2): untimed calls before each point.
    """
    from transformers import DynamicCache

    device = target.device
    vocab = target.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, context_length), generator=gen).to(device)
    cache = DynamicCache(config=target.config)
    # transformers renamed `past_key_values` to `cache` (the old name warns in 5.24)
    cache_kw = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    target(prompt, use_cache=True, **{cache_kw: cache})
    seconds = {}
    for count in sorted(set(token_counts)):
        ids = torch.randint(0, vocab, (1, count), generator=gen).to(device)
        positions = torch.arange(context_length, context_length + count, device=device)[None]
        timings = []
        for i in range(warmup + repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            target(ids, position_ids=positions, use_cache=True, **{cache_kw: cache})
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                timings.append(time.perf_counter() - start)
            cache.crop(-count)  # back to the shared context (positive crop counts are refused in 5.24)
        seconds[count] = statistics.median(timings)
    meta = {
        "model": model_name(target),
        "device": str(device),
        "dtype": str(target.dtype),
        "context_length": context_length,
        "threads": torch.get_num_threads(),
        "packed_linears": any(is_packed(m) for m in target.modules()),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    return SPSProfile(seconds, meta)


def _cache_path(target, context_length: int) -> Path:
    from .._paths import cache_dir

    name = model_name(target).strip("/").replace("/", "--")
    device = str(target.device).replace(":", "")
    dtype = str(target.dtype).replace("torch.", "")
    threads = torch.get_num_threads() if target.device.type == "cpu" else 0
    # packed CPU linears (dspark_hf.model.cpu_packing) change the cost curve's shape: a separate profile
    packed = "-packed" if any(is_packed(m) for m in target.modules()) else ""
    fname = f"{name}-{device}-{dtype}-t{threads}{packed}-ctx{context_bucket(context_length)}.json"
    return cache_dir() / "sps" / fname


def get_sps_profile(target, context_length: int = 256, refresh: bool = False, **kwargs) -> SPSProfile:
    """The cached SPS profile for this (model, device, dtype, thread count, context bucket); measured if absent.

    Args:
        target (`PreTrainedModel`): the causal LM.
        context_length (`int`, *optional*, defaults to 256): typical context; rounded up to a bucket.
        refresh (`bool`, *optional*, defaults to `False`): re-measure even if a cached profile exists.
        **kwargs: passed to [`profile_sps`].
    """
    path = _cache_path(target, context_length)
    # generate() asks for the profile on every call; keep it in memory rather than re-reading the file
    if not refresh and path in _LOADED and path.exists():
        return _LOADED[path]
    if path.exists() and not refresh:
        profile = SPSProfile.load(path)
    else:
        profile = profile_sps(target, context_length=context_bucket(context_length), **kwargs)
        profile.save(path)
    _LOADED[path] = profile
    return profile


_LOADED: dict[Path, SPSProfile] = {}
