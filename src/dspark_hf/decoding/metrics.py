"""Serving metrics of [`DSparkEngine`]: counters and gauges, as a dict and in Prometheus text format.

[`EngineMetrics`] is plain data the engine updates once per round; nothing here measures anything itself.
`to_dict()` is JSON-ready; `to_prometheus()` renders the Prometheus text exposition format, through
`prometheus_client` when it is installed (`pip install -e '.[serve]' in your dspark-hf clone`) and with a small built-in
formatter otherwise, so `/metrics` endpoints work either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PREFIX = "dspark_engine"


@dataclass
class EngineMetrics:
    """Aggregate counters of an engine since it was created (or since [`EngineMetrics.reset`]).

    Args:
        block_size (`int`): γ, the number of drafted positions.
    """

    block_size: int
    requests_added: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    rounds: int = 0  # verification forwards (decode rounds)
    prefill_forwards: int = 0
    prefill_chunks: int = 0  # requests' prompt chunks prefilled (a prompt over max_prefill_tokens takes several)
    prefill_tokens: int = 0  # prompt tokens prefilled
    prefix_cache_queried_tokens: int = 0  # prompt tokens of requests looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0  # ... of them restored from it (not prefilled)
    request_rounds: int = 0  # Σ over rounds of the requests in them
    tokens_generated: int = 0
    drafts_verified: int = 0
    drafts_accepted: int = 0
    forward_tokens: int = 0  # Σ over rounds of B = Σ_r (1 + ℓ_r)
    computed_tokens: int = 0  # Σ over rounds of the tokens the forward computed (padded: R · max_r (1 + ℓ_r))
    drafting_rounds: int = 0  # rounds that ran the draft
    lookup_rounds: int = 0  # rounds that verified prompt-lookup copies (and did not draft)
    lookup_request_rounds: int = 0  # Σ over those rounds of the requests that verified a copy
    lookup_verified: int = 0  # copied tokens sent to verification
    lookup_accepted: int = 0  # ... accepted by the target
    busy_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    queue_length_sum: int = 0  # Σ over rounds (for the mean)
    active_requests: int = 0
    queue_length: int = 0
    kv_tokens: int = 0
    kv_bytes: int = 0
    prefix_cache_bytes: int = 0
    peak_active_requests: int = 0
    peak_queue_length: int = 0
    peak_kv_tokens: int = 0
    peak_kv_bytes: int = 0
    verified_at: list[int] = field(default_factory=list)  # rounds that verified > k drafts
    accepted_at: list[int] = field(default_factory=list)  # ... of which the first k+1 were accepted
    length_counts: list[int] = field(default_factory=list)  # rounds per verification length ℓ = 0..γ
    layout_counts: dict[str, int] = field(default_factory=dict)  # target forwards per layout

    def __post_init__(self) -> None:
        self.verified_at = self.verified_at or [0] * self.block_size
        self.accepted_at = self.accepted_at or [0] * self.block_size
        self.length_counts = self.length_counts or [0] * (self.block_size + 1)
        self.layout_counts = self.layout_counts or {"padded": 0, "packed": 0, "varlen": 0}

    def reset(self) -> None:
        """Zero every counter and peak (gauges keep their current value)."""
        gauges = ("active_requests", "queue_length", "kv_tokens", "kv_bytes", "prefix_cache_bytes")
        keep = {k: getattr(self, k) for k in gauges}
        self.__init__(self.block_size, **keep)

    def record_request_round(self, verified: int, accepted: int, copied: bool = False) -> None:
        """One request's part of a round: `verified` drafts (or copied tokens, `copied`) went to the target,
        `accepted` survived. The acceptance curve counts drafts only (a copy's acceptance is another story)."""
        self.request_rounds += 1
        self.length_counts[verified] += 1
        if copied:
            self.lookup_request_rounds += 1
            self.lookup_verified += verified
            self.lookup_accepted += accepted
            return
        self.drafts_verified += verified
        self.drafts_accepted += accepted
        for k in range(verified):
            self.verified_at[k] += 1
            self.accepted_at[k] += accepted > k

    def record_gauges(self, active: int, queue: int, kv_tokens: int, kv_bytes: int) -> None:
        """Current load; peaks are kept."""
        self.active_requests, self.queue_length, self.kv_tokens, self.kv_bytes = active, queue, kv_tokens, kv_bytes
        self.peak_active_requests = max(self.peak_active_requests, active)
        self.peak_queue_length = max(self.peak_queue_length, queue)
        self.peak_kv_tokens = max(self.peak_kv_tokens, kv_tokens)
        self.peak_kv_bytes = max(self.peak_kv_bytes, kv_bytes)

    # ------------------------------------------------------------------ derived
    @property
    def tau(self) -> float:
        """`float`: tokens per request-round (accepted drafts or copied tokens + 1), micro-averaged over all
        requests."""
        accepted = self.drafts_accepted + self.lookup_accepted
        return (accepted + self.request_rounds) / self.request_rounds if self.request_rounds else 0.0

    @property
    def mean_verification_length(self) -> float:
        """`float`: mean drafts (or copied tokens) sent to verification per request-round."""
        verified = self.drafts_verified + self.lookup_verified
        return verified / self.request_rounds if self.request_rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """`list[float]`: P(first k drafts accepted | k verified), k = 1..γ (NaN where never verified)."""
        return [a / v if v else math.nan for a, v in zip(self.accepted_at, self.verified_at)]

    @property
    def tokens_per_second(self) -> float:
        """`float`: generated tokens per second of engine work (all requests together)."""
        return self.tokens_generated / self.busy_seconds if self.busy_seconds else 0.0

    def to_dict(self) -> dict:
        """All counters, gauges and derived values, JSON-ready."""
        out = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        out.update(
            tau=self.tau,
            mean_verification_length=self.mean_verification_length,
            mean_forward_tokens=self.forward_tokens / self.rounds if self.rounds else 0.0,
            mean_computed_tokens=self.computed_tokens / self.rounds if self.rounds else 0.0,
            mean_queue_length=self.queue_length_sum / self.rounds if self.rounds else 0.0,
            acceptance_by_position=self.acceptance_by_position,
            tokens_per_second=self.tokens_per_second,
        )
        return out

    # ------------------------------------------------------------------ Prometheus
    def families(self) -> list[tuple[str, str, str, list[tuple[dict, float]]]]:
        """Metric families `(name, type, help, [(labels, value)])` in Prometheus naming."""
        counters = [
            ("requests_added", "Requests submitted."),
            ("requests_finished", "Requests finished (including failed ones)."),
            ("requests_failed", "Requests that ended with an error."),
            ("rounds", "Batched verification forwards."),
            ("prefill_forwards", "Batched prefill forwards."),
            ("prefill_chunks", "Prompt chunks prefilled (a long prompt is prefilled over several rounds)."),
            ("prefill_tokens", "Prompt tokens prefilled."),
            ("prefix_cache_queried_tokens", "Prompt tokens of requests looked up in the prefix cache."),
            ("prefix_cache_hit_tokens", "Prompt tokens restored from the prefix cache instead of prefilled."),
            ("request_rounds", "Request participations in verification rounds."),
            ("tokens_generated", "Tokens emitted to requests."),
            ("drafts_verified", "Drafted tokens sent to verification."),
            ("drafts_accepted", "Drafted tokens accepted by the target."),
            ("forward_tokens", "Tokens in verification forwards (B summed over rounds)."),
            ("computed_tokens", "Tokens the verification forwards computed, padding included."),
            ("drafting_rounds", "Rounds that ran the draft."),
            ("lookup_rounds", "Rounds that verified prompt-lookup copies instead of drafting."),
            ("lookup_request_rounds", "Request participations that verified a prompt-lookup copy."),
            ("lookup_verified", "Copied tokens sent to verification."),
            ("lookup_accepted", "Copied tokens accepted by the target."),
        ]
        seconds = [
            ("busy_seconds", "Seconds spent in engine steps."),
            ("draft_seconds", "Seconds in batched drafting (backbone and sequential head)."),
            ("verify_seconds", "Seconds in batched target verification and acceptance."),
            ("prefill_seconds", "Seconds in batched prefills."),
        ]
        gauges = [
            ("active_requests", "Requests being decoded."),
            ("queue_length", "Requests waiting for admission."),
            ("kv_tokens", "Tokens held in target KV caches."),
            ("kv_bytes", "Bytes allocated for target and draft KV caches."),
            ("prefix_cache_bytes", "Bytes held by the prefix cache."),
            ("peak_active_requests", "Peak of active_requests."),
            ("peak_queue_length", "Peak of queue_length."),
            ("peak_kv_bytes", "Peak of kv_bytes."),
            ("tau", "Mean tokens per request-round (accepted drafts or copied tokens + 1)."),
            ("mean_verification_length", "Mean drafts or copied tokens verified per request-round."),
            ("tokens_per_second", "Generated tokens per busy second."),
        ]
        fams = [(f"{PREFIX}_{n}", "counter", h, [({}, getattr(self, n))]) for n, h in counters + seconds]
        fams += [(f"{PREFIX}_{n}", "gauge", h, [({}, getattr(self, n))]) for n, h in gauges]
        fams.append(
            (
                f"{PREFIX}_acceptance_by_position",
                "gauge",
                "P(first k drafts accepted | k verified).",
                [({"position": str(k + 1)}, v) for k, v in enumerate(self.acceptance_by_position)],
            )
        )
        fams.append(
            (
                f"{PREFIX}_forwards_by_layout",
                "counter",
                "Target forwards (prefill and verification) by layout.",
                [({"layout": k}, v) for k, v in sorted(self.layout_counts.items())],
            )
        )
        fams.append(
            (
                f"{PREFIX}_verification_length",
                "counter",
                "Request-rounds by verification length.",
                [({"length": str(n)}, c) for n, c in enumerate(self.length_counts)],
            )
        )
        return fams

    def to_prometheus(self) -> str:
        """The metrics in Prometheus text exposition format (via `prometheus_client` when installed)."""
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            return _format_text(self.families())
        return _format_with_client(self.families())


def _format_with_client(families) -> str:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class _Collector:
        def collect(self):
            for name, kind, help_text, samples in families:
                labels = sorted(samples[0][0]) if samples else []
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                fam = cls(name, help_text, labels=labels)
                for lab, value in samples:
                    fam.add_metric([lab[k] for k in labels], float(value))
                yield fam

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry).decode()


def _format_text(families) -> str:
    """Minimal text exposition (version 0.0.4), used when `prometheus_client` is not installed."""
    lines = []
    for name, kind, help_text, samples in families:
        sample_name = f"{name}_total" if kind == "counter" and not name.endswith("_total") else name
        lines.append(f"# HELP {sample_name if kind != 'counter' else name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            lines.append(f"{sample_name}{{{lab}}} {_number(value)}" if lab else f"{sample_name} {_number(value)}")
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)
