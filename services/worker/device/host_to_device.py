"""Host -> GPU copies that never stall the host.

CUDA makes a copy from pageable host memory wait until every kernel already queued on the stream
has finished. Steps are launched while the previous step still runs on the GPU, so one such copy
per step (a torch.from_numpy(...).to("cuda")) silently serialises the host with the GPU. Here
every array goes through page-locked memory and an asynchronous copy; PyTorch's caching host
allocator keeps the staging block alive until its copy has completed.
"""

from __future__ import annotations

import time

import numpy as np
import torch

# Every array starts 16-byte aligned inside the packed buffer: Triton specialises kernels on
# whether each pointer is 16-byte aligned, so varying alignment would compile new variants of a
# kernel mid-serving.
ALIGN = 16
_TORCH_DTYPES: dict[np.dtype, torch.dtype] = {}


def upload(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Copies named numpy arrays to `device` in one asynchronous transfer; returns them as tensors.

    On a CPU device the tensors share the arrays' memory, as torch.from_numpy does.
    """
    arrays = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    if device.type != "cuda":
        return {name: torch.from_numpy(a) for name, a in arrays.items()}
    offsets, total = {}, 0
    for name, a in arrays.items():
        total = -(-total // ALIGN) * ALIGN
        offsets[name] = total
        total += a.nbytes
    staging = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=True)
    host = staging.numpy()
    for name, a in arrays.items():
        host[offsets[name] : offsets[name] + a.nbytes] = a.reshape(-1).view(np.uint8)
    on_device = staging.to(device, non_blocking=True)
    tensors = {}
    for name, a in arrays.items():
        t = on_device[offsets[name] : offsets[name] + a.nbytes].view(torch_dtype(a.dtype))
        tensors[name] = t if a.ndim == 1 else t.view(a.shape)  # each view costs host time
    return tensors


class _GpuWaits:
    """The host's waits in wait_for: time a step thread spent waiting for its own GPU, which a
    spinning synchronize counts as CPU time (WorkerStats: the step thread's CPU less this is its
    own work)."""

    seconds = 0.0
    count = 0


gpu_waits = _GpuWaits()


def wait_for(event: torch.cuda.Event) -> None:
    """Until `event` has completed, asking first: a double-buffered staging's previous copy almost
    always has. Event.synchronize gives the GIL away, and the step thread then waits to take it
    back while the worker's event loop and finisher run Python (py-spy found the step thread
    there: bench/RESULTS.md, "Figures moved from code comments"); query keeps the GIL."""
    if not event.query():
        started = time.perf_counter()
        event.synchronize()
        gpu_waits.seconds += time.perf_counter() - started
        gpu_waits.count += 1


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype (cached: torch.from_numpy on an empty array each time costs)."""
    if dtype not in _TORCH_DTYPES:
        _TORCH_DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    return _TORCH_DTYPES[dtype]
