"""Pipelined decode on GPUs (issue 29, part 2): the last stage hands its sampled tokens to stage 0
over the token link (an IPC ring on one host, NCCL across GPUs, or gRPC), stage 0's decode graphs
read them from last_sampled, and every request gets one stage's tokens; decodes run ahead of the
scheduler (lookahead_decodes) and every stage reports its own CUDA-event timeline.

    python -m pytest tests/gpu/test_pipelined_decode_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from strata.v1 import engine_pb2, generate_pb2
from tests.cluster import collect, running_cluster, scheduler_stats, tiny_llama_dir, worker_calls

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[5 + i, 17, 42, 99, 3 + i] * (1 + i % 4) for i in range(8)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, seed=13, layers=6)


def _run(client):
    """Greedy and seeded requests, one at a time (the batches, and so the kernels' sums, are the
    same in every run; micro-batches of many are the CPU tests'): every decode but the first is a
    lookahead whose token stage 0 gets from the last stage."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        kw = dict(temperature=0.0) if i % 2 else dict(temperature=0.8, top_p=0.9, seed=i)
        stream = client.generate(
            prompt, max_tokens=32, ignore_eos=True, output_kind=generate_pb2.DELTA, timeout=300, **kw
        )
        out.append(collect(stream)[0])
    return out


def _worker_stats(cluster):
    return worker_calls(cluster, "GetStats", engine_pb2.WorkerStatsRequest())


FLAGS = ("--dtype", "float32", "--micro-batch-min-seqs", "4")


@pytest.fixture(scope="module")
def one_stage(model_dir):
    with running_cluster(model_dir, 1, "--device", "cuda:0", *FLAGS) as (_, client):
        return _run(client)


@pytest.mark.parametrize(
    "stages,transport,device",
    [
        (2, "ipc", "cuda:0"),
        (3, "ipc", "cuda:0"),
        (2, "grpc", "cuda:0"),
        (2, "auto", "cuda"),
        (2, "distributed", "cuda"),
    ],
    ids=["ipc-2", "ipc-3", "grpc-2", "auto-gpu-per-stage", "nccl-gpu-per-stage"],
)
def test_pipelined_stages_give_one_stages_tokens(model_dir, one_stage, stages, transport, device):
    if transport == "distributed" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs the stages on distinct GPUs")
    argv = ("--device", device, "--stage-transport", transport, *FLAGS)
    with running_cluster(model_dir, stages, *argv) as (cluster, client):
        got = _run(client)
        stats = scheduler_stats(cluster)
        workers = _worker_stats(cluster)
    assert got == one_stage
    assert stats.lookahead_decodes > 0 and stats.used_kv_blocks == 0
    assert all(w.timed_steps > 0 and w.busy_seconds > 0 for w in workers)
    assert workers[-1].token_steps_sent > 0 and workers[0].token_waits > 0


def test_micro_batches_on_two_stages_give_hf_greedy_tokens(model_dir):
    """Concurrent requests in micro-batches of 4 (up to P + 1 = 3 of them, fewer as requests
    finish, prompts' chunks riding any plan, rebalanced as they drain; services/scheduler/
    micro_batches.py) on two stages, a GPU each where there are two: greedy tokens equal HF's in
    float32, and every block comes back."""
    import random

    from tests.cluster import greedy_concurrently, hf_greedy

    rng = random.Random(7)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(3, 90))] for _ in range(16)]
    lengths = [rng.randint(4, 40) for _ in range(16)]
    expected = hf_greedy(model_dir, prompts, lengths)
    argv = ("--device", "cuda", "--dtype", "float32", "--max-num-seqs", "4", "--micro-batch-min-seqs", "2")
    with running_cluster(model_dir, 2, *argv, "--max-num-batched-tokens", "64") as (cluster, client):
        got = greedy_concurrently(client, prompts, lengths)
        stats = scheduler_stats(cluster)
    assert got == expected
    assert stats.micro_batch_rounds > 0 and stats.used_kv_blocks == 0 and stats.lookahead_decodes > 0
