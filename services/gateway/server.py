"""The gateway: one generation path for both public fronts.

Gateway (the core) authorises, tokenizes and validates a request, then runs it through the n > 1
fan-out (fanout.py), which streams merged, detokenized outputs back; it records the serving
metrics. GatewayServicer is the gRPC front over it (the primary contract); http_api.py is the
OpenAI-compatible HTTP front over the same object, in the same process and event loop.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

import grpc

from strata.services.gateway.fanout import ChildFailed, merged_responses, scheduler_streams
from strata.services.gateway.metrics import GatewayMetrics, RequestTimer
from strata.services.gateway.prefix_groups import GroupRunner
from strata.services.gateway.validation import InvalidRequest, Limits, top_level_field_size, validate_request
from strata.v1 import engine_pb2_grpc, generate_pb2, generate_pb2_grpc

PROMPT_FIELD = generate_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["prompt"].number

log = logging.getLogger("strata.gateway")


class GatewayError(Exception):
    """A request that cannot be served: a gRPC status and a message (naming the field at fault
    for bad input)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


class Gateway:
    def __init__(
        self,
        scheduler_stub: engine_pb2_grpc.SchedulerStub,
        tokenizer,
        model_name: str,
        api_key: str | None = None,
        request_timeout: float = 3600.0,
        metrics: GatewayMetrics | None = None,
        limits: Limits | None = None,
    ):
        self.scheduler = scheduler_stub
        self.limits = limits or Limits()
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.request_timeout = request_timeout
        self.metrics = metrics or GatewayMetrics()
        self._model_info: generate_pb2.ModelInfo | None = None

    def authorized(self, authorization: str | None) -> bool:
        """The `authorization` metadata or header: `Bearer KEY` when an API key is set."""
        return self.api_key is None or authorization == f"Bearer {self.api_key}"

    async def model_info(self) -> generate_pb2.ModelInfo:
        if self._model_info is None:
            try:
                info = await self.scheduler.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=30)
            except grpc.aio.AioRpcError as e:
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"scheduler unavailable: {e.details()}") from None
            info.model_name = self.model_name
            self._model_info = info
        return self._model_info

    async def encode(self, text: str, field: str = "prompt", special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt's text. Its length is checked before it is tokenized, and a long
        one is tokenized on a thread, so a huge prompt is cheap to reject and never stalls the
        event loop (every other call, health checks included)."""
        limit = self.limits.prompt_chars((await self.model_info()).max_model_len)
        if len(text) > limit:
            raise InvalidRequest(field, f"{field} has {len(text):,} characters; at most {limit:,}")
        if len(text) < 4096:
            return self.tokenizer.encode(text, add_special_tokens=special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=special_tokens)

    async def refuse_huge_prompt(self, raw: bytes) -> str | None:
        """Generate's check before parsing: a prompt of more than 4 bytes per allowed character is
        too long whatever its text (UTF-8 takes at most 4), and refusing it from the wire format
        spares the event loop the parse and the text's copy (about 80 ms for 10 MB on 2 cores)."""
        try:
            limit = self.limits.prompt_chars((await self.model_info()).max_model_len)
        except GatewayError:
            return None  # the scheduler is away: Generate itself says so
        size = top_level_field_size(raw, PROMPT_FIELD)
        if size > 4 * limit:
            return f"prompt has more than {limit:,} characters ({size:,} bytes); at most {limit:,}"
        return None

    async def _prompt_ids(self, request: generate_pb2.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt_input")
        if which == "prompt_token_ids":
            return list(request.prompt_token_ids.ids)
        if which == "prompt":
            prompt = request.prompt  # each read copies the whole text out of the message: once
            if prompt:
                return await self.encode(prompt)
        raise InvalidRequest("prompt", "prompt is empty: set prompt or prompt_token_ids")

    async def generate(self, request: generate_pb2.GenerateRequest) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """The request's responses, in its output kind. Raises GatewayError. Closing the
        generator early (the client went away) cancels every child, freeing its KV blocks."""
        info = await self.model_info()
        request_id = request.request_id or uuid.uuid4().hex
        try:
            prompt_ids = await self._prompt_ids(request)
            params = validate_request(
                request,
                prompt_ids,
                vocab_size=info.vocab_size,
                max_model_len=info.max_model_len,
                max_stop_strings=self.limits.max_stop_strings,
                max_stop_length=self.limits.max_stop_length,
            )
        except InvalidRequest as e:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field) from None
        timer = RequestTimer(self.metrics, params.n, timed=scheduler_streams(params))
        responses = merged_responses(
            self.scheduler,
            request_id,
            params,
            prompt_ids,
            info.eos_token_ids,
            self.tokenizer,
            self.request_timeout,
            on_output=timer.output,
        )
        try:
            async for response in responses:
                timer.response(response)
                yield response
        except ChildFailed as e:
            timer.close("error")
            raise GatewayError(e.code, f"child {e.index} of {request_id}: {e.details}") from None
        finally:
            timer.close()  # the client went away: its unfinished outputs count as aborted
            await responses.aclose()

    async def generate_groups(self, groups) -> AsyncIterator[generate_pb2.GroupResponse]:
        responses = GroupRunner(self, await self.model_info()).run(groups)
        try:
            async for response in responses:
                yield response
        finally:
            await responses.aclose()


class GatewayServicer(generate_pb2_grpc.GatewayServicer):
    """The gRPC front: maps GatewayError to the call's status."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    async def _authorize(self, context) -> None:
        if not self.gateway.authorized(dict(context.invocation_metadata() or ()).get("authorization")):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def GetModelInfo(self, request, context):
        await self._authorize(context)
        try:
            return await self.gateway.model_info()
        except GatewayError as e:
            await context.abort(e.code, e.message)

    async def Generate(self, request, context):
        await self._authorize(context)
        responses = self.gateway.generate(request)
        try:
            async for response in responses:
                yield response
        except GatewayError as e:
            await context.abort(e.code, e.message)
        finally:
            await responses.aclose()  # the client went away: cancel every child

    async def GenerateGroups(self, request_iterator, context):
        await self._authorize(context)
        responses = self.gateway.generate_groups(request_iterator)
        try:
            async for response in responses:
                yield response
        except GatewayError as e:
            await context.abort(e.code, e.message)
        finally:
            await responses.aclose()  # the client went away: cancel every member
