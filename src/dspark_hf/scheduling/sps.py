"""SPS profiles: how many verification forward passes per second the target manages at `B` tokens.

The hardware-aware scheduler maximises expected throughput `τ_exp · SPS(B)`, so it needs the target's real
cost curve on this device. Real curves are jagged (on a 2-core CPU SmolLM2-135M costs about the same for 2
and for 16 tokens, then jumps), so the curve is *measured*, never assumed: [`profile_sps`] times the
target's forward over `B` new tokens on top of a KV cache of realistic length, for a handful of `B`
values, in a few seconds. [`SPSProfile`] interpolates linearly (in time per forward) between measured points.

A measurement taken on a busy machine must not steer the scheduler for good, so:

- [`profile_sps`] interleaves the token counts over several rounds, keeps the median per count, and repairs
  what is left with [`monotone_fit`] (a forward over more tokens never costs less: load only slows a
  forward down, so the lower envelope is kept);
- [`get_sps_profile`] caches profiles on disk keyed by model, device, dtype, thread count, kernel mode
  (`dspark_hf.kernels`) and a power-of-two context bucket, and re-measures one that is stale: older than
  `max_age`, measured with another torch or transformers version, in an older format, or flagged
  inconsistent;
- the hardware-aware policies report live round times ([`SPSProfile.observe`]); when they disagree with the
  profile by more than a factor of 2 (median over 8+ rounds), the profile is flagged and the next
  [`get_sps_profile`] call re-measures it. `dspark generate --refresh-sps` and `get_sps_profile(...,
  refresh=True)` re-measure on demand.

A profile is device-specific: it is never stored inside a draft checkpoint.
"""

from __future__ import annotations

import bisect
import inspect
import json
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .._paths import cache_dir
from .._transformers import model_name
from ..kernels import exact_kernels_build, kernels_of

DEFAULT_TOKEN_COUNTS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)

#: Version of the measuring procedure; profiles of an older format are re-measured.
PROFILE_FORMAT = 2

#: A cached profile older than this (seconds) is re-measured (a week: the machine's load and software drift).
DEFAULT_MAX_AGE = 7 * 24 * 3600.0

#: Live round times further than this factor from the profile (either way) flag it as inconsistent.
LIVE_FACTOR = 2.0

#: Live rounds needed (per profile) before the comparison with the profile counts.
LIVE_MIN_ROUNDS = 8


@dataclass
class SPSProfile:
    """Measured seconds per verification forward at several token counts `B`.

    Args:
        seconds (`dict[int, float]`): forward time in seconds per token count `B` (at least one point).
        meta (`dict`, *optional*): where it was measured (model, device, dtype, context length, date).

    Between measured points the *time* is interpolated linearly. Beyond the last point it grows with the slope
    of the last two points, but never slower than in proportion to the tokens (`time(B) >= time(last) * B /
    last`): a flat measured tail (the monotone fit makes equal neighbours) must not make tokens past the measured
    range look free, since forwards that large are compute-bound.
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
        if i == len(xs):  # past the last point: its segment's slope, at least proportional growth
            x0, x1, y0, y1 = xs[-2], xs[-1], ys[-2], ys[-1]
            return max(y0 + (y1 - y0) * (tokens - x0) / (x1 - x0), y1 * tokens / x1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def sps(self, tokens: int) -> float:
        """Verification steps per second at `tokens` tokens in the forward."""
        return 1.0 / self.time(tokens)

    def observe(self, tokens: int, seconds: float) -> bool:
        """Compare one live round (a forward over `tokens` tokens that took `seconds`, overheads included).

        Keeps the ratio `seconds / time(tokens)` of the last 32 rounds. Once at least `LIVE_MIN_ROUNDS` are in
        and their median is outside `[1 / LIVE_FACTOR, LIVE_FACTOR]`, the profile is flagged
        (`meta["inconsistent"]`, written to its cache file when it has one) so that the next
        [`get_sps_profile`] re-measures it; returns `True` on the call that flags it.
        """
        if seconds <= 0 or self.meta.get("inconsistent"):
            return False
        ratios = self.__dict__.setdefault("_live", [])
        ratios.append(seconds / self.time(tokens))
        del ratios[:-32]
        if len(ratios) < LIVE_MIN_ROUNDS:
            return False
        ratio = statistics.median(ratios)
        if 1 / LIVE_FACTOR <= ratio <= LIVE_FACTOR:
            return False
        self.meta["inconsistent"] = {"median_live_over_profile": round(ratio, 3), "rounds": len(ratios)}
        path = self.meta.get("path")
        if path and Path(path).exists():
            self.save(path)
        warnings.warn(
            f"The SPS profile of {self.meta.get('model', 'the target')} disagrees with live round times (median "
            f"{ratio:.2f}x its prediction over {len(ratios)} rounds); it will be re-measured on next use. Call "
            "dspark_hf.get_sps_profile(target, refresh=True) (or `dspark generate --refresh-sps`) to do it now.",
            stacklevel=2,
        )
        return True

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.tmp")
        meta = {k: v for k, v in self.meta.items() if k != "path"}
        tmp.write_text(json.dumps({"seconds": self.seconds, "meta": meta}, indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> SPSProfile:
        """Read a profile written by [`SPSProfile.save`]."""
        data = json.loads(Path(path).read_text())
        return cls(seconds={int(k): v for k, v in data["seconds"].items()}, meta=data.get("meta", {}))


def monotone_fit(seconds: dict[int, float]) -> dict[int, float]:
    """Make a measured curve non-decreasing in `B`: each point becomes the minimum over itself and larger `B`.

    Load on the machine only ever slows a forward down, so where a smaller `B` was measured slower than a
    larger one, the smaller measurement is the noisy one: the lower envelope (a running minimum from the
    largest `B` down) is kept. Example: `{1: 0.101, 2: 0.152, 8: 0.090}` becomes `{1: 0.090, 2: 0.090, 8: 0.090}`.
    """
    fitted, floor = {}, float("inf")
    for tokens in sorted(seconds, reverse=True):
        floor = min(floor, seconds[tokens])
        fitted[tokens] = floor
    return dict(sorted(fitted.items()))


def _versions() -> dict[str, str]:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def stale_reason(
    profile: SPSProfile, max_age: float | None = DEFAULT_MAX_AGE, now: float | None = None, ignore_live: bool = False
) -> str | None:
    """Why a cached profile must be re-measured (`None`: it may be reused).

    Stale: an older measuring format, another torch or transformers version, flagged inconsistent with live
    round times (unless `ignore_live`), or measured more than `max_age` seconds ago (`None`: no age limit).
    [`get_sps_profile`] re-measures a contradicted profile once per process; one contradicted again is kept.
    """
    meta = profile.meta
    if meta.get("format", 1) < PROFILE_FORMAT:
        return f"measured with an older procedure (format {meta.get('format', 1)} < {PROFILE_FORMAT})"
    for name, version in _versions().items():
        if meta.get(name) != version:
            return f"measured with {name} {meta.get(name)}, this is {version}"
    if meta.get("kernels") in ("exact", "exact-bf16"):
        build = exact_kernels_build()
        if meta.get("kernels_build") != build:
            return f"measured on another build of the exact kernels ({meta.get('kernels_build')}, this is {build})"
    if meta.get("inconsistent") and not ignore_live:
        return f"inconsistent with live round times ({meta['inconsistent']})"
    if max_age is not None:
        age = (time.time() if now is None else now) - float(meta.get("measured_at_epoch", 0))
        if age > max_age:
            return f"{age / 3600:.0f} h old (max_age {max_age / 3600:.0f} h)"
    return None


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
    monotone: bool = True,
) -> SPSProfile:
    """Measure the target's verification forward time at each token count, after a `context_length` prefill.

    Each measurement forwards `B` new tokens on top of a KV cache holding `context_length` tokens (the
    cache is cropped back after every call, so every call sees the same context). The token counts are
    interleaved: each of the `repeats` rounds times every `B` once (in alternating order), so a noisy moment
    spreads over all points instead of poisoning one; the median per `B` is kept and, with `monotone`,
    repaired by [`monotone_fit`] (the raw medians stay in `meta["raw_seconds"]`). Costs roughly
    `len(token_counts) · (repeats + warmup)` forwards: seconds on a CPU for a 135M model.

    Args:
        target (`PreTrainedModel`): the causal LM.
        token_counts (`tuple[int, ...]`): the `B` values to measure.
        context_length (`int`, *optional*, defaults to 256): KV context before the measured tokens.
        repeats (`int`, *optional*, defaults to 5): timed rounds over all token counts (median kept).
        warmup (`int`, *optional*, defaults to 2): untimed rounds first.
        monotone (`bool`, *optional*, defaults to `True`): make the curve non-decreasing in `B`.
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
    counts = sorted(set(token_counts))
    ids = {c: torch.randint(0, vocab, (1, c), generator=gen).to(device) for c in counts}
    timings: dict[int, list[float]] = {c: [] for c in counts}
    for round_index in range(warmup + repeats):
        order = counts if round_index % 2 == 0 else counts[::-1]
        for count in order:
            positions = torch.arange(context_length, context_length + count, device=device)[None]
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            target(ids[count], position_ids=positions, use_cache=True, **{cache_kw: cache})
            if device.type == "cuda":
                torch.cuda.synchronize()
            if round_index >= warmup:
                timings[count].append(time.perf_counter() - start)
            cache.crop(-count)  # back to the shared context (positive crop counts are refused in 5.24)
    raw = {c: statistics.median(ts) for c, ts in timings.items()}
    meta = {
        "model": model_name(target),
        "device": str(device),
        "dtype": str(target.dtype),
        "context_length": context_length,
        "threads": torch.get_num_threads(),
        "kernels": kernels_of(target),
        "repeats": repeats,
        "format": PROFILE_FORMAT,
        **_versions(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "measured_at_epoch": time.time(),
    }
    if meta["kernels"] in ("exact", "exact-bf16"):
        meta["kernels_build"] = exact_kernels_build()
    if monotone:
        meta["raw_seconds"] = raw
    return SPSProfile(monotone_fit(raw) if monotone else raw, meta)


def _cache_path(target, context_length: int) -> Path:
    name = model_name(target).strip("/").replace("/", "--")
    device = str(target.device).replace(":", "")
    dtype = str(target.dtype).replace("torch.", "")
    threads = torch.get_num_threads() if target.device.type == "cpu" else 0
    # packed or exact kernels (dspark_hf.kernels) change the cost curve's shape: a separate profile per mode
    mode = kernels_of(target)
    kernels = "" if mode == "stock" else f"-{mode}"
    fname = f"{name}-{device}-{dtype}-t{threads}{kernels}-ctx{context_bucket(context_length)}.json"
    return cache_dir() / "sps" / fname


def get_sps_profile(
    target, context_length: int = 256, refresh: bool = False, max_age: float | None = DEFAULT_MAX_AGE, **kwargs
) -> SPSProfile:
    """The cached SPS profile for this (model, device, dtype, threads, kernel mode, context bucket).

    Measured with [`profile_sps`] when absent, when `refresh` is set, or when the cached one is stale (see
    [`stale_reason`]: older than `max_age`, other torch/transformers versions, an older format, or flagged
    inconsistent with live round times by [`SPSProfile.observe`]).

    Args:
        target (`PreTrainedModel`): the causal LM.
        context_length (`int`, *optional*, defaults to 256): typical context; rounded up to a bucket.
        refresh (`bool`, *optional*, defaults to `False`): re-measure even if a usable cached profile exists.
        max_age (`float`, *optional*, defaults to a week): seconds after which a cached profile is re-measured
            (`None`: no age limit).
        **kwargs: passed to [`profile_sps`].
    """
    path = _cache_path(target, context_length)
    profile = None if refresh else _LOADED.get(path)
    if profile is not None and (not path.exists() or _must_remeasure(profile, path, max_age)):
        profile = None  # deleted, flagged inconsistent, or aged since it was loaded
    if profile is None and not refresh and path.exists():
        try:
            profile = SPSProfile.load(path)
        except (ValueError, KeyError, json.JSONDecodeError):
            profile = None  # unreadable: measured again
        if profile is not None and _must_remeasure(profile, path, max_age):
            profile = None
    if profile is None:
        if path in _LOADED and _LOADED[path].meta.get("inconsistent"):
            _REMEASURED.add(path)
        profile = profile_sps(target, context_length=context_bucket(context_length), **kwargs)
        profile.save(path)
    profile.meta["path"] = str(path)
    _LOADED[path] = profile
    return profile


def _must_remeasure(profile: SPSProfile, path: Path, max_age: float | None) -> bool:
    reason = stale_reason(profile, max_age)
    if reason is None:
        return False
    # a fresh measurement contradicted again by live rounds is kept: the rounds' own overheads (a tiny model,
    # a busy host) explain it, and measuring on every call would cost more than it tells
    return not (
        profile.meta.get("inconsistent")
        and path in _REMEASURED
        and stale_reason(profile, max_age, ignore_live=True) is None
    )


_LOADED: dict[Path, SPSProfile] = {}
_REMEASURED: set[Path] = set()  # profiles re-measured in this process because live rounds contradicted them
