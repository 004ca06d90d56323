"""The compile-time half of a Triton launch, named, so that the launch itself and the lists of
variants that warm-up and compile_check compile are one object."""

from __future__ import annotations

from dataclasses import dataclass


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
