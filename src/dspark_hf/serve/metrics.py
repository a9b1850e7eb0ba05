"""HTTP-level Prometheus metrics of `dspark serve` (the engine's own `dspark_engine_*` series are appended).

Each app gets its own `CollectorRegistry`, so two apps in one process (tests) do not share counters.
"""

from __future__ import annotations

from ..decoding.engine import RequestOutput

# seconds; TTFT on a CPU runs from tens of milliseconds (tiny models) to tens of seconds (a long queue)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class ServeMetrics:
    """Counters, gauges and histograms of the HTTP server.

    Args:
        block_size (`int`): the draft's γ (buckets of the τ and verified-length histograms run to γ + 1).
        max_batch_size (`int`): buckets of the batch-size histogram run to it.
        max_queue (`int`): the admission limit beyond the batch (exported as a gauge, for alert rules).
        in_flight (`callable`): returns the requests admitted and not finished.
        queue_depth (`callable`): returns the admitted requests still waiting for a batch slot.
    """

    def __init__(self, block_size: int, max_batch_size: int, max_queue: int, in_flight, queue_depth) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "dspark_http_requests", "HTTP requests answered, by endpoint and status code.", ["endpoint", "status"],
            registry=r,
        )  # fmt: skip
        self.cancelled = Counter(
            "dspark_http_requests_cancelled",
            "Requests dropped from the batch before they finished, by reason (disconnect, stop, shutdown).",
            ["reason"],
            registry=r,
        )
        self.rejected = Counter(
            "dspark_http_requests_rejected", "Requests refused before admission, by reason.", ["reason"], registry=r
        )
        Gauge("dspark_http_in_flight", "Requests admitted and not finished.", registry=r).set_function(in_flight)
        Gauge("dspark_http_queue_depth", "Admitted requests waiting for a batch slot.", registry=r).set_function(
            queue_depth
        )
        Gauge("dspark_http_max_queue", "The server's --max-queue.", registry=r).set(max_queue)
        Gauge("dspark_http_max_batch_size", "The server's --max-batch-size.", registry=r).set(max_batch_size)
        self.ttft = Histogram(
            "dspark_http_time_to_first_token_seconds", "Request arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "dspark_http_inter_token_latency_seconds",
            "Time per generated token after the first (a round's gap split over the tokens it accepted).",
            buckets=_TOKEN_GAP_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "dspark_http_request_duration_seconds", "Request arrival to its last token.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter("dspark_http_generated_tokens", "Completion tokens sent to clients.", registry=r)
        positions = [float(k) for k in range(1, block_size + 2)]
        self.tau = Histogram(
            "dspark_request_tau", "Per finished request: tokens per round (accepted drafts + 1).",
            buckets=positions, registry=r,
        )  # fmt: skip
        self.verified = Histogram(
            "dspark_round_verified_length", "Per request-round: drafted tokens sent to verification (ℓ).",
            buckets=[float(k) for k in range(0, block_size + 1)], registry=r,
        )  # fmt: skip
        self.batch = Histogram(
            "dspark_round_batch_size", "Requests served by one engine round (prefill and decoding together).",
            buckets=sorted({1, 2, 4, 8, 16, 32, 64, 128, max_batch_size}), registry=r,
        )  # fmt: skip

    def observe_tokens(self, gap: float, count: int, first: bool) -> None:
        """`count` tokens arrived `gap` seconds after the previous ones (or after arrival when `first`)."""
        if count <= 0:
            return
        self.tokens.inc(count)
        if first:
            self.ttft.observe(gap)
            count -= 1
            gap = 0.0
        for _ in range(count):
            self.itl.observe(gap / count if gap else 0.0)

    def observe_finished(self, output: RequestOutput, duration: float) -> None:
        """A request's last token: its latency, τ and the verified length of each of its rounds."""
        self.latency.observe(duration)
        stats = output.stats
        if stats is not None and stats.num_rounds:
            self.tau.observe(stats.tau)
            for rnd in stats.rounds:
                self.verified.observe(rnd.verified)

    def render(self, engine_text: str) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry) + engine_text.encode()
