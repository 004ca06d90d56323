"""Serving metrics of the gateway, in Prometheus conventions: what users of vLLM and TGI chart.

Histograms of time to first token, inter-token latency, end-to-end latency and queue time; counters
of requests by finish reason, of prompt and generated tokens and of prefix-cache hits. They live
in the gateway process, so a pipeline rebuilt after a lost worker resets none of them; served on
the HTTP front's GET /metrics.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

# Buckets spanning a fast decode step (ms) to a long offline request (minutes).
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5, 10, 20, 40, 80, 160)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("strata_time_to_first_token_seconds", "request arrival to its first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("strata_inter_token_latency_seconds", "gap between a request's tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("strata_e2e_request_latency_seconds", "request arrival to its last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("strata_request_queue_time_seconds", "waiting in the scheduler before admission",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("strata_request_success", "outputs finished, by finish reason",
                                ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("strata_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("strata_generation_tokens", "tokens generated", registry=r)
        self.cached_prompt_tokens = Counter("strata_prefix_cache_hit_tokens",
                                            "prompt tokens found in the prefix cache", registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One request's timeline: feed every response (and each child's queue time) as it goes."""

    def __init__(self, metrics: GatewayMetrics):
        self.metrics = metrics
        self.start = time.perf_counter()
        self.last_token: float | None = None
        self.tokens = 0
        self.finished: set[int] = set()  # output indices counted (CUMULATIVE repeats finished ones)

    def queued(self, seconds: float) -> None:
        self.metrics.queue.observe(seconds)

    def response(self, response) -> None:
        """Counts new tokens from usage (so far, in every output kind) rather than from outputs,
        which CUMULATIVE responses repeat."""
        now = time.perf_counter()
        new = response.usage.completion_tokens - self.tokens
        if new > 0:
            if self.last_token is None:
                self.metrics.ttft.observe(now - self.start)
            else:
                gap = (now - self.last_token) / new  # tokens that arrived together share the gap
                for _ in range(new):
                    self.metrics.itl.observe(gap)
            self.last_token = now
            self.tokens += new
            self.metrics.generation_tokens.inc(new)
        for output in response.outputs:
            if output.finish_reason and output.index not in self.finished:
                self.finished.add(output.index)
                self.metrics.finished.labels(output.finish_reason).inc()
        if response.finished:
            self.metrics.e2e.observe(now - self.start)
            self.metrics.prompt_tokens.inc(response.usage.prompt_tokens)
            self.metrics.cached_prompt_tokens.inc(response.usage.cached_prompt_tokens)
