"""`strata gateway`: the public API in front of the scheduler."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from transformers import AutoTokenizer

from strata.gc_tuning import tune_for_serving
from strata.grpc_util import add_service, aio_channel, bind, new_server, set_serving, wait_for_termination_signal
from strata.model_source import resolve_model
from strata.services.gateway.http_api import http_server
from strata.services.gateway.server import (
    GENERATE_PROMPT_FIELD,
    TOKENIZE_PROMPT_FIELD,
    Gateway,
    GatewayError,
    GatewayServicer,
)
from strata.services.gateway.validation import Limits
from strata.v1 import engine_pb2_grpc, generate_pb2

log = logging.getLogger("strata.gateway")


def load_tokenizer(model: str | None, tokenizer: str | None = None):
    """(tokenizer, model name): --tokenizer's directory, else the model directory's."""
    model_path, dummy = (None, None) if tokenizer else resolve_model(model)
    if dummy:
        raise SystemExit(
            "the gateway needs a tokenizer: give it a model directory or --tokenizer DIR, not a dummy preset"
        )
    name = Path(model).name if model else Path(model_path or tokenizer).name
    return AutoTokenizer.from_pretrained(tokenizer or model_path), name


async def serve(args) -> None:
    tokenizer, name = load_tokenizer(args.model, args.tokenizer)
    name = args.served_model_name or name
    channel = aio_channel(args.scheduler_address, args.cluster_token)
    limits = Limits(
        args.max_prompt_chars,
        args.max_stop_strings,
        args.max_stop_length,
        args.max_response_bytes,
        args.max_completion_prompts,
    )
    gateway = Gateway(engine_pb2_grpc.SchedulerStub(channel), tokenizer, name, api_key=args.api_key, limits=limits)
    server, health = new_server(max_receive_bytes=args.max_request_bytes)
    add_service(
        server,
        GatewayServicer(gateway),
        generate_pb2.DESCRIPTOR.services_by_name["Gateway"],
        prechecks={
            "Generate": gateway.prompt_precheck(GENERATE_PROMPT_FIELD),
            "Tokenize": gateway.prompt_precheck(TOKENIZE_PROMPT_FIELD),
        },
    )
    service_names = [generate_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name]
    reflection.enable_server_reflection([*service_names, reflection.SERVICE_NAME, "grpc.health.v1.Health"], server)
    address = f"{args.host}:{args.port}"
    if args.tls_cert:
        creds = grpc.ssl_server_credentials([(Path(args.tls_key).read_bytes(), Path(args.tls_cert).read_bytes())])
        port = server.add_secure_port(address, creds)
    else:
        port = bind(server, args.host, args.port)
    http = http_server(gateway, args.host, args.http_port) if args.http_port else None
    await set_serving(health, service_names, serving=False)
    await server.start()
    http_task = asyncio.create_task(http.serve(), name="http") if http else None
    # Serving once the scheduler answers: it only answers when its pipeline is up.
    while True:
        try:
            await gateway.model_info()
            break
        except GatewayError as e:
            log.info("waiting for the scheduler at %s: %s", args.scheduler_address, e.message)
            await asyncio.sleep(1.0)
    tune_for_serving()
    watch = asyncio.create_task(follow_scheduler_health(channel, health, service_names), name="health")
    log.info(
        "gateway on %s:%d%s (model %s)",
        args.host,
        port,
        f", OpenAI-compatible HTTP on {args.host}:{args.http_port}" if http else "",
        name,
    )
    await wait_for_termination_signal()
    watch.cancel()
    if http is not None:
        http.should_exit = True
        await http_task
    await server.stop(grace=2.0)
    await channel.close()


async def follow_scheduler_health(channel, health, service_names: list[str], interval: float = 1.0) -> None:
    """SERVING exactly while the scheduler says it is (it says so only while its pipeline is up)."""
    stub = health_pb2_grpc.HealthStub(channel)
    serving = None
    while True:
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=interval)
            now = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            now = False
        if now != serving:
            serving = now
            await set_serving(health, service_names, serving=now)
            log.log(logging.INFO if now else logging.WARNING, "scheduler %s", "serving" if now else "NOT serving")
        await asyncio.sleep(interval)


def run(args) -> int:
    asyncio.run(serve(args))
    return 0
