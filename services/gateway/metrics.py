"""Serving metrics of the gateway, in Prometheus conventions: what users of vLLM and TGI chart.

Histograms of time to first token, inter-token latency, end-to-end latency and queue time; counters
of requests by finish reason, of prompt and generated tokens and of prefix-cache hits. They live
in the gateway process, so a pipeline rebuilt after a lost worker resets none of them; served on
the HTTP front's GET /metrics.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Buckets spanning a fast decode step (ms) to a long offline request (minutes).
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5, 10, 20, 40, 80, 160)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "strata_time_to_first_token_seconds",
            "request arrival to its first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "strata_inter_token_latency_seconds",
            "gap between consecutive tokens of one output",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "strata_e2e_request_latency_seconds",
            "request arrival to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "strata_request_queue_time_seconds",
            "waiting in the scheduler before admission",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.finished = Counter(
            "strata_request_success",
            "outputs finished, by finish reason (stop, length, abort, error)",
            ["finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("strata_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("strata_generation_tokens", "tokens generated", registry=r)
        self.cached_prompt_tokens = Counter(
            "strata_prefix_cache_hit_tokens", "prompt tokens found in the prefix cache", registry=r
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def add_replicas(self, replicas) -> None:
        """Exports each replica of a ReplicaSet (replicas.py), read on every scrape."""
        self.registry.register(ReplicaCollector(replicas))


class ReplicaCollector(Collector):
    """Per replica (label `replica`, its index in --scheduler-address): whether it is up, the load
    routed by, what its scheduler runs and holds waiting (polled), the requests routed there by
    reason (load, affinity, group, resume) and the children resumed there from a lost replica."""

    def __init__(self, replicas):
        self.replicas = replicas

    def collect(self):
        label = ["replica"]
        up = GaugeMetricFamily("strata_replica_up", "1 while the replica serves the model", labels=label)
        load = GaugeMetricFamily(
            "strata_replica_load_tokens", "tokens of the requests routed there running", labels=label
        )
        running = GaugeMetricFamily("strata_replica_running", "requests running there (polled)", labels=label)
        waiting = GaugeMetricFamily("strata_replica_waiting", "requests waiting there (polled)", labels=label)
        routed = CounterMetricFamily(
            "strata_replica_routed", "requests and prefix groups routed there, by reason", labels=["replica", "reason"]
        )
        resumed = CounterMetricFamily(
            "strata_replica_resumed", "child requests resumed there after their replica was lost", labels=label
        )
        for r in self.replicas.replicas:
            index = [str(r.index)]
            up.add_metric(index, float(r.up))
            load.add_metric(index, max(r.load_tokens, 0))
            running.add_metric(index, r.stats.running if r.stats else 0)
            waiting.add_metric(index, r.stats.waiting if r.stats else 0)
            for reason, count in sorted(r.routed.items()):
                routed.add_metric([str(r.index), reason], count)
            resumed.add_metric(index, r.resumed)
        yield from (up, load, running, waiting, routed, resumed)


class RequestTimer:
    """One public request's timeline. Each child's scheduler outputs, as they arrive, time the
    queue, the first token and the gaps between that child's tokens (output(), so n > 1 siblings
    that step together do not look n times faster); the merged responses count tokens, finish
    reasons and the end-to-end latency (response()); close() counts outputs that never finished.

    A child the scheduler sends once, when it has finished (FINAL_ONLY without stop strings,
    e.g. a non-streamed HTTP request), tells nothing about when its tokens came: `timed` is then
    False and the request counts in every metric but TTFT and ITL, rather than adding its whole
    latency as a time to first token.
    """

    def __init__(self, metrics: GatewayMetrics, num_outputs: int, timed: bool):
        self.metrics = metrics
        self.timed = timed
        self.start = time.perf_counter()
        self.first_token_seen = False
        self.last_token: list[float | None] = [None] * num_outputs  # each child's latest token
        self.admitted = [False] * num_outputs
        self.tokens = 0
        self.finished: set[int] = set()  # output indices counted (CUMULATIVE repeats finished ones)
        self.done = False

    def output(self, index: int, out) -> None:
        """A scheduler output (EngineOutput) of child `index`, as it arrives."""
        now = time.perf_counter()
        if not self.admitted[index]:  # its first output comes after its admission
            self.admitted[index] = True
            self.metrics.queue.observe(out.queue_seconds)
        new = len(out.token_ids)
        if not self.timed or not new:
            return
        if not self.first_token_seen:
            self.first_token_seen = True
            self.metrics.ttft.observe(now - self.start)
        last = self.last_token[index]
        if last is not None:
            gap = (now - last) / new  # tokens that arrived together (speculation) share the gap
            for _ in range(new):
                self.metrics.itl.observe(gap)
        self.last_token[index] = now

    def response(self, response) -> None:
        """A merged response. Counts new tokens from usage (so far, in every output kind) rather
        than from outputs, which CUMULATIVE responses repeat."""
        new = response.usage.completion_tokens - self.tokens
        if new > 0:
            self.tokens += new
            self.metrics.generation_tokens.inc(new)
        for output in response.outputs:
            if output.finish_reason and output.index not in self.finished:
                self.finished.add(output.index)
                self.metrics.finished.labels(output.finish_reason).inc()
        if response.finished:
            self.done = True
            self.metrics.e2e.observe(time.perf_counter() - self.start)
            self.metrics.prompt_tokens.inc(response.usage.prompt_tokens)
            self.metrics.cached_prompt_tokens.inc(response.usage.cached_prompt_tokens)

    def close(self, reason: str = "abort") -> None:
        """However the request ended: outputs that did not finish count under `reason` ("abort":
        the client went away; "error": the request failed)."""
        if self.done:
            return
        self.done = True
        for index in range(len(self.last_token)):
            if index not in self.finished:
                self.metrics.finished.labels(reason).inc()
