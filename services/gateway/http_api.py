"""The gateway's OpenAI-compatible HTTP front: Starlette on uvicorn, inside the gateway's own
event loop, calling the same Gateway object as the gRPC front (no second network hop).

  GET  /v1/models            the served model
  POST /v1/completions       prompt (text or token ids, or several) -> text; streamed as server-sent events
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

from strata import openai_format, openai_prompts, openai_responses
from strata.openai_prompts import PromptView
from strata.prompt_tokens import PromptInput
from strata.protocol import MAX_LOGPROBS
from strata.services.gateway import response_size, tools
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


def _names_tokens(params: generate_pb2.SamplingParams) -> bool:
    """Whether a response names tokens by their text (logprobs of either kind)."""
    return params.HasField("logprobs") or params.HasField("prompt_logprobs")


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

    async def prompts_ids(inputs: list[PromptInput | list[int]]) -> list[list[int]]:
        """prompt_ids of several prompts, tokenized together."""
        texts = [(p, "messages" if p.is_chat else "prompt") for p in inputs if isinstance(p, PromptInput)]
        tokenized = iter(await gateway.prompts_ids(texts) if texts else ())
        out = [p if isinstance(p, list) else next(tokenized) for p in inputs]
        for ids in out:
            if isinstance(ids, InvalidRequest):
                raise ids
        return out

    async def prompt_views(body: dict, chat: bool, params, inputs, prompts, stream: bool) -> list[PromptView]:
        """What each prompt's choices show of it (openai_prompts), once the prompt part's size
        is checked against --max-response-bytes."""
        echo = openai_prompts.echo_of(body, chat)
        n = params.n or 1
        views = [PromptView("", echo, i * n) for i in range(len(prompts))]
        k = params.prompt_logprobs if params.HasField("prompt_logprobs") else None
        if echo is None and (k is None or k > MAX_LOGPROBS):  # (validation refuses k past the cap)
            return views
        texts = await gateway.token_texts()
        copies = 1 if chat else n
        sizes = [
            copies * response_size.json_bytes(ids, texts, k, echo is not None, bool(echo and echo.logprobs))
            for ids in prompts
        ]
        field = (
            "prompt_logprobs" if body.get("prompt_logprobs") is not None else "logprobs" if echo.logprobs else "echo"
        )
        response_size.check(max(sizes) if stream else sum(sizes), gateway.limits.max_response_bytes, field)
        if echo is not None:
            for view, prompt, ids in zip(views, inputs, prompts):
                view.text = (
                    prompt.text
                    if isinstance(prompt, PromptInput)
                    else await asyncio.to_thread(gateway.tokenizer.decode, ids)
                )
        return views

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
            if chat:
                inputs = [openai_format.prompt_input(body, chat)]
            else:
                inputs = openai_format.completion_inputs(body, gateway.limits.max_completion_prompts)
            prompts = await prompts_ids(inputs)
            views = await prompt_views(body, chat, params, inputs, prompts, stream)
        except (openai_format.BadField, InvalidRequest) as e:
            return error_response(400, str(e), e.field)
        except GatewayError as e:
            return _from_gateway(e)
        if chat and not params.HasField("max_tokens") and len(prompts[0]) < info.max_model_len:
            params.max_tokens = info.max_model_len - len(prompts[0])  # a chat answer may fill the context
        streams = [
            gateway.generate(
                generate_pb2.GenerateRequest(prompt_token_ids=generate_pb2.TokenIds(ids=ids), params=params)
            )
            for ids in prompts
        ]
        token_text = await gateway.token_texts() if _names_tokens(params) else decode_token
        if stream:
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await _streamed(streams, views, chat, info.model_name, usage, request, token_text, calls)
        return await _whole(streams, views, chat, info.model_name, request, token_text, calls)

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

    def decode_token(token_id: int) -> str:
        return gateway.tokenizer.decode([token_id])

    async def _whole(streams, views, chat: bool, model: str, request: Request, token_text, calls=None) -> Response:
        """The final response (of every prompt's request); a client that disconnects before it
        cancels them all."""

        async def final(responses):
            last = None
            async for response in responses:
                last = response
            return last

        work = asyncio.ensure_future(asyncio.gather(*(final(s) for s in streams)))
        try:
            while not work.done():
                await asyncio.wait([work], timeout=0.25)
                if not work.done() and await request.is_disconnected():
                    work.cancel()
                    with contextlib.suppress(asyncio.CancelledError, GatewayError):
                        await work
                    return Response(status_code=499)  # nobody is listening
            finals = work.result()
        except GatewayError as e:
            return _from_gateway(e)
        finally:  # a prompt that failed cancels the others
            for responses in streams:
                await responses.aclose()
        bodies = [openai_responses.response_body(r, chat, model, token_text, v) for r, v in zip(finals, views)]
        body = openai_prompts.merge_bodies(bodies)
        return JSONResponse(calls.message(body) if calls is not None else body)

    async def _streamed(
        streams, views, chat: bool, model: str, include_usage: bool, request: Request, token_text, calls=None
    ) -> Response:
        # The first responses decide the status: a request rejected at validation gets its 400.
        firsts = await asyncio.gather(*(anext(s, None) for s in streams), return_exceptions=True)
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:
            for responses in streams:
                await responses.aclose()
            if isinstance(failed, GatewayError):
                return _from_gateway(failed)
            raise failed
        rid, created = openai_responses.response_id(chat), int(time.time())
        texts: dict[int, str] = {}  # each output's text so far (tool calls)

        async def pump(i: int, merged: asyncio.Queue) -> None:
            """Prompt i's responses into `merged`, then None (or the error that ended them)."""
            try:
                response = firsts[i]
                while response is not None:
                    merged.put_nowait((i, response))
                    response = await anext(streams[i], None)
                merged.put_nowait((i, None))
            except GatewayError as e:
                merged.put_nowait((i, e))

        async def arrivals():
            """(prompt index, response) as they come; a prompt's failure raises its GatewayError.
            One prompt (most requests) is read as it comes, without a task in between."""
            if len(streams) == 1:
                response = firsts[0]
                while response is not None:
                    yield 0, response
                    response = await anext(streams[0], None)
                return
            merged: asyncio.Queue = asyncio.Queue()
            pumps = [asyncio.ensure_future(pump(i, merged)) for i in range(len(streams))]
            try:
                running = len(streams)
                while running:
                    i, response = await merged.get()
                    if isinstance(response, GatewayError):
                        raise response
                    if response is None:
                        running -= 1
                    else:
                        yield i, response
            finally:
                for task in pumps:
                    task.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)

        async def events():
            last: dict[int, generate_pb2.GenerateResponse] = {}
            started: list[set[int]] = [set() for _ in streams]
            responses = arrivals()
            try:
                async for i, response in responses:
                    last[i] = response
                    chunk = openai_responses.chunk_body(
                        response, chat, model, rid, created, started[i], token_text, views[i]
                    )
                    if calls is not None:
                        chunk = calls.chunk(chunk, texts)
                    yield f"data: {json.dumps(chunk)}\n\n"
                if include_usage and last:
                    usages = [views[i].usage(openai_responses.usage_body(r.usage)) for i, r in last.items()]
                    usage = {
                        "id": rid,
                        "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": openai_prompts.merge_usage(usages),
                    }
                    yield f"data: {json.dumps(usage)}\n\n"
            except GatewayError as e:
                yield f"data: {json.dumps(json.loads(_from_gateway(e).body))}\n\n"
            finally:  # also when the client disconnected: every request is cancelled
                await responses.aclose()
                for stream in streams:
                    await stream.aclose()
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
