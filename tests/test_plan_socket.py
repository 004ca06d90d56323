"""Rank 0's plan relay to its peers (services/worker/tensor_parallel/plan_socket.py), in process:
plans reach a peer in order, framed; a connection without the cluster's token is refused; a peer's
failure, or its connection's end, reaches rank 0 as a lost group."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from strata.services.worker.tensor_parallel.plan_socket import (
    PlanListener,
    SocketPeerSteps,
    frame,
    hello,
    read_frame,
)
from strata.v1 import engine_pb2


def test_plans_in_order_a_failure_back_and_strangers_refused():
    async def run():
        served, lost = [], []

        async def serve(session, reader, writer):
            while (raw := await read_frame(reader)) is not None:
                plan = engine_pb2.StepPlan.FromString(raw)
                served.append((session, plan.step_id))
                if plan.step_id == 3:  # the peer's step fails: its result goes back
                    writer.write(frame(engine_pb2.StepResult(step_id=3, error="boom").SerializeToString()))
                    await writer.drain()

        listener = PlanListener("secret", serve)
        port = await listener.start("127.0.0.1")
        # A stranger: the wrong token gets the connection closed, and nothing is served.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(hello(7, "wrong") + frame(engine_pb2.StepPlan(step_id=99).SerializeToString()))
        assert await read_frame(reader) is None
        peer = SimpleNamespace(rank=1, address=f"127.0.0.1:{port + 1}", plan_port=port)
        relay = SocketPeerSteps([peer], 7, "secret", lost.append)
        await relay.open(5.0)
        for step in range(1, 6):
            await relay.write(engine_pb2.StepPlan(step_id=step).SerializeToString())
        for _ in range(100):
            if lost and len(served) == 5:
                break
            await asyncio.sleep(0.02)
        await relay.close()
        await listener.close()
        return served, lost

    served, lost = asyncio.run(run())
    assert served == [(7, s) for s in range(1, 6)]
    assert len(lost) == 1 and "failed step 3: boom" in lost[0]


def test_a_peer_that_goes_away_breaks_the_group():
    async def run():
        lost = []

        async def serve(session, reader, writer):
            await read_frame(reader)  # one plan, then the peer is gone

        listener = PlanListener(None, serve)
        port = await listener.start("127.0.0.1")
        relay = SocketPeerSteps([SimpleNamespace(rank=2, address="127.0.0.1:1", plan_port=port)], 1, None, lost.append)
        await relay.open(5.0)
        await relay.write(engine_pb2.StepPlan(step_id=1).SerializeToString())
        for _ in range(100):
            if lost:
                break
            await asyncio.sleep(0.02)
        await relay.close()
        await listener.close()
        # No listener at all: the relay cannot open, which is a lost group too.
        unreachable = []
        relay = SocketPeerSteps(
            [SimpleNamespace(rank=1, address="127.0.0.1:1", plan_port=port)], 1, None, unreachable.append
        )
        await relay.open(2.0)
        return lost, unreachable

    lost, unreachable = asyncio.run(run())
    assert lost and "closed its plan connection" in lost[0]
    assert unreachable and "takes no plans" in unreachable[0]
