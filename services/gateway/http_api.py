"""The gateway's OpenAI-compatible HTTP front: Starlette on uvicorn, inside the gateway's own
event loop, calling the same Gateway object as the gRPC front (no second network hop).

  GET  /v1/models            the served model
  POST /v1/completions       prompt (text or token ids) -> text; streamed as server-sent events
  POST /v1/chat/completions  messages through the model's chat template
  POST /tokenize             a prompt or messages -> {count, max_model_len, tokens} (vLLM's shapes)
  POST /detokenize           {tokens} -> {prompt}
  GET  /health               200 while a scheduler (any replica's) answers, else 503
  GET  /metrics              the gateway's Prometheus metrics

Errors use OpenAI's JSON shape, {"error": {"message", "type", "param", "code"}}, with 400 for bad
input (naming the field), 401 without the API key when one is set, 404 for another model's name,
and 503 while the pipeline is down. A client that disconnects aborts its request: streamed or
not, every child is cancelled and its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from strata import openai_format
from strata.prompt_tokens import PromptInput
from strata.services.gateway import tools
from strata.services.gateway.server import Gateway, GatewayError
from strata.services.gateway.validation import InvalidRequest
from strata.v1 import generate_pb2

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def error_response(status: int, message: str, param: str | None = None, kind: str | None = None) -> JSONResponse:
    kind = kind or {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        503: "service_unavailable",
    }.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _from_gateway(e: GatewayError) -> JSONResponse:
    # validation names fields as "params.max_tokens": OpenAI's bodies name them plainly
    param = e.field.removeprefix("params.") if e.field else None
    return error_response(_HTTP_STATUS.get(e.code, 500), e.message, param)


def build_app(gateway: Gateway) -> Starlette:
    async def authorize(request: Request) -> JSONResponse | None:
        if not gateway.authorized(request.headers.get("authorization")):
            return error_response(401, "missing or wrong API key (Authorization: Bearer KEY)")
        return None

    async def models(request: Request) -> Response:
        if (denied := await authorize(request)) is not None:
            return denied
        try:
            info = await gateway.model_info()
        except GatewayError as e:
            return _from_gateway(e)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": info.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "strata",
                        "max_model_len": info.max_model_len,
                    }
                ],
            }
        )

    async def health(request: Request) -> Response:
        if (e := await gateway.replicas.probe(timeout=2)) is not None:  # no replica's scheduler answers
            return error_response(503, f"scheduler unavailable: {e.code().name}")
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        return Response(gateway.metrics.exposition(), media_type="text/plain; version=0.0.4")

    async def json_body(request: Request) -> dict | JSONResponse:
        """The request's JSON object, or the response that refuses the request."""
        if (denied := await authorize(request)) is not None:
            return denied
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(400, "the body must be JSON")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object")
        return body

    async def served_model(body: dict) -> generate_pb2.ModelInfo | JSONResponse:
        """The model info, or a 404 when the body names another model (or 503 without a scheduler)."""
        try:
            info = await gateway.model_info()
        except GatewayError as e:
            return _from_gateway(e)
        if body.get("model") not in (None, info.model_name):
            return error_response(
                404, f"model {body['model']!r} is not served here (it serves {info.model_name!r})", "model"
            )
        return info

    async def prompt_ids(prompt: PromptInput | list[int]) -> list[int]:
        """Gateway.prompt_ids, the path Generate and Tokenize share; ids pass through."""
        if isinstance(prompt, list):
            return prompt
        return await gateway.prompt_ids(prompt, "messages" if prompt.is_chat else "prompt")

    async def generate(request: Request, chat: bool) -> Response:
        if isinstance(body := await json_body(request), Response):
            return body
        if isinstance(info := await served_model(body), Response):
            return info
        try:
            stream = bool(body.get("stream", False))
            kind = generate_pb2.DELTA if stream else generate_pb2.FINAL_ONLY
            params = openai_format.sampling_params(body, chat, kind)
            calls = tools.tool_calls(body, params) if chat else None
            prompt = await prompt_ids(openai_format.prompt_input(body, chat))
        except openai_format.BadField as e:
            return error_response(400, str(e), e.field)
        except InvalidRequest as e:
            return error_response(400, str(e), e.field)
        except GatewayError as e:
            return _from_gateway(e)
        if chat and not params.HasField("max_tokens") and len(prompt) < info.max_model_len:
            params.max_tokens = info.max_model_len - len(prompt)  # a chat answer may fill the context
        generate_request = generate_pb2.GenerateRequest(
            prompt_token_ids=generate_pb2.TokenIds(ids=prompt), params=params
        )
        responses = gateway.generate(generate_request)
        if stream:
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await _streamed(responses, chat, info.model_name, usage, request, calls)
        return await _whole(responses, chat, info.model_name, request, calls)

    async def tokenize(request: Request) -> Response:
        if isinstance(body := await json_body(request), Response):
            return body
        if isinstance(info := await served_model(body), Response):
            return info
        try:
            ids = await prompt_ids(openai_format.tokenize_input(body))
        except (openai_format.BadField, InvalidRequest) as e:
            return error_response(400, str(e), e.field)
        except GatewayError as e:
            return _from_gateway(e)
        return JSONResponse({"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids})

    async def detokenize(request: Request) -> Response:
        if isinstance(body := await json_body(request), Response):
            return body
        if isinstance(info := await served_model(body), Response):
            return info
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            return error_response(400, "tokens: must be a list of integers", "tokens")
        try:
            response = await gateway.detokenize(generate_pb2.DetokenizeRequest(tokens=tokens))
        except ValueError:  # an id outside int32: certainly not in the vocabulary
            return error_response(400, f"tokens must be in [0, {info.vocab_size})", "tokens")
        except GatewayError as e:
            return _from_gateway(e)
        return JSONResponse({"prompt": response.prompt})

    def token_text(token_id: int) -> str:
        return gateway.tokenizer.decode([token_id])

    async def _whole(responses, chat: bool, model: str, request: Request, calls=None) -> Response:
        """The final response; a client that disconnects before it cancels the request."""

        async def final():
            last = None
            async for response in responses:
                last = response
            return last

        work = asyncio.ensure_future(final())
        try:
            while not work.done():
                await asyncio.wait([work], timeout=0.25)
                if not work.done() and await request.is_disconnected():
                    work.cancel()
                    with contextlib.suppress(asyncio.CancelledError, GatewayError):
                        await work
                    await responses.aclose()
                    return Response(status_code=499)  # nobody is listening
            response = work.result()
        except GatewayError as e:
            return _from_gateway(e)
        body = openai_format.response_body(response, chat, model, token_text)
        return JSONResponse(calls.message(body) if calls is not None else body)

    async def _streamed(
        responses, chat: bool, model: str, include_usage: bool, request: Request, calls=None
    ) -> Response:
        # The first response decides the status: a request rejected at validation gets its 400.
        try:
            first = await responses.__anext__()
        except GatewayError as e:
            return _from_gateway(e)
        except StopAsyncIteration:
            first = None
        rid, created, started = openai_format.response_id(chat), int(time.time()), set()
        texts: dict[int, str] = {}  # each output's text so far (tool calls)

        async def events():
            last = None
            try:
                response = first
                while response is not None:
                    last = response
                    chunk = openai_format.chunk_body(response, chat, model, rid, created, started, token_text)
                    if calls is not None:
                        chunk = calls.chunk(chunk, texts)
                    yield f"data: {json.dumps(chunk)}\n\n"
                    response = await anext(responses, None)
                if include_usage and last is not None:
                    usage = {
                        "id": rid,
                        "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": openai_format.usage_body(last.usage),
                    }
                    yield f"data: {json.dumps(usage)}\n\n"
            except GatewayError as e:
                yield f"data: {json.dumps(json.loads(_from_gateway(e).body))}\n\n"
            finally:  # also when the client disconnected: the request is cancelled
                await responses.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    return Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ]
    )


class EmbeddedServer(uvicorn.Server):
    """uvicorn inside the gateway's event loop: the gateway, not uvicorn, handles SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def http_server(gateway: Gateway, host: str, port: int) -> EmbeddedServer:
    config = uvicorn.Config(
        build_app(gateway), host=host, port=port, log_level="warning", lifespan="off", access_log=False
    )
    return EmbeddedServer(config)
