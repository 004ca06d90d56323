"""Hostile input through the whole stack (issue 15): hundreds of malformed requests, public and
internal, each get a clear status (never UNKNOWN or INTERNAL) and hurt no other request; a 1 MB
stop string and a 10 MB prompt are rejected at once without delaying a concurrent small request;
internal RPCs without the cluster token get UNAUTHENTICATED; every KV block ends free."""

from __future__ import annotations

import math
import random
import statistics
import threading
import time

import grpc
import pytest

from strata.client import StrataClient
from strata.grpc_util import bearer
from strata.v1 import engine_pb2, engine_pb2_grpc, generate_pb2, generate_pb2_grpc
from tests.cluster import collect, running_cluster, scheduler_stats, tiny_llama_dir

INVALID = grpc.StatusCode.INVALID_ARGUMENT
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tiny_llama_dir(tmp_path_factory, seed=31), 2) as (cluster, client):
        yield cluster, client


def _status(call) -> grpc.StatusCode:
    """Runs a call (a function that reads the whole response) and returns its status."""
    try:
        call()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def _truncated(message) -> list[bytes]:
    """Undecodable payloads: a valid message cut inside a field, and a length past the end."""
    data = message.SerializeToString()
    cuts = [data[:i] for i in range(1, len(data)) if _undecodable(type(message), data[:i])]
    return cuts + [b"\x12\xff\xff\xff\x0f", b"\x0a\x80"]


def _undecodable(cls, data: bytes) -> bool:
    try:
        cls.FromString(data)
        return False
    except Exception:  # noqa: BLE001 - protobuf's DecodeError or a C++ parse error
        return True


def _bad_public_requests(rng: random.Random, info) -> list[generate_pb2.GenerateRequest]:
    """Each request breaks one rule of the public API, with a random value."""
    vocab, max_len = info.vocab_size, info.max_model_len

    def request(prompt="hello", ids=None, **params):
        req = generate_pb2.GenerateRequest(params=generate_pb2.SamplingParams(**params))
        if ids is not None:
            req.prompt_token_ids.ids.extend(ids)
        else:
            req.prompt = prompt
        return req

    makers = [
        lambda: request(prompt=""),
        lambda: request(ids=[1, vocab + rng.randrange(1, 10**6)]),
        lambda: request(ids=[rng.randrange(-(10**6), 0)]),
        lambda: request(temperature=rng.choice([-rng.random() - 1e-3, math.nan, math.inf])),
        lambda: request(top_p=rng.choice([0.0, 1.0 + rng.random() + 1e-3, -rng.random(), math.nan])),
        lambda: request(top_k=rng.randrange(-(10**6), -1)),
        lambda: request(min_p=rng.choice([1.0 + rng.random() + 1e-3, -rng.random() - 1e-3, math.nan])),
        lambda: request(max_tokens=rng.randrange(max_len, 2**32)),
        lambda: request(max_tokens=rng.randrange(1, 8), min_tokens=rng.randrange(9, 2**32)),
        lambda: request(stop_token_ids=[rng.randrange(vocab, 2**31)]),
        lambda: request(logprobs=rng.randrange(1000, 2**32)),
        lambda: request(n=rng.randrange(10**4, 2**32)),
        lambda: request(stop=["x"] * rng.randrange(33, 200)),
        lambda: request(stop=["y" * rng.randrange(1025, 5000)]),
        lambda: request(prompt="z" * rng.randrange(32 * max_len + 1, 64 * max_len)),
    ]
    return [maker() for maker in makers for _ in range(12)]


def _bad_engine_requests(rng: random.Random, info) -> list[engine_pb2.EngineRequest]:
    """Internal requests, as a buggy or hostile peer with the cluster token would send them."""
    vocab, max_len = info.vocab_size, info.max_model_len

    def request(prompt=(3, 4), max_tokens=4, stop_ids=(), **sampling):
        s = dict(temperature=1.0, top_p=1.0, seed=rng.randrange(2**32), logprobs=-1)
        return engine_pb2.EngineRequest(
            request_id=f"bad-{rng.randrange(2**63)}",
            prompt_token_ids=prompt,
            sampling=engine_pb2.SamplingOptions(**{**s, **sampling}),
            stop=engine_pb2.StopCriteria(max_tokens=max_tokens, stop_token_ids=stop_ids),
        )

    makers = [
        lambda: request(prompt=()),
        lambda: request(prompt=(3, vocab + rng.randrange(10**6))),
        lambda: request(max_tokens=0),
        lambda: request(max_tokens=rng.randrange(max_len, 2**32)),
        lambda: request(temperature=rng.choice([math.nan, math.inf, -math.inf, -rng.random() - 1e-3])),
        lambda: request(top_p=rng.choice([0.0, math.nan, 1.5])),
        lambda: request(min_p=rng.choice([math.nan, 1.5, -0.5])),
        lambda: request(top_k=rng.randrange(-(2**31), 0)),
        lambda: request(logprobs=rng.choice([2**31 - 1, rng.randrange(1000, 2**31), rng.randrange(-(2**31), -1)])),
        lambda: request(stop_ids=(rng.randrange(vocab, 2**31),)),
    ]
    out = [maker() for maker in makers for _ in range(8)]
    out.append(engine_pb2.EngineRequest(prompt_token_ids=[3], stop=engine_pb2.StopCriteria(max_tokens=1)))
    return out


def test_hundreds_of_malformed_requests_get_clear_statuses_and_hurt_no_other(cluster):
    cluster, client = cluster
    info = client.model_info()
    rng = random.Random(15)
    # A long request runs through all of it and must come out as it does alone.
    kw = dict(max_tokens=60, temperature=0.8, seed=7, ignore_eos=True, output_kind=generate_pb2.DELTA, timeout=300)
    alone = collect(client.generate("a bystander", **kw))
    bystander: dict = {}
    thread = threading.Thread(target=lambda: bystander.update(collect(client.generate("a bystander", **kw))))
    thread.start()

    statuses: list[tuple[str, grpc.StatusCode, grpc.StatusCode]] = []  # (what, expected, got)
    token = bearer(cluster.cluster_token)
    with (
        grpc.insecure_channel(cluster.gateway_address) as gw,
        grpc.insecure_channel(cluster.scheduler_address) as sch,
        grpc.insecure_channel(cluster.worker_addresses[0]) as wk,
    ):
        gateway = generate_pb2_grpc.GatewayStub(gw)
        for req in _bad_public_requests(rng, info):
            statuses.append(("Generate", INVALID, _status(lambda: list(gateway.Generate(req, timeout=30)))))
        raw = {name: gw.unary_stream(f"/strata.v1.Gateway/{name}") for name in ("Generate",)}
        raw["GetModelInfo"] = gw.unary_unary("/strata.v1.Gateway/GetModelInfo")
        for data in _truncated(generate_pb2.GenerateRequest(prompt="hello there", request_id="r1")):
            statuses.append(("Generate bytes", INVALID, _status(lambda: list(raw["Generate"](data, timeout=30)))))
        statuses.append(("GetModelInfo bytes", INVALID, _status(lambda: raw["GetModelInfo"](b"\x0a\x80", timeout=30))))

        scheduler = engine_pb2_grpc.SchedulerStub(sch)
        for req in _bad_engine_requests(rng, info):
            statuses.append(
                ("Submit", INVALID, _status(lambda: list(scheduler.Submit(req, timeout=30, metadata=token))))
            )
        submit_raw = sch.unary_stream("/strata.v1.Scheduler/Submit")
        for data in _truncated(engine_pb2.EngineRequest(request_id="r2", prompt_token_ids=[3, 4, 5])):
            statuses.append(
                ("Submit bytes", INVALID, _status(lambda: list(submit_raw(data, timeout=30, metadata=token))))
            )

        # The gateway's path: the same requests on one Session, each refused on its own while a
        # good one beside them runs to the end.
        bad = _bad_engine_requests(rng, info)
        for code in _session_codes(scheduler, [*bad, _good_engine_request("session-good")], token):
            statuses.append(("Session", INVALID, code))
        session_raw = sch.stream_stream("/strata.v1.Scheduler/Session")
        for data in _truncated(engine_pb2.SessionRequest(submit=[_good_engine_request("r3")])):
            statuses.append(
                ("Session bytes", INVALID, _status(lambda: list(session_raw(iter([data]), timeout=30, metadata=token))))
            )

        # Every internal method, without the token and with a wrong one.
        worker = engine_pb2_grpc.WorkerStub(wk)
        good = _good_engine_request("no-token")
        internal = {
            "Scheduler/Submit": lambda md: list(scheduler.Submit(good, timeout=30, metadata=md)),
            "Scheduler/Session": lambda md: list(
                scheduler.Session(iter([engine_pb2.SessionRequest(submit=[good])]), timeout=30, metadata=md)
            ),
            "Scheduler/GetModelInfo": lambda md: scheduler.GetModelInfo(
                generate_pb2.GetModelInfoRequest(), timeout=30, metadata=md
            ),
            "Scheduler/GetStats": lambda md: scheduler.GetStats(engine_pb2.GetStatsRequest(), timeout=30, metadata=md),
            "Worker/Describe": lambda md: worker.Describe(engine_pb2.DescribeRequest(), timeout=30, metadata=md),
            "Worker/InitCache": lambda md: worker.InitCache(
                engine_pb2.InitCacheRequest(num_kv_blocks=1), timeout=30, metadata=md
            ),
            "Worker/Steps": lambda md: list(
                worker.Steps(iter([engine_pb2.StepPlan(step_id=1)]), timeout=30, metadata=md)
            ),
            "Worker/Forward": lambda md: list(
                worker.Forward(iter([engine_pb2.Activations(step_id=10**9)]), timeout=30, metadata=md)
            ),
        }
        for name, call in internal.items():
            for md in (None, bearer("not-the-token"), (("authorization", cluster.cluster_token),)):
                statuses.append((name, UNAUTHENTICATED, _status(lambda: call(md))))
        # With the token, the read-only ones answer (the locked door is not a broken one).
        statuses.append(
            ("Worker/Describe with token", grpc.StatusCode.OK, _status(lambda: internal["Worker/Describe"](token)))
        )

    thread.join(timeout=300)
    wrong = [(what, expected, got) for what, expected, got in statuses if got != expected]
    print(f"{len(statuses)} malformed or unauthenticated calls, {len(wrong)} with an unexpected status")
    assert len(statuses) >= 300 and not wrong, wrong[:10]
    assert not any(got in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) for _, _, got in statuses)
    assert bystander == alone
    stats = scheduler_stats(cluster)
    assert stats.used_kv_blocks == 0 and stats.running == 0 and stats.waiting == 0


def _good_engine_request(request_id: str) -> engine_pb2.EngineRequest:
    return engine_pb2.EngineRequest(
        request_id=request_id,
        prompt_token_ids=[3],
        sampling=engine_pb2.SamplingOptions(temperature=0.0, top_p=1.0, logprobs=-1),
        stop=engine_pb2.StopCriteria(max_tokens=1),
    )


def _session_codes(scheduler, requests: list[engine_pb2.EngineRequest], token) -> list[grpc.StatusCode]:
    """Submits all but the last of `requests` (bad ones) and then the last (a good one) on one
    Session, and returns each bad one's status from the failures; asserts the good one finished
    and nothing else came back."""
    done = threading.Event()

    def messages():
        yield engine_pb2.SessionRequest(submit=requests)
        done.wait(60)  # the stream stays open until every answer came: closing it aborts

    codes, finished = {}, False
    responses = scheduler.Session(messages(), timeout=60, metadata=token)
    try:
        for message in responses:
            codes.update((f.request_id, _CODES[f.code]) for f in message.failures)
            finished = finished or any(
                o.request_id == requests[-1].request_id and o.finish_reason for o in message.outputs
            )
            if finished and len(codes) == len(requests) - 1:
                break
    finally:
        done.set()
        responses.cancel()
    assert finished and set(codes) == {r.request_id for r in requests[:-1]}
    return list(codes.values())


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _latency(client, i: int) -> float:
    start = time.perf_counter()
    out = collect(
        client.generate(
            f"small {i}", max_tokens=4, temperature=0.0, ignore_eos=True, output_kind=generate_pb2.DELTA, timeout=60
        )
    )
    assert len(out[0]) == 4
    return time.perf_counter() - start


def _bare_server_rejection_seconds(request: generate_pb2.GenerateRequest, times: int = 3) -> float:
    """The fastest a gRPC server on this machine can turn this request away: one that aborts as
    soon as the message arrived (15-60 ms for 10 MB on a loaded 2-core machine)."""
    from concurrent import futures

    def reject(_request, context):
        context.abort(INVALID, "rejected")
        yield

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    handler = grpc.method_handlers_generic_handler(
        "bare.Gateway",
        {
            "Generate": grpc.unary_stream_rpc_method_handler(
                reject, request_deserializer=generate_pb2.GenerateRequest.FromString
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            call = ch.unary_stream(
                "/bare.Gateway/Generate", request_serializer=generate_pb2.GenerateRequest.SerializeToString
            )
            best = math.inf
            for _ in range(times):
                start = time.perf_counter()
                with pytest.raises(grpc.RpcError):
                    list(call(request, timeout=30))
                best = min(best, time.perf_counter() - start)
            return best
    finally:
        server.stop(None)


def test_a_huge_stop_string_and_prompt_are_rejected_at_once_and_delay_no_one(cluster):
    cluster, client = cluster
    huge = {"1 MB stop string": ("hi", dict(stop=["s" * (1 << 20)])), "10 MB prompt": ("p" * (10 << 20), {})}
    transport = _bare_server_rejection_seconds(generate_pb2.GenerateRequest(prompt=huge["10 MB prompt"][0]))
    baseline = statistics.median(_latency(client, i) for i in range(8))
    during: list[float] = []
    done = threading.Event()

    def small_requests():
        i = 0
        while not done.is_set():
            during.append(_latency(client, 100 + i))
            i += 1

    # The hostile client has a connection of its own (on a shared one, the small requests would
    # queue behind its 10 MB in the client's own HTTP/2 stream).
    hostile = StrataClient(cluster.gateway_address)
    thread = threading.Thread(target=small_requests)
    thread.start()
    rejections: dict[str, list[float]] = {name: [] for name in huge}
    try:
        for _ in range(3):
            for name, (prompt, params) in huge.items():
                start = time.perf_counter()
                with pytest.raises(grpc.RpcError) as err:
                    list(hostile.generate(prompt, max_tokens=4, timeout=30, **params))
                rejections[name].append(time.perf_counter() - start)
                assert err.value.code() == INVALID, err.value.details()
                assert ("stop" if "stop" in name else "prompt") in err.value.details()
    finally:
        done.set()
        thread.join(timeout=60)
        hostile.close()
    fastest = {name: min(times) for name, times in rejections.items()}
    moved = statistics.median(during) - baseline
    print(
        f"rejected in {', '.join(f'{n}: {t * 1000:.1f} ms' for n, t in fastest.items())} "
        f"(a bare gRPC server: {transport * 1000:.1f} ms for the 10 MB); small requests {baseline * 1000:.0f} ms "
        f"alone, {moved * 1000:+.1f} ms meanwhile (median of {len(during)})"
    )
    # 100 ms each (before the limits: 9-13 s). The 10 MB prompt is refused from the wire format,
    # unparsed; what remains is moving it through gRPC, so a machine slower at that than 50 ms
    # gets the difference.
    assert fastest["1 MB stop string"] < 0.1
    assert fastest["10 MB prompt"] < max(0.1, transport + 0.05)
    assert during and moved < 0.1
    assert scheduler_stats(cluster).used_kv_blocks == 0
