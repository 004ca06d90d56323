"""`strata gateway`: the public API in front of the scheduler."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
from grpc_reflection.v1alpha import reflection
from transformers import AutoTokenizer

from strata.services.gateway.server import GatewayServicer
from strata.gc_tuning import tune_for_serving
from strata.grpc_util import aio_channel, bind, new_server, set_serving, wait_for_termination_signal
from strata.model_source import resolve_model
from strata.v1 import engine_pb2_grpc, generate_pb2, generate_pb2_grpc

log = logging.getLogger("strata.gateway")


def load_tokenizer(model: str | None):
    model_path, dummy = resolve_model(model)
    if dummy:
        raise SystemExit("the gateway needs a tokenizer: give it a model directory, not a dummy preset")
    return AutoTokenizer.from_pretrained(model_path), Path(model_path).name


async def serve(args) -> None:
    tokenizer, name = load_tokenizer(args.model)
    channel = aio_channel(args.scheduler_address)
    servicer = GatewayServicer(engine_pb2_grpc.SchedulerStub(channel), tokenizer, name, api_key=args.api_key)
    server, health = new_server()
    generate_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    service_names = [generate_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name]
    reflection.enable_server_reflection([*service_names, reflection.SERVICE_NAME, "grpc.health.v1.Health"], server)
    address = f"{args.host}:{args.port}"
    if args.tls_cert:
        creds = grpc.ssl_server_credentials([(Path(args.tls_key).read_bytes(), Path(args.tls_cert).read_bytes())])
        port = server.add_secure_port(address, creds)
    else:
        port = bind(server, args.host, args.port)
    await set_serving(health, service_names, serving=False)
    await server.start()
    # Serving once the scheduler answers: it only answers when its pipeline is up.
    while True:
        try:
            await servicer.model_info()
            break
        except grpc.aio.AioRpcError as e:
            log.info("waiting for the scheduler at %s: %s", args.scheduler_address, e.code().name)
            await asyncio.sleep(1.0)
    tune_for_serving()
    await set_serving(health, service_names)
    log.info("gateway on %s:%d (model %s)", args.host, port, name)
    await wait_for_termination_signal()
    await server.stop(grace=2.0)
    await channel.close()


def run(args) -> int:
    asyncio.run(serve(args))
    return 0
