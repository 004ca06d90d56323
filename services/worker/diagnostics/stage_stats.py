"""A stage's own timeline (WorkerStats, `strata bench pipeline`): the time inside its steps and
between them, per stage, so a pipeline's bubbles show on every stage, not only the last.

On a GPU the times come from CUDA events: the runner's start event, recorded just before a
step's first kernel is queued (after stage 0's wait for tokens), and an end event recorded here
after its last launch; the GPU reaches the start event when the previous step's work is done or
when the host queued it, so end(k) -> start(k+1) is the GPU's idle time between steps. Pairs are
read once complete (query, never a wait on the step thread). On a CPU a step runs while it is
launched: host time.
"""

from __future__ import annotations

import collections
import time

import torch

from strata.services.worker.device import cuda_driver


class StageStats:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.steps = 0
        self.busy_seconds = 0.0
        self.idle_seconds = 0.0
        self.timed_steps = 0
        self.launch_seconds = 0.0
        self.input_wait_seconds = 0.0
        self.step_thread_cpu_seconds = 0.0  # between consecutive launches (waits take none)
        self._last_cpu: float | None = None
        self._pairs: collections.deque = collections.deque()
        self._last_end = None

    def step(self, gpu_start, host_start: float, host_waited: float = 0.0, after_idle: bool = False) -> None:
        """After a step's launch, on the step thread: gpu_start is the runner's start event
        (None on CPU); host_waited the host time it spent waiting for tokens inside the launch;
        after_idle: the scheduler had nothing to run before it (StepPlan.after_idle), so the
        time since the previous step is no bubble and counts as neither."""
        now, cpu = time.perf_counter(), time.thread_time()
        if self._last_cpu is not None:
            self.step_thread_cpu_seconds += cpu - self._last_cpu
        self._last_cpu = cpu
        self.steps += 1
        self.launch_seconds += now - host_start - host_waited
        if not self.cuda or gpu_start is None:
            begin = host_start + host_waited
            if self._last_end is not None and not after_idle:
                self.idle_seconds += max(begin - self._last_end, 0.0)
            self.busy_seconds += now - begin
            self._last_end = now
            self.timed_steps += 1
            return
        end = cuda_driver.timing_event(self.device)
        self._pairs.append((gpu_start, end, after_idle))
        self.poll()

    def poll(self, wait: bool = False) -> None:
        while self._pairs:
            start, end, after_idle = self._pairs[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self._pairs.popleft()
            self.busy_seconds += start.elapsed_time(end) / 1e3
            if self._last_end is not None and not after_idle:
                self.idle_seconds += max(self._last_end.elapsed_time(start) / 1e3, 0.0)
            self._last_end = end
            self.timed_steps += 1
