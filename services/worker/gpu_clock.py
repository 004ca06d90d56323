"""Where a pipeline's GPU idles between its stages' steps (a diagnostic, off by default).

Each stage stamps four points of every step on its stream:
  queued  - before the step's waits for other stages (stage 0: tokens; later stages: activations);
  start   - after those waits: the GPU begins the step's own work;
  body    - after the step's graph (and the last stage's draw), before its hand-off;
  handed  - after its hand-off (stage 0..P-2: the activations' send; the last: the tokens' hand).
A stamp is a CUDA event (a few us of host time). Events cannot be compared across processes, so
every REFERENCE_EVERY stamps a one-program kernel reads the GPU's global nanosecond clock
(kernels/globaltimer.py) with an event right behind it; each stamp's time is its reference's
reading plus the events' elapsed time. (The first version launched that kernel at every stamp: on
a slow host its launches, 35-90 us each, made the last stage's host the bottleneck.) With one
clock for all stages, `python -m strata.bench.gpu_clock DIR` can say for each gap between two
stages' work whether the waiting stage was queued in time (the gap is the hand-off on the GPU) or
late (its host was behind: each stamp also keeps the host's clock at its launch, which the report
maps onto the GPU's). A diagnostic: find gaps with it, benchmark without it.

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
REFERENCE_EVERY = 256  # stamps between two readings of the global clock (the event clock drifts)


class GpuClock:
    def __init__(self, directory: str, stage_index: int, device: torch.device, references: int = 1 << 16):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.stage_index = stage_index
        self.readings = torch.zeros(references, dtype=torch.int64, device=device)  # the references' clock
        self.references: list[torch.cuda.Event] = []  # the event behind each reading
        # (step_id, point, host ns at the record, event, its reference), in stream order
        self.stamps: list[tuple[int, int, int, torch.cuda.Event, int]] = []
        self._since_reference = REFERENCE_EVERY
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
        if self._since_reference >= REFERENCE_EVERY and not self._reference():
            return  # out of references: later stamps are dropped
        event, host = torch.cuda.Event(enable_timing=True), time.perf_counter_ns()
        event.record()
        self.stamps.append((step_id, POINTS.index(point), host, event, len(self.references) - 1))
        self._since_reference += 1

    def _reference(self) -> bool:
        from strata.kernels.globaltimer import stamp

        index = len(self.references)
        if index >= self.readings.numel():
            return False
        stamp(self.readings, index)
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # (it completes a few us after the reading: the same bias in every process)
        self.references.append(event)
        self._since_reference = 0
        return True

    def dump(self) -> Path:
        """The stamps since the last dump, to a file; waits for the GPU (diagnostic only). A stamp
        the step thread takes meanwhile may be dropped."""
        stamps, self.stamps = self.stamps, []
        self._since_reference = REFERENCE_EVERY  # the next stamp takes a fresh reading
        torch.cuda.synchronize(self.readings.device)
        readings = self.readings[: len(self.references)].cpu().numpy()
        kept, t = [], []
        for stamp in stamps:
            try:
                t.append(int(readings[stamp[4]]) + round(self.references[stamp[4]].elapsed_time(stamp[3]) * 1e6))
            except RuntimeError:  # recorded after the synchronize above
                continue
            kept.append(stamp[:3])
        keys = np.asarray(kept, dtype=np.int64).reshape(-1, 3)
        path = self.directory / f"stage{self.stage_index}-{os.getpid()}-{self.dumps}.npz"
        np.savez(
            path,
            step_id=keys[:, 0],
            point=keys[:, 1],
            host_ns=keys[:, 2],
            t_ns=np.asarray(t, dtype=np.int64),
            stage=self.stage_index,
        )
        self.dumps += 1
        return path
