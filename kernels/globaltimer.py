"""One GPU timestamp: a one-program kernel stores %globaltimer (nanoseconds, one clock for every
SM and every process on the GPU) at out[index]. CUDA events cannot be compared across processes;
these stamps can, so two stages sharing a GPU land on one timeline (services/worker/diagnostics/gpu_clock.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _stamp_kernel(out_ptr, index):
    tl.store(out_ptr + index, tl.extra.cuda.globaltimer())


def stamp(out: torch.Tensor, index: int) -> None:
    """Queues the stamp on the current stream: out[index] = the GPU's clock when the stream got there."""
    _stamp_kernel[(1,)](out, index)
