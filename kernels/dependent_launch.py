"""Programmatic dependent launch (PDL, sm_90+): a kernel's programs may start while the kernel
before it in the stream is still running, and wait for it (gdc_wait) only where they first read
what it wrote.

At decode batch 1 a layer is a chain of kernels of a few microseconds each; between two of them
the GPU drains, launches and ramps up again. A kernel in a PDL chain calls gdc_launch_dependents
as it starts (its successor may then be scheduled on the SMs it leaves free), issues the loads
that do not depend on its predecessor (weights, step inputs), and only then calls gdc_wait.
Every kernel of a chain must call gdc_wait before it touches data another kernel of the step
reads or writes: the wait returns once the predecessor has completed, and the predecessor
completed only after its own wait, so ordering holds transitively along the chain.

A server always launches so where the GPU supports it. Benchmarks that time what PDL is worth
turn it off within their own process (plain_launches); the kernels' gdc calls are then no-ops.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_plain = False  # plain_launches() is active: no kernel is launched as a programmatic dependent


@functools.cache
def _sm90_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def dependent_launch_supported(device: torch.device) -> bool:
    """Whether kernels on `device` may be launched as programmatic dependents."""
    if device.type != "cuda" or _plain:
        return False
    return _sm90_or_later(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(enabled: bool) -> dict:
    """Extra keyword arguments of a Triton launch: the PDL attribute when enabled."""
    return {"launch_pdl": True} if enabled else {}


@contextlib.contextmanager
def plain_launches():
    """Within the block, kernels launch plainly (no PDL): benchmarks' A/B only. Read at every
    launch, so CUDA graphs captured within the block keep plain launches when replayed later."""
    global _plain
    previous, _plain = _plain, True
    try:
        yield
    finally:
        _plain = previous
