"""GPU -> host copies of a step's results that keep the GIL: queued behind the step through the
driver (cuda_driver.py) into page-locked buffers that are used again.

`x.to("cpu", non_blocking=True)` gave the GIL away twice, in torch's copy and in its caching host
allocator, and the step thread then waited to take it back from the event loop or the finisher:
py-spy put PendingResult's copies at 6.4% of the 1B's last stage (bench/RESULTS.md, "Where the
1B pipeline's time goes"). The host side is a numpy view, since numpy's slicing keeps the GIL and
torch's views do not.
"""

from __future__ import annotations

import numpy as np
import torch

from strata.services.worker.device import cuda_driver

_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}
_SMALLEST = 256  # bytes: buffers come in powers of two from here
# Every buffer ever made, by size, free or lent. None goes back to torch: a result dropped with
# its copy still queued (a failed step) would otherwise hand torch's allocator memory that the
# GPU is about to write.
_free: dict[int, list[np.ndarray]] = {}
_made: list[np.ndarray] = []


class HostCopies:
    """One step's copies: take() each tensor on the step thread, read the arrays once the step's
    end event has completed, then give_back() on the finisher."""

    __slots__ = ("_lent",)

    def __init__(self):
        self._lent: list[np.ndarray] = []

    def take(self, x: torch.Tensor) -> np.ndarray | torch.Tensor:
        """x's values on the host once the work queued so far on the current stream is done (a
        numpy array), or a tensor where the driver cannot copy it (CPU, other dtypes)."""
        dtype = _NUMPY_DTYPES.get(x.dtype)
        if x.device.type != "cuda" or dtype is None or not x.is_contiguous() or not cuda_driver.available():
            return x.to("cpu", non_blocking=True)
        nbytes = x.numel() * x.element_size()
        size = max(_SMALLEST, 1 << max(nbytes - 1, 0).bit_length())
        free = _free.setdefault(size, [])
        try:
            buffer = free.pop()
        except IndexError:
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
            _made.append(buffer)
        self._lent.append(buffer)
        if nbytes:
            cuda_driver.copy(buffer.ctypes.data, x.data_ptr(), nbytes, cuda_driver.current_stream(x.device))
        return buffer[:nbytes].view(dtype).reshape(x.shape)

    def give_back(self) -> None:
        """The arrays take() returned are read: their buffers serve later steps."""
        for buffer in self._lent:
            _free[buffer.nbytes].append(buffer)
        self._lent.clear()
