"""Optional profile of a window of a worker's steps, taken inside the running service.

The in-process benchmarks time the model alone; this shows where a serving worker's GPU time
goes under real traffic (kernels, and the gaps between them that host work leaves). Enabled by
`strata worker --profile-output PATH` (env STRATA_PROFILE_OUTPUT); the table of GPU kernels over
steps [first, first + count) is written to PATH. A PATH whose name holds ".json" gets a Chrome
trace instead, host and GPU on one clock (chrome://tracing, Perfetto): where the gaps between a
pipeline's steps are, which thread the GPU waited for, and the step thread's Python calls (the
window starts and ends on the step thread: server._on_step_thread). Tracing, and writing the
table or trace (seconds, on the step thread), slow the worker: use it for profiles, not for
benchmarks.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger("strata.worker")


class StepProfiler:
    def __init__(self, output: str | None, first: int = 200, count: int = 100):
        self.output = Path(output) if output else None
        self.trace = self.output is not None and ".json" in self.output.name
        if self.output is not None and torch.cuda.is_available():
            # The first profiler of a process initialises CUPTI, for seconds: on a served step
            # the scheduler took the stage for hung and rebuilt the pipeline mid-window.
            with self._profile():
                pass
        self.first, self.count = first, count
        self.steps = 0
        self._profiler = None
        self._started = 0.0

    @classmethod
    def from_flags(cls, output: str | None, steps: str) -> StepProfiler:
        """--profile-output PATH and --profile-steps FIRST:COUNT."""
        try:
            first, count = (int(part) for part in steps.split(":"))
        except ValueError:
            raise SystemExit(f"--profile-steps takes FIRST:COUNT, got {steps!r}") from None
        if first < 0 or count < 1:
            raise SystemExit(f"--profile-steps: FIRST >= 0 and COUNT >= 1, got {steps!r}")
        return cls(output, first, count)

    def step_launched(self) -> None:
        """Called once per step, before it is launched."""
        if self.output is None:
            return
        if self.steps == self.first:
            self._profiler = self._profile()
            self._profiler.__enter__()
            self._started = time.perf_counter()
        elif self.steps == self.first + self.count and self._profiler is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - self._started
            self._profiler.__exit__(None, None, None)
            if self.output.exists():  # another cluster's worker wrote it (a benchmark's runs)
                self.output = self.output.with_name(f"{self.output.name}.{os.getpid()}")
            if self.trace:
                self._profiler.export_chrome_trace(str(self.output))
            else:
                self._write_table(wall)
            log.info("wrote the profile of %d steps (wall %.3f s) to %s", self.count, wall, self.output)
            self._profiler = None
        self.steps += 1

    def _profile(self) -> torch.profiler.profile:
        """A table: the GPU's work alone. A trace: the GPU's, every thread's CPU ops and host
        synchronisations, and the Python calls of the thread that starts it (the step thread)."""
        if not self.trace:
            return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        return torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU],
            with_stack=True,
            experimental_config=torch._C._profiler._ExperimentalConfig(
                profile_all_threads=True, enable_cuda_sync_events=True
            ),
        )

    def _write_table(self, wall: float) -> None:
        averages = self._profiler.key_averages()
        table = averages.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
        gpu = sum(e.self_device_time_total for e in averages) / 1e6
        self.output.write_text(
            f"steps {self.first}..{self.first + self.count}: wall {wall:.3f} s, "
            f"GPU kernels and copies {gpu:.3f} s ({gpu / wall:.0%})\n{table}\n"
        )
