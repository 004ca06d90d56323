"""Prometheus metrics of the scheduler, mirrored from the same statistics GetStats returns."""
from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from strata.v1 import engine_pb2

# Gauges rather than counters: the values are totals kept by the scheduler itself, and they
# restart from zero when the pipeline is rebuilt after a worker failure.
_FIELDS = {
    "num_kv_blocks": "KV cache blocks in the pool",
    "free_kv_blocks": "KV blocks nobody references (cached ones included)",
    "cached_kv_blocks": "free KV blocks that still hold a cached prefix",
    "used_kv_blocks": "KV blocks referenced by requests",
    "peak_used_kv_blocks": "most KV blocks referenced at once",
    "running": "requests running",
    "waiting": "requests waiting",
    "prefix_cache_queries": "prompt tokens looked up in the prefix cache",
    "prefix_cache_hits": "prompt tokens found in the prefix cache",
    "prefill_tokens_computed": "prompt tokens computed",
    "decode_tokens_computed": "decode tokens computed",
    "steps": "engine steps executed",
    "preemptions": "requests preempted for recompute",
    "finished_requests": "requests finished",
    "gpu_idle_fraction": "share of wall time with no plan executing",
    "lookahead_decodes": "decodes scheduled before their input token came back (one stage)",
    "busy_seconds": "wall time with at least one plan executing",
    "worker_gpu_busy_seconds": "GPU time inside steps on the last stage (CUDA events)",
    "worker_gpu_idle_seconds": "GPU idle time between consecutive steps on the last stage (CUDA events)",
    "worker_timed_steps": "steps timed with CUDA events on the last stage",
    "worker_launch_seconds": "host time the last stage spent launching steps",
}


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.gauges = {name: Gauge(f"strata_scheduler_{name}", doc, registry=self.registry)
                       for name, doc in _FIELDS.items()}

    def update(self, stats: engine_pb2.SchedulerStats) -> None:
        for name, gauge in self.gauges.items():
            gauge.set(getattr(stats, name))

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)


async def publish_metrics(engine, metrics: SchedulerMetrics, interval: float = 1.0) -> None:
    """Copies the engine's statistics into the gauges every `interval` seconds."""
    while True:
        metrics.update(engine.stats())
        await asyncio.sleep(interval)
