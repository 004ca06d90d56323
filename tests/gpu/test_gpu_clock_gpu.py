"""The GPU clock stamp (kernels/globaltimer.py) and its recorder: stamps come back in stream order,
on one nanosecond clock, and a kernel of known length between two stamps shows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_stamps_bracket_a_kernel_of_known_length(tmp_path, monkeypatch):
    from strata.services.worker.gpu_clock import POINTS, GpuClock

    monkeypatch.setenv("STRATA_GPU_CLOCK_DIR", str(tmp_path))
    clock = GpuClock.from_env(1, torch.device("cuda:0"))
    clock.stamp(7, "queued")  # compiles
    clock.dump()
    torch.cuda.synchronize()
    for step in range(3):
        clock.stamp(step, "start")
        torch.cuda._sleep(2_000_000)  # about 1 ms of GPU cycles
        clock.stamp(step, "handed")
    d = np.load(clock.dump())
    assert list(d["step_id"]) == [0, 0, 1, 1, 2, 2] and int(d["stage"]) == 1
    assert list(d["point"]) == [POINTS.index("start"), POINTS.index("handed")] * 3
    t = d["t_ns"]
    assert (np.diff(t) > 0).all()
    lengths = t[1::2] - t[::2]
    assert (lengths > 200_000).all() and (lengths < 50_000_000).all(), lengths
    assert (d["host_ns"] > 0).all()
