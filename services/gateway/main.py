"""`strata gateway`: the public API in front of the scheduler (or of several: one per data-parallel
replica, services/gateway/replicas.py)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
from grpc_reflection.v1alpha import reflection
from transformers import AutoTokenizer

from strata.gc_tuning import tune_for_serving
from strata.grpc_util import add_service, bind, new_server, set_serving, wait_for_termination_signal
from strata.model_source import resolve_model
from strata.services.gateway.http_api import http_server
from strata.services.gateway.replicas import ReplicaSet
from strata.services.gateway.server import (
    GENERATE_PROMPT_FIELD,
    TOKENIZE_PROMPT_FIELD,
    Gateway,
    GatewayError,
    GatewayServicer,
)
from strata.services.gateway.validation import Limits
from strata.v1 import generate_pb2

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
    addresses = [a.strip() for a in args.scheduler_address.split(",") if a.strip()]
    if not addresses:
        raise SystemExit("--scheduler-address names no scheduler")
    replicas = ReplicaSet.connect(addresses, args.cluster_token, failover_seconds=args.replica_failover_seconds)
    limits = Limits(
        args.max_prompt_chars,
        args.max_stop_strings,
        args.max_stop_length,
        args.max_response_bytes,
        args.max_completion_prompts,
    )
    gateway = Gateway(replicas, tokenizer, name, api_key=args.api_key, limits=limits)
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
    # Serving once a scheduler answers: it only answers when its pipeline is up.
    while True:
        try:
            await gateway.model_info()
            break
        except GatewayError as e:
            log.info("waiting for the scheduler at %s: %s", args.scheduler_address, e.message)
            await asyncio.sleep(1.0)
    tune_for_serving()

    async def on_serving(serving: bool) -> None:  # SERVING while any replica is
        await set_serving(health, service_names, serving=serving)

    watch = asyncio.create_task(replicas.follow(on_serving), name="replicas")
    log.info(
        "gateway on %s:%d%s (model %s%s)",
        args.host,
        port,
        f", OpenAI-compatible HTTP on {args.host}:{args.http_port}" if http else "",
        name,
        f", {len(addresses)} replicas" if len(addresses) > 1 else "",
    )
    await wait_for_termination_signal()
    watch.cancel()
    if http is not None:
        http.should_exit = True
        await http_task
    await server.stop(grace=2.0)
    await replicas.close()


def run(args) -> int:
    asyncio.run(serve(args))
    return 0
