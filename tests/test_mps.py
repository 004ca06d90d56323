"""`strata serve --mps`: the cluster's own MPS daemon (strata/mps.py), the location flag workers
report, and the scheduler's warning about stages that share a GPU without it. The daemon here
is a stand-in script on PATH that records how it was called."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from strata.v1 import engine_pb2

FAKE_CONTROL = """#!/bin/sh
# Records each call: its arguments, the pipe folder it was pointed at, and its stdin.
echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(if [ -z "$*" ]; then cat; fi)" >> "$MPS_CALLS"
if [ "$1" = "-d" ]; then
  [ -n "$MPS_FAIL" ] && { echo "An instance of this daemon is already running" >&2; exit 1; }
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"
fi
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-cuda-mps-control"
    script.write_text(FAKE_CONTROL)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    calls = tmp_path / "calls"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("MPS_CALLS", str(calls))
    return calls


def test_the_clusters_daemon_starts_in_its_own_folder_and_quits(fake_control, monkeypatch):
    from strata.mps import MpsDaemon, mps_serves_this_process

    daemon = MpsDaemon()
    daemon.start()
    pipe = daemon.env["CUDA_MPS_PIPE_DIRECTORY"]
    assert pipe.startswith(str(daemon.folder)) and Path(daemon.env["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", pipe)  # a service started with the daemon's env
    assert mps_serves_this_process()
    daemon.stop()
    assert fake_control.read_text().splitlines() == [f"args=-d pipe={pipe} stdin=", f"args= pipe={pipe} stdin=quit"]
    assert not daemon.folder.exists() and not mps_serves_this_process()


def test_a_daemon_that_cannot_start_stops_the_cluster_with_its_reason(fake_control, monkeypatch):
    from strata.mps import MpsDaemon

    monkeypatch.setenv("MPS_FAIL", "1")
    daemon = MpsDaemon()
    with pytest.raises(SystemExit, match="already running"):
        daemon.start()
    assert not daemon.folder.exists()
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SystemExit, match="not on PATH"):
        MpsDaemon().start()


def test_mps_is_refused_for_a_cpu_cluster_before_anything_starts():
    from strata.flags import service_args
    from strata.launcher import start_cluster

    args = service_args(["serve", "--device", "cpu", "--mps"])
    with pytest.raises(SystemExit, match="--mps is for stages sharing an NVIDIA GPU"):
        start_cluster(args)


def test_the_pipeline_bench_hands_mps_to_its_clusters():
    import argparse

    from strata.bench.common import serve_argv
    from strata.bench_cli import add_bench_parser

    parser = argparse.ArgumentParser(prog="strata")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "pipeline", "--mps"])
    assert "--mps" in serve_argv(args, "dummy:llama-3.2-1b")
    args = parser.parse_args(["bench", "pipeline"])
    assert "--mps" not in serve_argv(args, "dummy:llama-3.2-1b")


def _stage(gpu: str, mps: bool, host: str = "h") -> engine_pb2.WorkerDescription:
    loc = engine_pb2.WorkerLocation(hostname=host, boot_id="b", ipc_namespace="ipc:[1]", device_uuid=gpu, mps=mps)
    return engine_pb2.WorkerDescription(device="cuda:0", location=loc)


def test_stages_sharing_a_gpu_without_mps_are_named():
    from strata.stage_links import gpus_shared_without_mps

    assert gpus_shared_without_mps([_stage("A", False), _stage("A", False), _stage("B", False)]) == [[0, 1]]
    assert gpus_shared_without_mps([_stage("A", True), _stage("A", True)]) == []  # both under MPS
    assert gpus_shared_without_mps([_stage("A", True), _stage("A", False)]) == [[0, 1]]
    assert gpus_shared_without_mps([_stage("A", False), _stage("B", False)]) == []  # a GPU each
    assert gpus_shared_without_mps([_stage("A", False, "h1"), _stage("A", False, "h2")]) == []
    cpu = engine_pb2.WorkerDescription(device="cpu")
    assert gpus_shared_without_mps([cpu, cpu]) == []
