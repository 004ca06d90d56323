"""Prometheus metrics of the scheduler: the same SchedulerStats that GetStats returns, read on
each scrape. Every metric's name, kind and help come from the field's `metric` option in
engine.proto, where the statistic is declared once; counters get Prometheus' `_total` suffix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from strata.v1 import engine_pb2

PREFIX = "strata_scheduler_"


def stat_fields() -> list[tuple[str, engine_pb2.MetricSpec]]:
    """(field name, MetricSpec) of every SchedulerStats field, in declaration order."""
    return [(f.name, f.GetOptions().Extensions[engine_pb2.metric]) for f in engine_pb2.SchedulerStats.DESCRIPTOR.fields]


class SchedulerStatsCollector(Collector):
    def __init__(self, read_stats):
        self._read_stats = read_stats  # () -> engine_pb2.SchedulerStats
        self._fields = stat_fields()

    def collect(self):
        stats = self._read_stats()
        for name, spec in self._fields:
            family = CounterMetricFamily if spec.counter else GaugeMetricFamily
            metric_name = spec.name or PREFIX + name
            if not spec.label:
                yield family(metric_name, spec.help, value=getattr(stats, name))
                continue
            metric = family(metric_name, spec.help, labels=[spec.label])
            for index, value in enumerate(getattr(stats, name)):
                metric.add_metric([str(index)], value)
            yield metric


def serve_metrics(read_stats, port: int, host: str) -> CollectorRegistry:
    """Serves the scheduler's metrics over HTTP on host:port; returns the registry."""
    registry = CollectorRegistry()
    registry.register(SchedulerStatsCollector(read_stats))
    start_http_server(port, addr=host, registry=registry)
    return registry
