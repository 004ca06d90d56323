"""Time GPU work as a CUDA graph (a kernel's own time, without the host's launches between calls),
or eagerly (what a call costs where it cannot be captured, host launches included)."""

from __future__ import annotations

import statistics

import torch


def graph_time_us(call, calls: int, *, replays: int, repeats: int = 1, before_timing=None) -> float:
    """Median over `repeats` of the microseconds per call of a CUDA graph of call(0) ..
    call(calls - 1), replayed `replays` times between two events. The calls run once eagerly
    first, on a side stream (Triton compiles and cuBLAS plans there, outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    graph.replay()
    torch.cuda.synchronize()
    if before_timing is not None:  # (ranks of a collective: start their timed replays together)
        before_timing()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * calls))
    del graph
    return statistics.median(times)


def eager_time_us(call, calls: int, repeats: int) -> float:
    """Median per call of `calls` eager calls between two events (host synchronisation included)."""
    call(0)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            call(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)
