"""`strata serve --tensor-parallel-size T`: where each rank goes (composed with the pipeline and
data-parallel replicas), the flags each rank's worker gets, and what is refused. No cluster is
started (tests/test_tensor_parallel_e2e.py runs one)."""

from __future__ import annotations

import pytest

from strata import launcher
from strata.flags import service_args


def serve_args(*argv: str):
    return service_args(["serve", "--model", "dummy:llama-3.2-1b", *argv])


def test_ranks_sit_side_by_side_within_each_stage_of_each_replica(monkeypatch):
    monkeypatch.setattr(launcher, "_visible_gpus", lambda args: 8)
    args = serve_args("--tensor-parallel-size", "2", "--pipeline-stages", "2", "--data-parallel-size", "2")
    launcher.check_placement(args)
    placed = [
        launcher._worker_settings(args, stage, 1, "m", replica, rank, f"127.0.0.1:{9000 + stage}")
        for replica in range(2)
        for stage in range(2)
        for rank in range(2)
    ]
    assert [p["device"] for p in placed] == [f"cuda:{i}" for i in range(8)]
    assert all(p["gpu_memory_utilization"] == args.gpu_memory_utilization for p in placed)  # a GPU each
    assert [p["tensor_parallel_rank"] for p in placed] == [0, 1] * 4
    argv = launcher.worker_argv(args, 1, 50061, "m", 0, 1, "127.0.0.1:9001")
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--tensor-parallel-rank") + 1] == "1"
    assert argv[argv.index("--tensor-parallel-master") + 1] == "127.0.0.1:9001"
    assert argv[argv.index("--stage-index") + 1] == "1"


def test_one_rank_keeps_the_old_flags(monkeypatch):
    monkeypatch.setattr(launcher, "_visible_gpus", lambda args: 0)
    argv = launcher.worker_argv(serve_args(), 0, 50061, "m")
    assert "--tensor-parallel-master" not in argv
    assert argv[argv.index("--tensor-parallel-rank") + 1] == "0"


@pytest.mark.parametrize(
    "argv,gpus,message",
    [
        (("--pipeline-stages", "2"), 3, "needs 4 GPUs; 3 visible"),
        (("--data-parallel-size", "2"), 2, "needs 4 GPUs; 2 visible"),
        (("--device", "cuda:1"), 8, "names one GPU"),
        (("--mps",), 8, "tensor-parallel ranks take a GPU each"),
        (("--speculative-method", "draft", "--draft-num-layers", "1"), 8, "a draft model's worker"),
        (("--tensor-parallel-size", "0"), 8, "must be at least 1"),
    ],
)
def test_ranks_without_a_gpu_each_are_refused(monkeypatch, argv, gpus, message):
    monkeypatch.setattr(launcher, "_visible_gpus", lambda args: gpus)
    with pytest.raises(SystemExit, match=message):
        launcher.check_placement(serve_args("--tensor-parallel-size", "2", *argv))


@pytest.mark.parametrize("device,gpus", [("cuda", 1), ("cuda:0", 4)])
def test_gloo_ranks_share_a_gpu_each_with_its_share_of_memory(monkeypatch, device, gpus):
    """NCCL refuses two ranks on one GPU; gloo's collectives do not, so one GPU can check a stage."""
    monkeypatch.setattr(launcher, "_visible_gpus", lambda args: gpus)
    args = serve_args(
        "--tensor-parallel-size", "2", "--pipeline-stages", "2", "--tensor-parallel-all-reduce", "gloo",
        "--device", device,
    )  # fmt: skip
    launcher.check_placement(args)
    placed = [launcher._worker_settings(args, stage, 1, "m", 0, rank) for stage in range(2) for rank in range(2)]
    assert [p["device"] for p in placed] == ["cuda:0"] * 4
    assert all(p["gpu_memory_utilization"] == args.gpu_memory_utilization / 4 for p in placed)
    argv = launcher.worker_argv(args, 0, 50061, "m", 0, 1, "127.0.0.1:9000")
    assert argv[argv.index("--tensor-parallel-all-reduce") + 1] == "gloo"


def test_ranks_on_cpus_are_fine():
    launcher.check_placement(serve_args("--tensor-parallel-size", "3", "--pipeline-stages", "2", "--device", "cpu"))


def test_every_process_starts_with_nvlink_multicast_off(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    env = launcher.Cluster().service_env()
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"
