"""Where a pipeline's GPU idles between its stages' steps (a diagnostic, off by default).

Each stage queues a GPU timestamp (kernels/globaltimer.py) at four points of every step:
  queued  - before the step's waits for other stages (stage 0: tokens; later stages: activations);
  start   - after those waits: the GPU begins the step's own work;
  body    - after the step's graph (and the last stage's draw), before its hand-off;
  handed  - after its hand-off (stage 0..P-2: the activations' send; the last: the tokens' hand).
The stamps share one clock across processes, so `python -m strata.bench.gpu_clock DIR` can say for
each gap between two stages' work whether the waiting stage was queued in time (the gap is the
hand-off on the GPU) or late (its host was behind: each stamp also keeps the host's clock at its
launch, which the report maps onto the GPU's clock). Each stamp is a kernel launch (about 10 us of
host time, a few us of GPU): use it to find gaps, not to benchmark.

Enabled by STRATA_GPU_CLOCK_DIR; each GetStats call writes the stamps taken since the previous
one to DIR/stage{index}-{pid}-{call}.npz (a benchmark reads stats before and after each phase).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("strata.worker")

POINTS = ("queued", "start", "body", "handed")


class GpuClock:
    def __init__(self, directory: str, stage_index: int, device: torch.device, capacity: int = 1 << 20):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.stage_index = stage_index
        self.times = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.keys: list[tuple[int, int, int]] = []  # (step_id, point, host ns at its launch) of stamp i
        self.dumped = 0  # stamps [0, dumped) are written out
        self.dumps = 0

    @classmethod
    def from_env(cls, stage_index: int, device: torch.device) -> GpuClock | None:
        directory = os.environ.get("STRATA_GPU_CLOCK_DIR")
        if not directory or device.type != "cuda":
            return None
        log.warning("GPU clock stamps on (STRATA_GPU_CLOCK_DIR=%s): a diagnostic that slows steps", directory)
        return cls(directory, stage_index, device)

    def stamp(self, step_id: int, point: str) -> None:
        """On the step thread, on its current stream."""
        from strata.kernels.globaltimer import stamp

        index = len(self.keys)
        if index >= self.times.numel():
            return  # full: later stamps are dropped
        self.keys.append((step_id, POINTS.index(point), time.perf_counter_ns()))
        stamp(self.times, index)

    def dump(self) -> Path:
        """The stamps since the last dump, to a file; waits for the GPU (diagnostic only). A stamp
        the step thread queues meanwhile may read 0 here (the report drops those)."""
        n = len(self.keys)
        torch.cuda.synchronize(self.times.device)
        keys = np.asarray(self.keys[self.dumped : n], dtype=np.int64).reshape(-1, 3)
        times = self.times[self.dumped : n].cpu().numpy()
        path = self.directory / f"stage{self.stage_index}-{os.getpid()}-{self.dumps}.npz"
        np.savez(path, step_id=keys[:, 0], point=keys[:, 1], host_ns=keys[:, 2], t_ns=times, stage=self.stage_index)
        self.dumped, self.dumps = n, self.dumps + 1
        return path
