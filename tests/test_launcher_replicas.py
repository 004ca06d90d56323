"""`strata serve --data-parallel-size D`: where each worker goes, what is refused, and the
supervisor that starts a worker or scheduler again when it exits. No cluster is started
(tests/test_data_parallel.py runs one)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from strata import launcher
from strata.flags import service_args
from strata.stage_links import gpu_for
from strata.supervision import Supervisor


def serve_args(*argv: str):
    return service_args(["serve", "--model", "dummy:llama-3.2-1b", *argv])


def test_gpu_for_places_replicas_then_stages_then_ranks():
    assert [gpu_for(r, s, num_stages=2) for r in range(2) for s in range(2)] == [0, 1, 2, 3]
    assert gpu_for(1, 0, 1, num_stages=2, tensor_parallel_size=2) == 5  # rank 1 of replica 1's stage 0
    assert gpu_for(0, 3) == 3 and gpu_for(2, 0) == 2


@pytest.mark.parametrize("gpus", [4, 8])
def test_each_replica_s_stages_get_gpus_of_their_own(monkeypatch, gpus):
    monkeypatch.setattr(launcher, "_visible_gpus", lambda args: gpus)
    args = serve_args("--data-parallel-size", "2", "--pipeline-stages", "2", "--device", "cuda")
    launcher.check_placement(args)
    placed = [launcher._worker_settings(args, s, 1, "m", r) for r in range(2) for s in range(2)]
    assert [p["device"] for p in placed] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert all(p["gpu_memory_utilization"] == args.gpu_memory_utilization for p in placed)
    assert [p["stage_index"] for p in placed] == [0, 1, 0, 1] and all(p["num_stages"] == 2 for p in placed)


def test_one_replica_keeps_its_placement(monkeypatch):
    """Without data parallelism stages still round-robin over fewer GPUs, splitting the share."""
    monkeypatch.setattr(launcher, "_visible_gpus", lambda args: 1)
    args = serve_args("--pipeline-stages", "2")
    launcher.check_placement(args)
    placed = [launcher._worker_settings(args, s, 1, "m") for s in range(2)]
    assert [p["device"] for p in placed] == ["cuda:0", "cuda:0"]
    assert placed[0]["gpu_memory_utilization"] == pytest.approx(args.gpu_memory_utilization / 2)


def test_profiles_go_to_a_file_per_worker(monkeypatch):
    monkeypatch.setattr(launcher, "_visible_gpus", lambda args: 0)
    args = serve_args("--data-parallel-size", "2", "--pipeline-stages", "2", "--profile-output", "p.txt")
    assert launcher._worker_settings(args, 1, 1, "m", 1)["profile_output"] == "p.txt.replica1.stage1"
    args = serve_args("--data-parallel-size", "2", "--profile-output", "p.txt")
    assert launcher._worker_settings(args, 0, 1, "m", 1)["profile_output"] == "p.txt.replica1"


@pytest.mark.parametrize(
    "argv,gpus,message",
    [
        (("--pipeline-stages", "2"), 3, "needs 4 GPUs; 3 visible"),
        (("--device", "cuda:1"), 8, "names one GPU"),
        (("--mps",), 8, "--mps is for stages sharing one GPU"),
    ],
)
def test_replicas_without_gpus_of_their_own_are_refused(monkeypatch, argv, gpus, message):
    monkeypatch.setattr(launcher, "_visible_gpus", lambda args: gpus)
    with pytest.raises(SystemExit, match=message):
        launcher.check_placement(serve_args("--data-parallel-size", "2", *argv))


def test_replicas_on_cpus_are_fine():
    launcher.check_placement(serve_args("--data-parallel-size", "3", "--pipeline-stages", "2", "--device", "cpu"))


class FakeCluster:
    def __init__(self, *names_and_codes):
        self.procs = [(name, self._spawn(code)) for name, code in names_and_codes]
        for _, proc in self.procs:
            proc.wait()

    @staticmethod
    def _spawn(code: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({code})"])

    def service_env(self):
        return None


def test_the_supervisor_restarts_an_exited_service_within_its_limit():
    cluster = FakeCluster(("replica 1 scheduler", 3), ("gateway", None))
    cluster.procs[1] = ("gateway", subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    try:
        supervisor = Supervisor(cluster, limit=2, window=60.0, backoff=1.0)
        first = cluster.procs[0][1]
        assert supervisor.check(now=100.0) is None and cluster.procs[0][1] is first  # within the backoff
        assert supervisor.check(now=101.5) is None
        restarted = cluster.procs[0][1]
        assert restarted is not first and restarted.args == first.args
        assert supervisor.log == ["replica 1 scheduler exited with code 3; started again"]
        restarted.wait()
        assert supervisor.check(now=103.0) is None and supervisor.check(now=104.5) is None
        assert cluster.procs[0][1] is not restarted  # the second restart of the minute
        cluster.procs[0][1].wait()
        assert supervisor.check(now=106.0) is None
        assert "exited 3 times within 60 s" in supervisor.check(now=107.5)
        # A minute after the first restarts the budget is back.
        assert supervisor.check(now=170.0) is None and cluster.procs[0][1].args == first.args
        cluster.procs[0][1].wait()
    finally:
        cluster.procs[1][1].kill()
        cluster.procs[1][1].wait()


def test_the_gateway_exiting_or_no_restarts_stop_the_cluster():
    assert "gateway exited with code 0" in Supervisor(FakeCluster(("gateway", 0)), limit=5).check()
    assert "worker 0 exited with code 1" in Supervisor(FakeCluster(("worker 0", 1)), limit=0).check()


def test_ports_handed_out_are_below_the_range_of_outgoing_connections(monkeypatch):
    ports = [launcher.free_port() for _ in range(200)]
    assert len(set(ports)) == 200  # never the same one twice
    start = launcher._ephemeral_range_start()
    if start > launcher._LOWEST_PORT:  # (Linux) an outgoing connection's source port never takes one
        assert all(launcher._LOWEST_PORT <= p < start for p in ports)
    # Without a range to keep below, the OS picks, as before.
    monkeypatch.setattr(launcher, "_ephemeral_range_start", lambda: 0)
    assert launcher.free_port() > 0
