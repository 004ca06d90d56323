"""The gateway servicer against a fake scheduler: fan-out, failure propagation, cancellation."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from strata.default_model import build_tiny_tokenizer
from strata.services.gateway.server import Gateway, GatewayServicer
from strata.v1 import engine_pb2, engine_pb2_grpc, generate_pb2, generate_pb2_grpc


class FakeScheduler(engine_pb2_grpc.SchedulerServicer):
    """Streams 3 tokens per child; the child whose id starts with `fail_prefix` fails instead."""

    def __init__(self, fail_prefix: str | None = None, hang: bool = False):
        self.fail_prefix = fail_prefix
        self.hang = hang
        self.submitted: list[engine_pb2.EngineRequest] = []
        self.cancelled: list[str] = []

    async def GetModelInfo(self, request, context):
        return generate_pb2.ModelInfo(vocab_size=384, max_model_len=256, eos_token_ids=[1], pipeline_stages=1)

    async def Submit(self, request, context):
        self.submitted.append(request)
        try:
            if self.fail_prefix and request.request_id.startswith(self.fail_prefix):
                await asyncio.sleep(0.05)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no KV blocks for this child")
            for i in range(3):
                if self.hang and i == 1:
                    await asyncio.sleep(3600)
                yield engine_pb2.EngineOutput(
                    request_id=request.request_id,
                    token_ids=[10 + i],
                    prompt_tokens=len(request.prompt_token_ids),
                    finish_reason=engine_pb2.FINISH_REASON_LENGTH if i == 2 else 0,
                )
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=384)


async def _serve(fake: FakeScheduler, tokenizer):
    sched_server = grpc.aio.server()
    engine_pb2_grpc.add_SchedulerServicer_to_server(fake, sched_server)
    sched_port = sched_server.add_insecure_port("127.0.0.1:0")
    await sched_server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{sched_port}")
    gw_server = grpc.aio.server()
    generate_pb2_grpc.add_GatewayServicer_to_server(
        GatewayServicer(Gateway(engine_pb2_grpc.SchedulerStub(channel), tokenizer, "fake")), gw_server
    )
    gw_port = gw_server.add_insecure_port("127.0.0.1:0")
    await gw_server.start()
    client_channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw_port}")
    return generate_pb2_grpc.GatewayStub(client_channel), (client_channel, gw_server, channel, sched_server)


async def _close(handles):
    client_channel, gw_server, channel, sched_server = handles
    await client_channel.close()
    await gw_server.stop(None)
    await channel.close()
    await sched_server.stop(None)


def _request(n: int, seed: int | None = None, kind=generate_pb2.DELTA):
    params = generate_pb2.SamplingParams(n=n, max_tokens=3, output_kind=kind)
    if seed is not None:
        params.seed = seed
    return generate_pb2.GenerateRequest(
        request_id="p", prompt_token_ids=generate_pb2.TokenIds(ids=[5, 6, 7]), params=params
    )


def test_children_get_ids_and_seeds_and_merge(tokenizer):
    async def go():
        fake = FakeScheduler()
        stub, handles = await _serve(fake, tokenizer)
        try:
            responses = [r async for r in stub.Generate(_request(3, seed=41), timeout=10)]
        finally:
            await _close(handles)
        return fake, responses

    fake, responses = asyncio.run(go())
    assert sorted(r.request_id for r in fake.submitted) == ["0_p", "1_p", "2_p"]
    assert sorted(r.sampling.seed for r in fake.submitted) == [41, 42, 43]
    assert all(r.parent_id == "p" for r in fake.submitted)
    # Defaults arrive resolved, as internal messages: the scheduler reads nothing public.
    assert all(
        r.stop.max_tokens == 3 and list(r.stop.eos_token_ids) == [1] and r.sampling.top_p == 1.0 for r in fake.submitted
    )
    tokens = {}
    for r in responses:
        for o in r.outputs:
            tokens.setdefault(o.index, []).extend(o.token_ids)
    assert tokens == {0: [10, 11, 12], 1: [10, 11, 12], 2: [10, 11, 12]}
    assert responses[-1].finished and responses[-1].usage.completion_tokens == 9
    assert responses[-1].usage.prompt_tokens == 3


async def _until(condition, timeout: float = 5.0) -> None:
    """Waits for asynchronous cancellations to arrive (a fixed sleep is flaky on a loaded machine)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)


def test_a_failing_child_fails_the_parent_with_its_status_and_cancels_siblings(tokenizer):
    async def go():
        fake = FakeScheduler(fail_prefix="1_", hang=True)
        stub, handles = await _serve(fake, tokenizer)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(_request(3, seed=1), timeout=10):
                    pass
            await _until(lambda: len(fake.cancelled) >= 2)  # cancellations reach the fake scheduler
        finally:
            await _close(handles)
        return fake, err.value

    fake, error = asyncio.run(go())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "child 1" in error.details() and "no KV blocks" in error.details()
    assert sorted(fake.cancelled) == ["0_p", "2_p"]  # the hanging siblings were aborted


def test_client_cancel_aborts_every_child(tokenizer):
    async def go():
        fake = FakeScheduler(hang=True)
        stub, handles = await _serve(fake, tokenizer)
        try:
            call = stub.Generate(_request(4), timeout=10)
            await call.read()  # the first token of some child
            await _until(lambda: len(fake.submitted) == 4)  # every child reached the scheduler
            call.cancel()
            await _until(lambda: len(fake.cancelled) >= 4)
        finally:
            await _close(handles)
        return fake

    fake = asyncio.run(go())
    assert sorted(fake.cancelled) == ["0_p", "1_p", "2_p", "3_p"]
    assert len({r.sampling.seed for r in fake.submitted}) == 4  # unseeded: independent seeds
