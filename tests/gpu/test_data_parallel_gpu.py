"""Data-parallel replicas on GPUs of their own (`strata serve --data-parallel-size 2`, a GPU
each): each replica's worker on its GPU, greedy outputs equal HF transformers, and a replica
whose scheduler is killed mid-stream hands its requests to the other, which finishes them with
the tokens of an uninterrupted run (float32).

    python -m pytest tests/gpu/test_data_parallel_gpu.py -q      # on a host of 2 GPUs or more
"""

from __future__ import annotations

import random
import signal
import threading

import grpc
import pytest
import torch

from strata.grpc_util import bearer
from strata.v1 import engine_pb2, engine_pb2_grpc
from tests.cluster import (
    greedy_concurrently,
    hf_greedy,
    mixed_requests,
    run_all,
    running_cluster,
    tiny_llama_dir,
)
from tests.test_data_parallel import MAX_TOKENS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, seed=21)


def test_replicas_on_their_own_gpus_match_hf_and_survive_a_lost_scheduler(model_dir):
    flags = ("--data-parallel-size", "2", "--device", "cuda", "--dtype", "float32", "--replica-failover-seconds", "2")
    with running_cluster(model_dir, 1, *flags) as (cluster, client):
        devices = []
        for replica in cluster.replicas:
            with grpc.insecure_channel(replica.workers[0]) as ch:
                desc = engine_pb2_grpc.WorkerStub(ch).Describe(
                    engine_pb2.DescribeRequest(), timeout=30, metadata=bearer(cluster.cluster_token)
                )
            devices.append(desc.device)
        assert devices == ["cuda:0", "cuda:1"]

        rng = random.Random(7)
        prompts = [[rng.randrange(3, 384) for _ in range(rng.randint(3, 40))] for _ in range(16)]
        lengths = [rng.randint(4, 24) for _ in range(16)]
        assert greedy_concurrently(client, prompts, lengths) == hf_greedy(model_dir, prompts, lengths)

        work = mixed_requests(MAX_TOKENS)
        threads, plain, errors = run_all(client, work)
        for t in threads:
            t.join()
        assert not errors and len(plain) == len(work)
        started = threading.Barrier(len(work) + 1)
        threads, resumed, errors = run_all(client, work, started)
        started.wait(timeout=120)
        victim = next(proc for name, proc in cluster.procs if name == "replica 0 scheduler")
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        assert resumed == plain
        with grpc.insecure_channel(cluster.replicas[1].scheduler) as ch:
            survivor = engine_pb2_grpc.SchedulerStub(ch).GetStats(
                engine_pb2.GetStatsRequest(), timeout=30, metadata=bearer(cluster.cluster_token)
            )
        assert survivor.resumed_requests > 0 and survivor.used_kv_blocks == 0
        info = client.model_info()
        assert info.replicas[1].resumed > 0 and info.replicas[1].up and not info.replicas[0].up
