"""The compile-time half of a Triton launch, named, so that the launch itself and the lists of
variants that warm-up and compile_check compile are one object; and the SM count that launch
heuristics size their grids for."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelLaunch:
    """The compile-time half of a launch (constexprs, warps, stages), shared by the launch itself
    and by the list of variants that compile_check and warm-up compile."""

    name: str
    kernel: object
    constexprs: dict
    num_warps: int
    num_stages: int = 1

    def __call__(self, grid, *args, **options) -> None:
        """options: launch options only (launch_pdl), never a compile-time value."""
        self.kernel[grid](*args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages, **options)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sm_count(device: torch.device) -> int:
    """The SMs a launch heuristic sizes its grid for."""
    if device.type != "cuda":
        return 132  # interpreter runs: behave as on an H100 so heuristics are exercised the same way
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
