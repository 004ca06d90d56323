"""The gateway-scheduler Session (engine.proto): the gateway's end against a scripted stream, and the
scheduler's end in a real cluster (one message a step for all requests; a closed session frees
what ran on it)."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from strata.grpc_util import bearer
from strata.services.gateway.scheduler_session import SchedulerSession
from strata.v1 import engine_pb2, engine_pb2_grpc
from tests.cluster import scheduler_stats, shared_cluster, tiny_llama_dir


class ScriptedStream:
    """A Session call as grpc.aio gives it: records writes, yields what the test feeds."""

    def __init__(self):
        self.written: list[engine_pb2.SessionRequest] = []
        self.incoming: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    async def write(self, message):
        self.written.append(message)

    def feed(self, outputs=(), failures=()):
        self.incoming.put_nowait(engine_pb2.SessionOutputs(outputs=outputs, failures=failures))

    def lose(self, code=grpc.StatusCode.UNAVAILABLE, details="connection reset"):
        self.incoming.put_nowait(grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details))

    def cancel(self):
        self.cancelled = True
        self.incoming.put_nowait(None)

    def __aiter__(self):
        return self._messages()

    async def _messages(self):
        while True:
            item = await self.incoming.get()
            if item is None:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), details="cancelled"
                )
            if isinstance(item, Exception):
                raise item
            yield item


class ScriptedStub:
    def __init__(self):
        self.streams: list[ScriptedStream] = []
        self.metadata = []

    def Session(self, metadata=None):  # noqa: N802
        self.metadata.append(metadata)
        self.streams.append(ScriptedStream())
        return self.streams[-1]


def request(request_id: str) -> engine_pb2.EngineRequest:
    return engine_pb2.EngineRequest(request_id=request_id, prompt_token_ids=[1, 2, 3])


def output(request_id: str, tokens, finish=engine_pb2.FINISH_REASON_UNSPECIFIED) -> engine_pb2.EngineOutput:
    return engine_pb2.EngineOutput(request_id=request_id, token_ids=tokens, finish_reason=finish)


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def drain(call) -> list[int]:
    return [t async for out in call for t in out.token_ids]


def test_requests_of_one_turn_go_out_as_one_message_and_outputs_reach_their_calls():
    async def scenario():
        stub = ScriptedStub()
        session = SchedulerSession(stub, bearer("tok"))
        a, b = session.Submit(request("a")), session.Submit(request("b"))
        await settle()
        (stream,) = stub.streams
        assert stub.metadata == [(("authorization", "Bearer tok"),)]
        assert [[r.request_id for r in m.submit] for m in stream.written] == [["a", "b"]]
        stream.feed([output("a", [5]), output("b", [7])])
        stream.feed(
            [output("b", [8], engine_pb2.FINISH_REASON_LENGTH), output("a", [6], engine_pb2.FINISH_REASON_STOP)]
        )
        assert await asyncio.wait_for(asyncio.gather(drain(a), drain(b)), 5) == [[5, 6], [7, 8]]
        c = session.Submit(request("c"))  # the same stream goes on serving
        await settle()
        assert len(stub.streams) == 1 and [r.request_id for r in stream.written[-1].submit] == ["c"]
        c.cancel()
        await settle()
        assert list(stream.written[-1].cancel) == ["c"]
        with pytest.raises(asyncio.CancelledError):
            await c.__anext__()

    asyncio.run(scenario())


def test_failures_deadlines_and_duplicate_ids_end_a_call_as_grpc_would():
    async def scenario():
        stub = ScriptedStub()
        session = SchedulerSession(stub)
        bad, slow = session.Submit(request("bad")), session.Submit(request("slow"), timeout=0.05)
        twin = session.Submit(request("slow"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await twin.__anext__()
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        await settle()
        stub.streams[0].feed(failures=[engine_pb2.SessionFailure(request_id="bad", code=3, message="top_p")])
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await bad.__anext__()
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "top_p")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(slow.__anext__(), 5)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await settle()
        assert list(stub.streams[0].written[-1].cancel) == ["slow"]  # the scheduler frees it

    asyncio.run(scenario())


def test_a_lost_stream_fails_its_calls_unavailable_and_the_next_request_opens_another():
    async def scenario():
        stub = ScriptedStub()
        session = SchedulerSession(stub)
        a, b = session.Submit(request("a")), session.Submit(request("b"))
        await settle()
        stub.streams[0].feed([output("a", [5])])
        assert (await a.__anext__()).token_ids == [5]
        stub.streams[0].lose()
        for call in (a, b):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(call.__anext__(), 5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # what failover.py moves
        assert stub.streams[0].cancelled
        again = session.Submit(request("a"))  # (the old id is free again)
        await settle()
        assert len(stub.streams) == 2 and [r.request_id for r in stub.streams[1].written[0].submit] == ["a"]
        stub.streams[1].feed([output("a", [9], engine_pb2.FINISH_REASON_LENGTH)])
        assert await asyncio.wait_for(drain(again), 5) == [9]
        await session.close()
        assert stub.streams[1].cancelled

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    return shared_cluster(tiny_llama_dir(tmp_path_factory, seed=31, shared=True))


def engine_request(request_id: str, max_tokens: int) -> engine_pb2.EngineRequest:
    return engine_pb2.EngineRequest(
        request_id=request_id,
        prompt_token_ids=[3, 4, 5, 6],
        sampling=engine_pb2.SamplingOptions(temperature=0.0, top_p=1.0, logprobs=-1),
        stop=engine_pb2.StopCriteria(max_tokens=max_tokens, ignore_eos=True),
    )


def open_session(cluster, first: engine_pb2.SessionRequest):
    """A Session on the cluster's scheduler whose request side stays open until close() is called."""
    closed = threading.Event()

    def messages():
        yield first
        closed.wait(120)

    channel = grpc.insecure_channel(cluster.scheduler_address)
    responses = engine_pb2_grpc.SchedulerStub(channel).Session(
        messages(), timeout=120, metadata=bearer(cluster.cluster_token)
    )

    def close():
        closed.set()
        channel.close()

    return responses, close


def test_a_step_sends_one_message_for_all_its_requests(cluster):
    cluster, client = cluster
    n, tokens = 8, 24
    responses, close = open_session(
        cluster, engine_pb2.SessionRequest(submit=[engine_request(f"s{i}", tokens) for i in range(n)])
    )
    received = {f"s{i}": [] for i in range(n)}
    messages = finished = 0
    try:
        for message in responses:
            messages += 1
            for out in message.outputs:
                received[out.request_id] += out.token_ids
                finished += bool(out.finish_reason)
            if finished == n:
                break
    finally:
        close()
    assert all(len(ids) == tokens for ids in received.values())
    # Submit calls would have sent n x tokens messages; a session sends about one a step.
    print(f"{messages} messages for {n} x {tokens} tokens")
    assert messages <= 2 * tokens


def test_closing_a_session_aborts_what_runs_on_it(cluster):
    cluster, client = cluster
    longest = client.model_info().max_model_len - 4
    responses, close = open_session(cluster, engine_pb2.SessionRequest(submit=[engine_request("long", longest)]))
    first = next(responses)
    assert first.outputs[0].request_id == "long" and not first.outputs[0].finish_reason
    assert scheduler_stats(cluster).running == 1
    close()
    for _ in range(100):
        stats = scheduler_stats(cluster)
        if stats.running == 0 and stats.waiting == 0:
            break
        threading.Event().wait(0.05)
    assert stats.running == 0 and stats.waiting == 0 and stats.used_kv_blocks == 0


def test_a_session_whose_sender_is_done_still_gets_every_output(cluster):
    cluster, client = cluster
    with grpc.insecure_channel(cluster.scheduler_address) as channel:
        messages = list(
            engine_pb2_grpc.SchedulerStub(channel).Session(
                iter([engine_pb2.SessionRequest(submit=[engine_request("a", 6), engine_request("b", 9)])]),
                timeout=60,
                metadata=bearer(cluster.cluster_token),
            )
        )
    tokens = {"a": 0, "b": 0}
    for message in messages:
        for out in message.outputs:
            tokens[out.request_id] += len(out.token_ids)
    assert tokens == {"a": 6, "b": 9} and messages[-1].outputs[-1].finish_reason
