"""The cross-stage GPU clock report (bench/gpu_clock.py) on hand-made stamps: each gap between two
stages' steps is charged to the right cause; and the placement of each stage's references on the
global clock (services/worker/diagnostics/gpu_clock.py) through coarse readings of a clock that runs apart."""

import numpy as np

from strata.bench import gpu_clock
from strata.services.worker.diagnostics.gpu_clock import POINTS, GpuClock

US = 1000


def _write(path, stage, rows, **extra):
    """rows: (step_id, point, gpu_us, host_us)."""
    a = np.asarray([(s, POINTS.index(p), h * US, g * US) for s, p, g, h in rows], dtype=np.int64)
    np.savez(path, step_id=a[:, 0], point=a[:, 1], host_ns=a[:, 2], t_ns=a[:, 3], stage=stage, **extra)


def test_gaps_are_charged_to_the_hand_off_or_the_late_host(tmp_path):
    # Host clock = GPU clock - 5 us launch latency at best. Stage 0: steps 0 and 1, 100 us each.
    # Stage 1, step 0: queued and started in time, begins 30 us after stage 0 handed: hand-off.
    # Stage 1, step 1: its start launched 20 us after stage 0's step 1 ended: 20 us host late
    # (queued in time: it waited on its host for the peer), then 10 us of hand-off.
    s0 = [
        (0, "queued", 0, -5),
        (0, "start", 0, -5),
        (0, "body", 90, 50),
        (0, "handed", 100, 60),
        (1, "queued", 300, 200),
        (1, "start", 300, 200),
        (1, "body", 390, 250),
        (1, "handed", 400, 260),
    ]
    s1 = [
        (0, "queued", 50, 45),
        (0, "start", 130, 45),
        (0, "body", 200, 40),
        (0, "handed", 220, 45),
        (1, "queued", 380, 300),
        (1, "start", 430, 415),
        (1, "body", 500, 420),
        (1, "handed", 520, 425),
    ]
    rates = np.array([1.0033, 1.0034, 1.0035])
    _write(tmp_path / "stage0-11-3.npz", 0, [(s, p, g + 1000, h) for s, p, g, h in s0], ref_rate=rates)
    _write(tmp_path / "stage1-12-3.npz", 1, [(s, p, g + 1000, h) for s, p, g, h in s1])
    (stages,) = gpu_clock.load(str(tmp_path), 3)
    r = gpu_clock.analyse(stages, max_gap_ns=2e6)
    causes = {k: {n: sum(v) / US for n, v in parts.items()} for k, parts in r["causes"].items()}
    assert causes["stage 0 -> stage 1"] == {
        "hand-off on the GPU": 30 + 10,
        "host late: waited on the host for a peer": 20,
    }
    assert causes["stage 1 -> stage 0"] == {"hand-off on the GPU": 80}
    assert r["idle_ns"] == (30 + 80 + 30) * US
    assert r["busy_ns"] == (100 + 90 + 100 + 90) * US
    assert "stage 0 -> stage 1: 30.0 us a step" in gpu_clock.report(r, 2)
    assert "stage 0 placed by 3 references; global clock against its events' clock: rate 1.00340" in (
        gpu_clock.breakdown(stages)
    )
    # the host's side of stage 1: step 1's first launch 255 us after step 0's last; its GPU began
    # step 0 80 us and step 1 10 us after the launch (host clock + the 5 us offset)
    host = r["segments"][1]
    assert host["host: previous handed -> queued"] == [255 * US]
    assert sorted(host["host: GPU start - its launch"]) == [10 * US, 80 * US]


def test_long_gaps_are_no_bubble(tmp_path):
    s0 = [(0, "start", 1, 0), (0, "handed", 101, 0), (1, "start", 10_101, 10_000), (1, "handed", 10_201, 10_000)]
    _write(tmp_path / "stage0-11-0.npz", 0, s0)
    (stages,) = gpu_clock.load(str(tmp_path), None)
    r = gpu_clock.analyse(stages, max_gap_ns=2e6)
    assert (r["idle_ns"], r["skipped_gaps"], r["busy_ns"]) == (0, 1, 200 * US)


def test_off_without_the_directory_or_a_gpu(tmp_path):
    import torch

    assert GpuClock.for_stage(None, 0, torch.device("cuda")) is None
    assert GpuClock.for_stage("", 0, torch.device("cuda")) is None
    assert GpuClock.for_stage(str(tmp_path), 0, torch.device("cpu")) is None


def test_the_directory_is_a_worker_flag_and_its_environment_variable(monkeypatch, tmp_path):
    from strata.flags import service_args

    monkeypatch.delenv("STRATA_GPU_CLOCK_DIR", raising=False)
    assert service_args(["worker"]).gpu_clock_dir is None
    assert service_args(["worker", "--gpu-clock-dir", str(tmp_path)]).gpu_clock_dir == str(tmp_path)
    monkeypatch.setenv("STRATA_GPU_CLOCK_DIR", str(tmp_path))
    assert service_args(["serve"]).gpu_clock_dir == str(tmp_path)  # forwarded to every worker


def test_event_stamps_land_on_the_global_clock_through_their_reference(monkeypatch, tmp_path):
    """GpuClock on a simulated GPU: events carry a local clock (ms, as CUDA's elapsed_time), each
    reference reads the global one; a stamp's time is its reference's reading + elapsed time."""
    import torch

    from strata.kernels import globaltimer
    from strata.services.worker.diagnostics import gpu_clock as clock_module

    now = {"local_ms": 0.0}
    skew_ns = 5_000_000_000  # the global clock's reading when the local one reads 0

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self, stream=None):
            self.at = now["local_ms"]

        def elapsed_time(self, other):
            return other.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(globaltimer, "stamp", lambda out, i: out.__setitem__(i, skew_ns + round(now["local_ms"] * 1e6)))
    monkeypatch.setattr(clock_module, "REFERENCE_EVERY", 2)
    clock = clock_module.GpuClock(str(tmp_path), 0, torch.device("cpu"))
    for step in range(3):  # 3 steps of 2 stamps: a reference before each step
        now["local_ms"] = step * 1.0
        clock.stamp(step, "start")
        now["local_ms"] = step * 1.0 + 0.25
        clock.stamp(step, "handed")
    d = np.load(clock.dump())
    assert len(clock.references) == 3
    want = [skew_ns + round(ms * 1e6) for ms in (0.0, 0.25, 1.0, 1.25, 2.0, 2.25)]
    assert list(d["t_ns"]) == want
    assert list(d["step_id"]) == [0, 0, 1, 1, 2, 2]


def test_references_are_placed_through_a_coarse_clock_that_runs_apart_from_the_events():
    # 300 references 20-30 ms apart on the events' clock; the global clock runs 0.33% faster and
    # its readings show only 0.8 ms ticks (as on an H200, session 14); the events' clock has
    # 0.3 us of noise.
    from strata.services.worker.diagnostics.gpu_clock import place_references

    rng = np.random.default_rng(0)
    event = np.cumsum(rng.uniform(20e6, 30e6, 300))
    event -= event[0]
    true = 1_700_000_000_000_000_000 + 123_456 + (1 + 0.0033) * event
    readings = (np.floor(true / 800_000) * 800_000).astype(np.int64)
    placed, rate = place_references(readings, event + rng.normal(0, 300, event.size))
    old_error, error = (readings - true) / US, (placed - true) / US
    assert old_error.min() < -700  # placed by its own reading, a reference could be 0.7 ms off
    assert -50 < error.min() and error.max() < 2 and abs(np.median(error)) < 10, np.percentile(error, [0, 50, 100])
    assert abs(rate[150] - 1.0033) < 2e-5
    # fewer than MIN_FIT references: the events' rate, at the highest reading carried along them
    # (the second reading shows the clock 500 us later than the first's, 1 ms of events apart)
    one, rate_one = place_references(readings[:1], event[:1])
    assert one[0] == readings[0] and rate_one[0] == 1.0
    two, rate_two = place_references(np.array([1_000_000, 1_500_000]), np.array([0.0, 1_000_000.0]))
    assert two.tolist() == [1_000_000, 2_000_000] and rate_two.tolist() == [1.0, 1.0]


def test_stage_0s_token_waits_by_how_far_back_their_tokens_lie(tmp_path):
    # Stage 0, step 2 needs step 0's tokens (2 back): queued at 300, the last stage handed step 0 at
    # 340, stage 0 started at 350 (a 50 us wait: the tokens 40 us late, started 10 us after them).
    # Step 3 needs step 1's (2 back), handed long before it was queued: started 5 us after queued.
    s0 = [
        (0, "queued", 0, 0),
        (0, "start", 0, 0),
        (0, "handed", 100, 0),
        (1, "queued", 100, 0),
        (1, "start", 100, 0),
        (1, "handed", 200, 0),
        (2, "queued", 300, 0),
        (2, "start", 350, 0),
        (2, "handed", 450, 0),
        (3, "queued", 900, 0),
        (3, "start", 905, 0),
        (3, "handed", 1000, 0),
    ]
    s1 = [(0, "start", 200, 0), (0, "handed", 340, 0), (1, "start", 340, 0), (1, "handed", 480, 0)]
    _write(tmp_path / "stage0-11-1.npz", 0, s0, need=np.array([[2, 0], [3, 1]]))
    _write(tmp_path / "stage1-12-1.npz", 1, s1)
    (stages,) = gpu_clock.load(str(tmp_path), 1)
    text = gpu_clock.breakdown(stages)
    line = next(t for t in text.splitlines() if "2 back" in t)
    assert "2 steps (100.0%)" in line and "GPU wait    27.5 us" in line
    assert "tokens handed  -190.0 us after queued" in line and "started    7.5 us after both" in line
