"""5,000 concurrent streams on the CPU default model (issue 15): every one completes with status OK
over a single client channel, and every KV block ends free. About 7 minutes on 2 cores: slow."""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest

from strata.cli import build_parser
from strata.launcher import free_port, start_cluster
from strata.v1 import generate_pb2, generate_pb2_grpc
from tests.cluster import scheduler_stats

pytestmark = pytest.mark.slow

STREAMS = 5000


async def _run_streams(address: str, count: int) -> collections.Counter:
    statuses: collections.Counter = collections.Counter()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GatewayStub(channel)

        async def one(i: int) -> None:
            request = generate_pb2.GenerateRequest(
                prompt=f"Question {i}: what is {i} plus {i}?",
                params=generate_pb2.SamplingParams(max_tokens=8, temperature=0.0),
            )
            try:
                tokens = 0
                async for response in stub.Generate(request, timeout=1800):
                    tokens += sum(len(o.token_ids) for o in response.outputs)
                statuses["OK" if tokens else "EMPTY"] += 1
            except grpc.aio.AioRpcError as e:
                statuses[e.code().name] += 1

        await asyncio.gather(*(one(i) for i in range(count)))
    return statuses


def test_five_thousand_concurrent_streams_complete():
    args = build_parser().parse_args(["serve", "--port", str(free_port()), "--http-port", "0", "--device", "cpu"])
    cluster = start_cluster(args, startup_timeout=600)
    try:
        statuses = asyncio.run(_run_streams(cluster.gateway_address, STREAMS))
        print(dict(statuses))
        assert statuses == {"OK": STREAMS}
        stats = scheduler_stats(cluster)
        assert stats.used_kv_blocks == 0 and stats.running == 0 and stats.waiting == 0
    finally:
        cluster.stop()
