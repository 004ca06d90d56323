"""The stage transports on GPUs: the CUDA IPC ring and NCCL between two processes (one GPU, and
peer GPUs where there are two), then two worker processes through the real gRPC stack, whose
greedy tokens equal one stage's on every transport, with `auto` choosing ipc.

    python -m pytest tests/gpu/test_stage_transport_gpu.py -q
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from strata.v1 import engine_pb2, generate_pb2
from tests import stage_transport_peers as peers
from tests.cluster import collect, running_cluster, tiny_llama_dir, worker_calls

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

IPC, DISTRIBUTED, GRPC = (
    engine_pb2.STAGE_TRANSPORT_IPC,
    engine_pb2.STAGE_TRANSPORT_DISTRIBUTED,
    engine_pb2.STAGE_TRANSPORT_GRPC,
)


def _devices(peer: bool) -> tuple[str, str]:
    if peer and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    return ("cuda:0", "cuda:1") if peer else ("cuda:0", "cuda:0")


def _run_link(transport: int, sender_device: str, receiver_device: str, slots: int, steps: int, delay: float = 0.0):
    ctx = multiprocessing.get_context("spawn")
    link_q, msg_q, ack_q, result_q, done_q = (ctx.Queue() for _ in range(5))
    receiver = ctx.Process(
        target=peers.receiver_main,
        args=(transport, receiver_device, slots, steps, link_q, msg_q, ack_q, result_q, delay),
    )
    sender = ctx.Process(target=peers.sender_main, args=(sender_device, steps, link_q, msg_q, ack_q, done_q))
    receiver.start()
    sender.start()
    try:
        bad = result_q.get(timeout=300)
    finally:
        done_q.put(True)
        for p in (receiver, sender):
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert receiver.exitcode == 0 and sender.exitcode == 0
    return bad


@pytest.mark.parametrize("peer", [False, True], ids=["one-gpu", "peer-gpus"])
def test_the_ipc_ring_moves_every_step_intact_and_reuses_slots_only_after_they_are_read(peer):
    sender_device, receiver_device = _devices(peer)
    # 2 slots for 40 steps: every slot is reused 20 times; the slow reader makes the sender wait.
    assert _run_link(IPC, sender_device, receiver_device, slots=2, steps=40, delay=0.01) == []


@pytest.mark.parametrize("peer", [False, True], ids=["one-gpu", "peer-gpus"])
def test_nccl_point_to_point_moves_every_step_intact(peer):
    sender_device, receiver_device = _devices(peer)
    if not peer:
        pytest.skip("NCCL needs the two ranks on distinct GPUs")
    assert _run_link(DISTRIBUTED, sender_device, receiver_device, slots=0, steps=40) == []


# ------------------------------------------------------------------ through the services


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, seed=9, layers=4)


PROMPTS = [[5, 17, 42, 99, 3], [7] * 40, list(range(20, 160)), [300, 2, 250]]


def _greedy(client) -> list[list[int]]:
    # One request at a time: the batches, and so the kernels' sums, are the same in every run.
    return [
        collect(
            client.generate(
                p, max_tokens=24, temperature=0.0, ignore_eos=True, output_kind=generate_pb2.DELTA, timeout=300
            )
        )[0]
        for p in PROMPTS
    ]


def _transports(cluster) -> list[int]:
    return [d.next_stage_transport for d in worker_calls(cluster, "Describe", engine_pb2.DescribeRequest())]


@pytest.fixture(scope="module")
def one_stage(model_dir):
    with running_cluster(model_dir, 1, "--device", "cuda:0", "--dtype", "float32") as (_, client):
        return _greedy(client)


@pytest.mark.parametrize(
    "transport,device,expected",
    [
        ("auto", "cuda:0", IPC),  # two workers on one GPU
        ("ipc", "cuda:0", IPC),
        ("grpc", "cuda:0", GRPC),
        ("auto", "cuda", IPC),  # stage i on GPU i where there are two (one GPU: both on it)
        ("distributed", "cuda", DISTRIBUTED),  # NCCL: needs two GPUs
    ],
    ids=["auto-one-gpu", "ipc-one-gpu", "grpc-one-gpu", "auto-gpu-per-stage", "nccl-gpu-per-stage"],
)
def test_two_workers_give_one_stages_greedy_tokens(model_dir, one_stage, transport, device, expected):
    if transport == "distributed" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs the two stages on distinct GPUs")
    argv = ("--device", device, "--dtype", "float32", "--stage-transport", transport)
    with running_cluster(model_dir, 2, *argv) as (cluster, client):
        got = _greedy(client)
        transports = _transports(cluster)
    assert transports == [expected, 0]
    assert got == one_stage
