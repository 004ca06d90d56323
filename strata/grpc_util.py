"""gRPC plumbing shared by every service: servers with health and channels with sane options."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

# Activations of a large prefill step exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 1 << 30
MAX_PENDING_CALLS = 100_000
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A peer that restarts is reached again within about a second of listening (gRPC's default
    # backoff grows to two minutes).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
SERVER_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
    # Calls that arrived but that the server's loop has not picked up yet: past gRPC's limits
    # (1,000 soft, 3,000 hard) new calls are CANCELLED, so a burst of 5,000 streams lost 2,000.
    # Each costs a few hundred bytes until picked up; the request-size limit bounds its message.
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
]

log = logging.getLogger("strata")


def cluster_token() -> str | None:
    """The token every internal RPC carries and every internal service requires: --cluster-token,
    or $STRATA_CLUSTER_TOKEN (`strata serve` generates one for the processes it starts)."""
    return os.environ.get("STRATA_CLUSTER_TOKEN") or None


def bearer(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token else []


class _WithMetadata:
    """Adds metadata (the cluster token) to every call of a channel. grpc.aio files each
    interceptor under the first call type it implements, so there is one subclass per type."""

    def __init__(self, metadata: list[tuple[str, str]]):
        self.metadata = metadata

    async def _intercept(self, continuation, details, request):
        details = details._replace(metadata=grpc.aio.Metadata(*list(details.metadata or ()), *self.metadata))
        return await continuation(details, request)


class _UnaryUnaryMetadata(_WithMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _WithMetadata._intercept


class _UnaryStreamMetadata(_WithMetadata, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _WithMetadata._intercept


class _StreamUnaryMetadata(_WithMetadata, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _WithMetadata._intercept


class _StreamStreamMetadata(_WithMetadata, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _WithMetadata._intercept


def aio_channel(address: str, token: str | None = None, intercept_streams: bool = True) -> grpc.aio.Channel:
    """A channel to an internal service; every call carries the cluster token when one is set.
    intercept_streams=False: bidirectional streams do not (their caller passes
    metadata=bearer(token)): grpc.aio proxies each write of an intercepted stream through a queue
    and two tasks, which a stream written every step should not pay."""
    interceptors = None
    if token:
        kinds = [_UnaryUnaryMetadata, _UnaryStreamMetadata, _StreamUnaryMetadata]
        if intercept_streams:
            kinds.append(_StreamStreamMetadata)
        interceptors = [kind(bearer(token)) for kind in kinds]
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)


def add_service(
    server: grpc.aio.Server, servicer, service, token: str | None = None, prechecks=None, raw_too=()
) -> None:
    """Registers servicer's methods for `service` (a ServiceDescriptor) and, unlike the generated
    add_*_to_server, parses requests itself: an undecodable message gets INVALID_ARGUMENT (not
    UNKNOWN), and with `token` every call must carry `authorization: Bearer TOKEN`
    (UNAUTHENTICATED otherwise). prechecks: method name -> async check of a request's raw bytes
    before it is parsed, returning an INVALID_ARGUMENT message or None (refuses a huge message
    without parsing it). raw_too: client-streaming methods whose requests come as (raw bytes,
    message) pairs (a worker relays a plan's bytes as they came)."""
    prechecks = prechecks or {}
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        behavior = getattr(servicer, method.name)
        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handler = _checked(
            behavior,
            request_cls,
            method.client_streaming,
            method.server_streaming,
            token,
            prechecks.get(method.name),
            method.name in raw_too,
        )
        handlers[method.name] = factory(
            handler, request_deserializer=None, response_serializer=response_cls.SerializeToString
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _checked(
    behavior,
    request_cls,
    client_streaming: bool,
    server_streaming: bool,
    token: str | None,
    precheck=None,
    raw_too: bool = False,
):
    expected = f"Bearer {token}" if token else None

    async def authorize(context) -> None:
        if expected and dict(context.invocation_metadata() or ()).get("authorization") != expected:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

    async def parse(raw: bytes, context):
        if precheck is not None and (problem := await precheck(raw)):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            return request_cls.FromString(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable {request_cls.__name__}: {e}")

    async def requests(raw_iterator, context):
        async for raw in raw_iterator:
            message = await parse(raw, context)
            yield (raw, message) if raw_too else message

    if client_streaming and server_streaming:

        async def handler(raw_iterator, context):
            await authorize(context)
            async for response in behavior(requests(raw_iterator, context), context):
                yield response
    elif client_streaming:

        async def handler(raw_iterator, context):
            await authorize(context)
            return await behavior(requests(raw_iterator, context), context)
    elif server_streaming:

        async def handler(raw: bytes, context):
            await authorize(context)
            async for response in behavior(await parse(raw, context), context):
                yield response
    else:

        async def handler(raw: bytes, context):
            await authorize(context)
            return await behavior(await parse(raw, context), context)

    return handler


def new_server(max_receive_bytes: int | None = None) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """An aio server with the standard health service registered (NOT_SERVING until ready).
    max_receive_bytes: the largest request message it takes (a public server's limit; internal
    ones take activations of large steps)."""
    options = SERVER_OPTIONS
    if max_receive_bytes:
        options = [o for o in options if o[0] != "grpc.max_receive_message_length"]
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    server = grpc.aio.server(options=options)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return bound


async def set_serving(health_servicer, service_names: list[str], serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await health_servicer.set(name, status)


async def wait_for_termination_signal() -> None:
    """Returns on SIGINT or SIGTERM, so services stop gracefully in containers too."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def check_health(address: str, timeout: float = 3.0, service: str = "") -> bool:
    """Synchronous health probe (used by the CLI, compose health checks and tests)."""
    try:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
