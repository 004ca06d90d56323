"""Gateway service: the public API. Authorises, tokenizes and validates a request, then runs it
through the n > 1 fan-out (fanout.py), which streams merged, detokenized outputs back."""
from __future__ import annotations

import logging
import uuid

import grpc

from strata.services.gateway.fanout import ChildFailed, merged_responses
from strata.services.gateway.prefix_groups import GroupRunner
from strata.services.gateway.validation import InvalidRequest, validate_request
from strata.v1 import engine_pb2_grpc, generate_pb2, generate_pb2_grpc

log = logging.getLogger("strata.gateway")


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
        responses = merged_responses(self.scheduler, request_id, params, prompt_ids, info.eos_token_ids,
                                     self.tokenizer, self.request_timeout)
        try:
            async for response in responses:
                yield response
        except ChildFailed as e:
            await context.abort(e.code, f"child {e.index} of {request_id}: {e.details}")
        finally:
            await responses.aclose()  # the client went away: cancel every child

    async def GenerateGroups(self, request_iterator, context):
        await self._authorize(context)
        try:
            info = await self.model_info()
        except grpc.aio.AioRpcError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"scheduler unavailable: {e.details()}")
        responses = GroupRunner(self.scheduler, self.tokenizer, info, self.request_timeout).run(request_iterator)
        try:
            async for response in responses:
                yield response
        finally:
            await responses.aclose()  # the client went away: cancel every member
