"""CUDA-graph capture for the GPU tests, the way torch documents it: one eager call on a side
stream first (Triton compiles and cuBLAS plans outside the capture), then the capture."""

from __future__ import annotations


def capture_graph(fn, calls: int = 1):
    """(graph, what the last captured call returned) for `calls` calls of fn() captured back to back."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            outputs = fn()
    return graph, outputs
