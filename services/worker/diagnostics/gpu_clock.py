"""Where a pipeline's GPU idles between its stages' steps (a diagnostic, off by default).

Each stage stamps four points of every step on its stream:
  queued  - before the step's waits for other stages (stage 0: tokens; later stages: activations);
  start   - after those waits: the GPU begins the step's own work;
  body    - after the step's graph (and the last stage's draw), before its hand-off;
  handed  - after its hand-off (stage 0..P-2: the activations' send; the last: the tokens' hand).
A stamp is a CUDA event (a few us of host time). Events cannot be compared across processes, so
every REFERENCE_EVERY stamps a one-program kernel reads the GPU's global nanosecond clock
(kernels/globaltimer.py) with an event right behind it; each stamp's time is its reference's time
plus the events' elapsed time. (The first version launched that kernel at every stamp: on a slow
host its launches made the last stage's host the bottleneck.)

A reading does not place its reference exactly. Placed by its own reading, each reference's stamps
stood off the next one's by up to a fraction of a step, and two stages' steps seemed to overlap
(bench/RESULTS.md, "Figures moved from code comments"). Coarse readings (late by up to a tick) of
a clock whose rate differs from the events' would do that; neither was measured apart. So each reference is placed
by the lowest line, over its neighbours' times on the events' clock, that none of their readings
lies above (a reading can only be late); its slope is the two clocks' rate: place_references.
tests/gpu/test_gpu_clock_gpu.py checks the result across two processes.

With one clock for all stages, `python -m strata.bench.gpu_clock DIR` can say for each gap between two
stages' work whether the waiting stage was queued in time (the gap is the hand-off on the GPU) or
late (its host was behind: each stamp also keeps the host's clock at its launch, which the report
maps onto the GPU's). A diagnostic: find gaps with it, benchmark without it.

Enabled by --gpu-clock-dir DIR (env STRATA_GPU_CLOCK_DIR); each GetStats call writes the stamps
taken since the previous one to DIR/stage{index}-{pid}-{call}.npz (a benchmark reads stats before
and after each phase).
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
REFERENCE_EVERY = 64  # stamps between two readings of the global clock (16 steps of 4 stamps)
# References each side that place one (place_references): enough readings at random phases
# against the tick to place it well within a tick (tests/test_gpu_clock_report.py's synthetic
# readings), over a span short enough that the clocks' rate holds.
PLACEMENT_WINDOW = 64
MIN_FIT = 16  # references that fit the clocks' rate; fewer keep the events' own


def place_references(
    readings_ns: np.ndarray, event_ns: np.ndarray, window: int = PLACEMENT_WINDOW
) -> tuple[np.ndarray, np.ndarray]:
    """Each reference's time on the global clock, and the global clock's rate against the events'
    there. readings_ns: the global clock as each reference read it (late by up to a tick);
    event_ns: the references' times on their events' clock, from any origin. The true times lie
    on a line over the events' times, and no reading lies above it: around each reference, over
    `window` references each side, the lowest line above every reading (an edge of their upper
    hull) estimates it."""
    n = len(readings_ns)
    readings_ns = readings_ns.astype(np.int64)
    placed, rate = readings_ns.copy(), np.ones(n)
    for k in range(n):
        lo, hi = max(0, k - window), min(n, k + window + 1)
        # relative to reference k, in float64 (the clock's own values, ~1e18 ns, are not exact there)
        x = event_ns[lo:hi] - event_ns[k]
        y = (readings_ns[lo:hi] - readings_ns[k]).astype(np.float64)
        rate[k], at_k = _lowest_line_above(x, y)
        placed[k] += round(at_k)
    return placed, rate


def _lowest_line_above(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(slope, value at x = 0) of the line above every point (x increasing) whose mean height
    over the points is least: the upper hull's edge over their mean x. Under MIN_FIT points (two
    readings a tick apart could give any slope), or a slope no clock pair has, slope 1."""
    flat = 1.0, float((y - x).max())
    if len(x) < MIN_FIT or x[-1] <= x[0]:
        return flat
    hull: list[int] = []
    for i in range(len(x)):  # the upper hull, left to right (monotone chain)
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (x[b] - x[a]) * (y[i] - y[a]) - (y[b] - y[a]) * (x[i] - x[a]) >= 0:
                hull.pop()  # b lies on or under the line a -> i
            else:
                break
        hull.append(i)
    mean = x.mean()
    for a, b in zip(hull, hull[1:]):
        if x[b] >= mean:
            slope = (y[b] - y[a]) / (x[b] - x[a])
            return (float(slope), float(y[a] - slope * x[a])) if abs(slope - 1) < 0.02 else flat
    return flat


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
        self.needs: list[tuple[int, int]] = []  # stage 0: (step id, the sampling step its tokens came from)
        self.dumps = 0

    @classmethod
    def for_stage(cls, directory: str | None, stage_index: int, device: torch.device) -> GpuClock | None:
        """The stage's clock when --gpu-clock-dir names a directory and the stage runs on a GPU."""
        if not directory or device.type != "cuda":
            return None
        log.warning("GPU clock stamps on (--gpu-clock-dir %s): a diagnostic that slows steps", directory)
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

    def note_need(self, step_id: int, need: int) -> None:
        """Stage 0: the sampling step whose tokens step_id's placeholders waited for on the GPU
        (bench/gpu_clock.py: how far back a step's input lies, and how long the GPU waited)."""
        if need:
            self.needs.append((step_id, need))

    def dump(self) -> Path:
        """The stamps since the last dump, to a file; waits for the GPU (diagnostic only). A stamp
        the step thread takes meanwhile may be dropped."""
        stamps, self.stamps = self.stamps, []
        needs, self.needs = self.needs, []
        self._since_reference = REFERENCE_EVERY  # the next stamp takes a fresh reading
        refs = list(self.references)  # (the step thread may add one after the synchronize)
        torch.cuda.synchronize(self.readings.device)
        # References accumulate over the run: place only those this dump's stamps use, with the
        # neighbours that place them.
        used = [stamp[4] for stamp in stamps]
        first = max(min(used) - PLACEMENT_WINDOW, 0) if used else 0
        refs = refs[first : max(used) + PLACEMENT_WINDOW + 1] if used else []
        readings = self.readings[first : first + len(refs)].cpu().numpy()
        # The references' times on their events' clock: sums of short spans (elapsed_time is a
        # float of milliseconds, coarse across a whole run).
        spans = [refs[k - 1].elapsed_time(refs[k]) * 1e6 for k in range(1, len(refs))]
        event_ns = np.concatenate([[0.0], np.cumsum(spans)]) if refs else np.zeros(0)
        placed, rate = place_references(readings, event_ns)
        kept, t = [], []
        for stamp in stamps:
            k = stamp[4] - first
            try:
                t.append(int(placed[k]) + round(rate[k] * refs[k].elapsed_time(stamp[3]) * 1e6))
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
            ref_reading_ns=readings.astype(np.int64),  # for checking the placement afterwards
            ref_event_ns=event_ns,
            ref_placed_ns=placed,
            ref_rate=rate,
            need=np.asarray(needs, dtype=np.int64).reshape(-1, 2),
        )
        self.dumps += 1
        return path
