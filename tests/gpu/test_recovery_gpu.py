"""A lost or hung stage whose peer's GPU waits on it: on an ipc link, through slot words in host
memory (stage 0's stream waits for the sampled tokens the last stage writes, token_waits.py; the
last stage's stream for the activations stage 0 copies, ipc_transport.IpcReceiver.take); on an
NCCL link between two GPUs, through receives posted before the peer's sends. kill -9 and SIGSTOP
of either stage mid-stream: the other's GPU must not stay blocked, the scheduler rebuilds the
pipeline, and every request finishes with the tokens of an uninterrupted run.

    python -m pytest tests/gpu/test_recovery_gpu.py -q
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from strata.grpc_util import check_health
from strata.v1 import engine_pb2
from tests.cluster import mixed_requests, run_all, running_cluster, scheduler_stats, tiny_llama_dir, worker_calls
from tests.test_recovery import MAX_TOKENS, hang_until_noticed, restart, worker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FLAGS = ("--dtype", "float32", "--stage-recovery-timeout", "60")
# A step may take 3 s (the first ones compile) before its stage counts as hung.
LINKS = {
    "ipc": ("--device", "cuda:0", "--stage-transport", "ipc"),
    "nccl": ("--device", "cuda", "--stage-transport", "distributed"),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, seed=21)


@pytest.mark.parametrize("lost", ["worker 1", "worker 0"], ids=["last-stage", "stage-0"])
@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
@pytest.mark.parametrize("link", ["ipc", "nccl"])
def test_a_lost_stage_never_leaves_the_others_gpu_waiting(model_dir, link, stop, lost):
    if link == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs the stages on distinct GPUs")
    work = mixed_requests(MAX_TOKENS)[:8]
    with running_cluster(model_dir, 2, *LINKS[link], *FLAGS, "--step-timeout", "30") as (cluster, client):
        threads, plain, errors = run_all(client, work)
        for t in threads:
            t.join()
        assert not errors and len(plain) == len(work)
        stats = worker_calls(cluster, "GetStats", engine_pb2.WorkerStatsRequest())
        assert stats[0].token_waits > 0
        if link == "ipc":
            assert stats[0].token_wait_seconds == 0.0  # the GPU waited, not the host
        started = threading.Barrier(len(work) + 1)
        threads, resumed, errors = run_all(client, work, started)
        started.wait(timeout=60)
        victim = worker(cluster, lost)
        if stop == signal.SIGKILL:
            argv = victim.args
            victim.kill()
            victim.wait()
            time.sleep(1.0)
            restart(cluster, lost, argv)
        else:
            hang_until_noticed(cluster, victim, within=20)
        for t in threads:
            t.join(timeout=180)
        assert not errors, errors
        assert resumed == plain
        assert scheduler_stats(cluster).used_kv_blocks == 0
        assert check_health(cluster.scheduler_address)
