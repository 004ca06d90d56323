"""Gateway service: the public API. Tokenizes, validates, fans n > 1 out into child requests,
merges their streams, detokenizes incrementally and applies stop strings."""
from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from strata.services.gateway.detokenizer import OutputTextStream
from strata.services.gateway.outputs import RequestOutputState
from strata.services.gateway.validation import InvalidRequest, child_requests, validate_request
from strata.v1 import engine_pb2, engine_pb2_grpc, generate_pb2, generate_pb2_grpc

log = logging.getLogger("strata.gateway")


class ChildFailed(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


class GatewayServicer(generate_pb2_grpc.GatewayServicer):
    def __init__(self, scheduler_stub: engine_pb2_grpc.SchedulerStub, tokenizer, model_name: str,
                 api_key: str | None = None, request_timeout: float = 3600.0):
        self.scheduler = scheduler_stub
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.request_timeout = request_timeout
        self._model_info: generate_pb2.ModelInfo | None = None

    async def model_info(self) -> generate_pb2.ModelInfo:
        if self._model_info is None:
            info = await self.scheduler.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=30)
            info.model_name = self.model_name
            self._model_info = info
        return self._model_info

    async def _authorize(self, context) -> None:
        if self.api_key is None:
            return
        meta = dict(context.invocation_metadata() or ())
        if meta.get("authorization") != f"Bearer {self.api_key}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def GetModelInfo(self, request, context):
        await self._authorize(context)
        try:
            return await self.model_info()
        except grpc.aio.AioRpcError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"scheduler unavailable: {e.details()}")

    def _prompt_ids(self, request) -> list[int]:
        which = request.WhichOneof("prompt_input")
        if which == "prompt_token_ids":
            return list(request.prompt_token_ids.ids)
        if which == "prompt" and request.prompt:
            return self.tokenizer.encode(request.prompt)
        raise InvalidRequest("prompt", "prompt is empty: set prompt or prompt_token_ids")

    async def Generate(self, request, context):
        await self._authorize(context)
        try:
            info = await self.model_info()
        except grpc.aio.AioRpcError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"scheduler unavailable: {e.details()}")
        request_id = request.request_id or uuid.uuid4().hex
        try:
            prompt_ids = self._prompt_ids(request)
            params = validate_request(request, prompt_ids, vocab_size=info.vocab_size,
                                      max_model_len=info.max_model_len)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

        children = child_requests(request_id, params, prompt_ids)
        state = RequestOutputState(request_id, len(children), params.output_kind,
                                   params.logprobs is not None, len(prompt_ids))
        texts = [OutputTextStream(self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens,
                                  stop=params.stop, min_tokens=params.min_tokens) for _ in children]
        finished = [False] * len(children)
        merged: asyncio.Queue = asyncio.Queue()
        calls = [self.scheduler.Submit(child, timeout=self.request_timeout) for child in children]
        readers = [asyncio.create_task(_pump(i, call, merged)) for i, call in enumerate(calls)]
        try:
            remaining = len(children)
            while remaining:
                index, out = await merged.get()
                if isinstance(out, ChildFailed):
                    await context.abort(out.code, f"child {index} of {request_id}: {out.details}")
                if finished[index]:
                    continue
                response, finished[index] = _advance(index, texts[index], out, state, calls[index])
                remaining -= finished[index]
                if response is not None:
                    yield response
        finally:
            # Client gone, a child failed, or all done: cancelling a child aborts it in the
            # scheduler, which frees its blocks at once.
            for call in calls:
                call.cancel()
            for task in readers:
                task.cancel()


def _advance(index: int, text_stream: OutputTextStream, out: engine_pb2.EngineOutput, state: RequestOutputState,
             call) -> tuple[generate_pb2.GenerateResponse | None, bool]:
    """Applies one scheduler output of child `index`; returns (response to send, child finished)."""
    finish_reason, stop_reason = out.finish_reason, out.stop_reason
    # The scheduler finishes with "stop" only on an EOS or stop token, which stays out of the text.
    text, matched = text_stream.push(out.token_ids, finished=bool(finish_reason),
                                     ends_with_stop_token=finish_reason == "stop")
    if matched is not None:
        finish_reason, stop_reason = "stop", matched
        call.cancel()  # the stop string was found here: the scheduler frees the child's blocks
    response = state.update(index, text, list(out.token_ids), list(out.logprobs), finish_reason, stop_reason,
                            out.cached_prompt_tokens)
    return response, bool(finish_reason)


async def _pump(index: int, call, merged: asyncio.Queue) -> None:
    try:
        async for out in call:
            merged.put_nowait((index, out))
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            merged.put_nowait((index, ChildFailed(e.code(), e.details())))
    except asyncio.CancelledError:
        pass
