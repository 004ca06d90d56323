"""Replicas behind one gateway, in process against fake schedulers (milliseconds): routing keeps a
request's children and a prefix group's members together; a lost replica's children resume on
another with the tokens they streamed (services/gateway/failover.py), so the merged output is
the uninterrupted one; other failures, a client that leaves and a lone replica fail or stop as
before; every token of load is given back."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from strata.default_model import build_tiny_tokenizer
from strata.services.gateway import failover
from strata.services.gateway.replicas import Replica, ReplicaSet
from strata.services.gateway.server import Gateway, GatewayError
from strata.v1 import engine_pb2, generate_pb2

VOCAB = 384


def draw(request: engine_pb2.EngineRequest, k: int) -> int:
    """Output token k of a request: a function of its seed, prompt and position, as (seed,
    position) sampling makes it, whichever replica draws it."""
    return 3 + hash((request.sampling.seed, *request.prompt_token_ids, k)) % (VOCAB - 3)


def error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=f"fake {code.name}")


class FakeCall:
    def __init__(self, stub: FakeScheduler, request: engine_pb2.EngineRequest):
        self.stub, self.request = stub, request
        self.cancelled = self.done = False

    def cancel(self) -> bool:
        if self.done or self.cancelled:  # as grpc's: nothing to cancel once it ended
            return False
        self.cancelled = True
        self.stub.cancelled.append(self.request.request_id)
        return True

    def __aiter__(self):
        return self._outputs()

    async def _outputs(self):
        try:
            async for out in self._draws():
                yield out
        finally:
            self.done = True

    async def _draws(self):
        stub, req = self.stub, self.request
        out = list(req.resume_output_token_ids)
        while len(out) < req.stop.max_tokens:
            await asyncio.sleep(0.001)
            while stub.paused and not self.cancelled:
                await asyncio.sleep(0.001)
            if self.cancelled:
                raise asyncio.CancelledError()  # what grpc.aio raises reading a locally cancelled call
            if stub.failure is not None and stub.sent >= stub.fail_after:
                raise error(stub.failure)
            if req.request_id in stub.fail_ids and len(out) >= 2:
                raise error(grpc.StatusCode.UNAVAILABLE)
            out.append(draw(req, len(out)))
            stub.sent += 1
            done = len(out) == req.stop.max_tokens
            if req.final_only and not done:
                continue
            tokens = out[len(out) - 1 :] if not req.final_only else out[len(req.resume_output_token_ids) :]
            yield engine_pb2.EngineOutput(
                request_id=req.request_id,
                token_ids=tokens,
                finish_reason=engine_pb2.FINISH_REASON_LENGTH if done else 0,
            )


class FakeScheduler:
    """A replica's scheduler stub. failure: the status every call raises once the replica has sent
    fail_after tokens in all (UNAVAILABLE: it died); paused: calls wait (a stage rebuilding)."""

    def __init__(self, failure=None, fail_after: int = 0, fail_ids=()):
        self.failure, self.fail_after = failure, fail_after
        self.fail_ids = set(fail_ids)  # these calls alone fail (UNAVAILABLE) after their second token
        self.paused = False
        self.sent = 0
        self.submitted: list[engine_pb2.EngineRequest] = []
        self.cancelled: list[str] = []

    def Submit(self, request, timeout=None):  # noqa: N802
        self.submitted.append(request)
        return FakeCall(self, request)

    async def GetModelInfo(self, request, timeout=None):  # noqa: N802
        return generate_pb2.ModelInfo(vocab_size=VOCAB, max_model_len=256, eos_token_ids=[1], block_size=4)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=VOCAB)


def gateway_over(tokenizer, *stubs) -> Gateway:
    replicas = ReplicaSet([Replica(i, f"fake-{i}", stub, up=True) for i, stub in enumerate(stubs)])
    return Gateway(replicas, tokenizer, "fake")


def request(request_id="p", n=1, max_tokens=12, seed=7, kind=generate_pb2.DELTA, prompt=(5, 6, 7, 8, 9)):
    params = generate_pb2.SamplingParams(n=n, max_tokens=max_tokens, output_kind=kind, seed=seed, temperature=1.0)
    return generate_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=generate_pb2.TokenIds(ids=list(prompt)), params=params
    )


async def tokens_of(gateway: Gateway, req) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    async for response in gateway.generate(req):
        for o in response.outputs:
            if req.params.output_kind == generate_pb2.CUMULATIVE or req.params.output_kind == generate_pb2.FINAL_ONLY:
                tokens[o.index] = list(o.token_ids)
            else:
                tokens.setdefault(o.index, []).extend(o.token_ids)
    return tokens


def expected(req: generate_pb2.GenerateRequest) -> dict[int, list[int]]:
    """Each child's uninterrupted output (child i draws with seed + i)."""
    out = {}
    for i in range(req.params.n):
        child = engine_pb2.EngineRequest(prompt_token_ids=req.prompt_token_ids.ids)
        child.sampling.seed = req.params.seed + i
        out[i] = [draw(child, k) for k in range(req.params.max_tokens)]
    return out


def loads_are_free(gateway: Gateway) -> bool:
    return all(r.load_tokens == 0 and not r.calls for r in gateway.replicas.replicas)


def test_siblings_share_a_replica_and_requests_spread_by_load(tokenizer):
    async def go():
        a, b = FakeScheduler(), FakeScheduler()
        gateway = gateway_over(tokenizer, a, b)
        first = gateway.generate(request("one", n=4, max_tokens=40))
        await first.__anext__()  # running: its 4 children's tokens load the replica they went to
        second = await tokens_of(gateway, request("two", n=3))
        rest = [r async for r in first]
        return a, b, gateway, second, rest

    a, b, gateway, second, rest = asyncio.run(go())
    assert [r.request_id for r in a.submitted] == ["0_one", "1_one", "2_one", "3_one"]  # all siblings on one
    assert [r.request_id for r in b.submitted] == ["0_two", "1_two", "2_two"]  # the next where the load is lower
    assert second == expected(request("two", n=3)) and rest[-1].finished
    assert [sum(r.routed.values()) for r in gateway.replicas.replicas] == [1, 1]
    assert loads_are_free(gateway)


@pytest.mark.parametrize("kind", [generate_pb2.DELTA, generate_pb2.FINAL_ONLY])
def test_a_lost_replica_s_children_resume_on_another_with_the_tokens_they_would_have_had(tokenizer, kind):
    """The first replica dies after 10 tokens (3 children): each child resumes on the second
    after the tokens it streamed (FINAL_ONLY ones, which streamed none, from their prompt), in a
    new family; the merged output is the uninterrupted one."""
    req = request(n=3, kind=kind)

    async def go():
        a, b = FakeScheduler(grpc.StatusCode.UNAVAILABLE, fail_after=10), FakeScheduler()
        gateway = gateway_over(tokenizer, a, b)
        return a, b, gateway, await tokens_of(gateway, req)

    a, b, gateway, got = asyncio.run(go())
    assert got == expected(req)
    assert len(a.submitted) == 3 and len(b.submitted) == 3
    streamed = kind == generate_pb2.DELTA
    for resumed in b.submitted:
        index = int(resumed.request_id.split("_")[0])
        assert resumed.request_id == f"{index}_p~1" and resumed.parent_id == "p~1"
        done = list(resumed.resume_output_token_ids)
        assert done == (expected(req)[index][: len(done)] if streamed else [])
    if streamed:
        assert sum(len(r.resume_output_token_ids) for r in b.submitted) == 10
    replicas = gateway.replicas
    assert replicas.replicas[1].resumed == 3 and replicas.resumed_total == 3
    assert replicas.replicas[1].routed["resume"] == 1  # the request's route moved once, its children with it
    assert loads_are_free(gateway)


def test_one_child_s_loss_moves_its_siblings_too(tokenizer):
    """A replica that fails one child with UNAVAILABLE is taken as lost for the whole request:
    the siblings still streaming there move with it, so the children stay together."""
    req = request(n=3, max_tokens=20)

    async def go():
        a, b = FakeScheduler(fail_ids={"1_p"}), FakeScheduler()
        gateway = gateway_over(tokenizer, a, b)
        return a, b, gateway, await tokens_of(gateway, req)

    a, b, gateway, got = asyncio.run(go())
    assert got == expected(req)
    assert sorted(a.cancelled) == ["0_p", "2_p"]
    assert sorted(r.request_id for r in b.submitted) == ["0_p~1", "1_p~1", "2_p~1"]
    assert loads_are_free(gateway)


def test_a_prefix_group_moves_as_one_family(tokenizer):
    """A group whose replica dies mid-way: every member resumes on the other in one new family
    of siblings (group_size 0: the group's count would never be met again there)."""
    prefix = list(range(10, 30))

    async def groups():
        members = [request(f"m{i}", max_tokens=8, prompt=(40 + i,)) for i in range(3)]
        yield generate_pb2.PrefixGroup(prefix_token_ids=generate_pb2.TokenIds(ids=prefix), members=members)

    async def go():
        a, b = FakeScheduler(grpc.StatusCode.UNAVAILABLE, fail_after=5), FakeScheduler()
        gateway = gateway_over(tokenizer, a, b)
        out = {}
        async for response in gateway.generate_groups(groups()):
            assert response.WhichOneof("result") == "response", response
            r = response.response
            for o in r.outputs:
                out.setdefault(r.request_id, []).extend(o.token_ids)
        return a, b, gateway, out

    a, b, gateway, out = asyncio.run(go())
    assert {r.parent_id for r in a.submitted} == {a.submitted[0].parent_id} and a.submitted[0].group_size == 3
    assert len(b.submitted) == 3
    assert {r.parent_id for r in b.submitted} == {a.submitted[0].parent_id + "~1"}
    assert all(r.group_size == 0 and r.shared_prefix_len == len(prefix) for r in b.submitted)
    for i in range(3):
        member = request(f"m{i}", max_tokens=8, prompt=(*prefix, 40 + i))
        assert out[f"m{i}"] == expected(member)[0]
    assert gateway.replicas.replicas[0].routed["group"] == 1
    assert loads_are_free(gateway)


def test_a_replica_down_past_the_grace_period_hands_its_requests_over(tokenizer):
    """A replica that says NOT_SERVING (its pipeline rebuilding) keeps its paused requests for
    --replica-failover-seconds; past it they resume on another."""

    async def go():
        a, b = FakeScheduler(), FakeScheduler()
        gateway = gateway_over(tokenizer, a, b)
        replicas = gateway.replicas
        replicas.failover_seconds = 5.0
        responses = gateway.generate(request(n=2, max_tokens=30))
        got = {}
        first = await responses.__anext__()
        for o in first.outputs:
            got.setdefault(o.index, []).extend(o.token_ids)
        a.paused = True
        lost = replicas.replicas[0]
        lost.up, lost.down_since = False, asyncio.get_running_loop().time()  # (monotonic, as replicas.py)
        replicas._fail_over_if_overdue(lost)  # within the grace: nothing moves
        assert not b.submitted
        lost.down_since -= 5.0
        replicas._fail_over_if_overdue(lost)
        async for response in responses:
            for o in response.outputs:
                got.setdefault(o.index, []).extend(o.token_ids)
        return a, b, gateway, got

    a, b, gateway, got = asyncio.run(go())
    assert got == expected(request(n=2, max_tokens=30))
    assert sorted(a.cancelled) == ["0_p", "1_p"]  # cancelled there: the scheduler frees them at once
    assert len(b.submitted) == 2 and all(r.resume_output_token_ids for r in b.submitted)
    assert loads_are_free(gateway)


@pytest.mark.parametrize("case", ["internal", "no-other-replica", "too-many-moves"])
def test_what_is_not_a_lost_replica_fails_the_request(tokenizer, case, monkeypatch):
    """INTERNAL (a bug) is not retried elsewhere; a lost replica with no other up fails with
    UNAVAILABLE, as one scheduler does; a child that lost MAX_RESUMES replicas fails too."""
    if case == "internal":
        stubs = [FakeScheduler(grpc.StatusCode.INTERNAL, fail_after=2), FakeScheduler()]
    elif case == "no-other-replica":
        stubs = [FakeScheduler(grpc.StatusCode.UNAVAILABLE, fail_after=2)]
    else:
        monkeypatch.setattr(failover, "MAX_RESUMES", 1)
        stubs = [FakeScheduler(grpc.StatusCode.UNAVAILABLE, fail_after=2) for _ in range(3)]

    async def go():
        gateway = gateway_over(tokenizer, *stubs)
        with pytest.raises(GatewayError) as e:
            await tokens_of(gateway, request())
        return gateway, e.value

    gateway, e = asyncio.run(go())
    code = grpc.StatusCode.INTERNAL if case == "internal" else grpc.StatusCode.UNAVAILABLE
    assert e.code == code
    assert [len(s.submitted) for s in stubs] == {
        "internal": [1, 0],
        "no-other-replica": [1],
        "too-many-moves": [1, 1, 0],
    }[case]
    assert loads_are_free(gateway)


def test_a_client_that_leaves_cancels_without_resuming(tokenizer):
    async def go():
        a, b = FakeScheduler(), FakeScheduler()
        gateway = gateway_over(tokenizer, a, b)
        responses = gateway.generate(request(n=2, max_tokens=50))
        await responses.__anext__()
        assert gateway.replicas.replicas[0].load_tokens > 0
        await responses.aclose()
        await asyncio.sleep(0.01)
        return a, b, gateway

    a, b, gateway = asyncio.run(go())
    assert sorted(a.cancelled) == ["0_p", "1_p"] and not b.submitted
    assert loads_are_free(gateway)


def test_describe_shows_each_replica(tokenizer):
    async def go():
        a, b = FakeScheduler(), FakeScheduler()
        gateway = gateway_over(tokenizer, a, b)
        await tokens_of(gateway, request(n=2))
        return await gateway.describe(), gateway.metrics.exposition().decode()

    info, metrics = asyncio.run(go())
    assert info.data_parallel_size == 2 and [r.index for r in info.replicas] == [0, 1]
    assert [r.routed for r in info.replicas] == [1, 0] and all(r.up for r in info.replicas)
    assert 'strata_replica_routed_total{reason="load",replica="0"} 1.0' in metrics
    assert 'strata_replica_up{replica="1"} 1.0' in metrics
